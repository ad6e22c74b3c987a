"""Continuous batching: requests join and leave between steps.

One step, for every running sequence at once: ask the drafters (with a
deadline), plan the step within a token budget (`max_step_tokens`: decodes
first, each with its draft, then prompt chunks, the most overdue prompt
first), run ONE forward pass, verify, roll back rejected KV entries and
stream the committed tokens. KV blocks are taken as sequences grow; when a
step's decodes do not fit, their drafts go first, then the newest sequences
are preempted (blocks freed, recomputed from their tokens later, the output
unchanged). Model compute runs on a worker thread, never on the event loop.
An error that belongs to one sequence fails that sequence only; a step stuck
on the worker thread fails the requests waiting on it with DEADLINE_EXCEEDED.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

from specd import defaults
from specd.drafts import ROOT, DraftTree
from specd.errors import DeadlineExceeded, InternalError, ResourceExhausted, Unavailable
from specd.types import FINISH_REASON_NAMES
from target_svc.drafting.base import Window
from target_svc.drafting.auto import ShadowDraft
from target_svc.drafting.drafters import Answers, Drafters
from target_svc.cost_model import StepCostModel, StepShape
from target_svc.drafting.calibration import AcceptanceCalibration
from target_svc.drafting.gate import DraftingGate
from target_svc.drafting.length import DRAFT_MARGIN, MIN_SECONDS, choose_drafts
from target_svc.drafting.overhang import AskOverhang
from target_svc.metrics import TargetMetrics
from engine.features import FeatureLog
from engine.runner import ModelRunner, SequenceInput
from target_svc.sequence import Sequence, SequenceStatus, StepOutput
from target_svc.step_log import StepLog
from target_svc.verifier import VerifyInput, VerifyResult, verify

log = logging.getLogger(__name__)

# Share of the KV blocks admission leaves free, so that running sequences can grow a while before
# anyone is preempted.
ADMISSION_WATERMARK = 0.01
# Prompt work rides beside the decodes in like shares, so that steps stay alike, and with them the
# inter-token latency: a step may carry prompt work up to STEP_STRETCH - 1 times the decoding part of the
# batch it is building (its decodes and the joining prompts as one decoding step, plus the draft tokens
# recent steps verified and the drafters' round trip; priced by the cost model, where a chunk deep in a
# long prompt costs more per token), so a step with prompt work costs at most STEP_STRETCH plain ones.
# (Five times let the steps alternate between plain decodes and steps five times as long: at 32 clients
# the median gap fell on either, and its p99 was 2.2 to 5.9 times its p50 from one run to the next. At
# three, a third of the steps carried prompt work at three plain steps' cost and the rest none, so the
# median gap was a plain step's and the p99 a stretched one's: 1.8 to 2.9 times the median on a quiet
# machine, 3.8 in a long run on a busy one. At two, and a burst's steps at three, more steps carry less:
# 1.5 and 1.8 times, at the same throughput, TTFT p50 1.1-1.2 s against 1.0 s; `bench serve`, `none`,
# 32 clients, 128 prompts.)
# If the prompts need more, the step carries PREFILL_PACE times the prompt work arriving per step (a mean
# over about RECENT_STEPS steps), so that under a steady load the queue drains at an even pace, up to
# MAX_PACE_STRETCH times the decoding part: a load is served at what it costs, or its queue grows without
# bound. Or the joining prompts' remaining work over DRAIN_STEPS, so that a queue built up (a burst; a
# closed loop whose arrivals slowed because its batch shrank) drains, but then never past MAX_STRETCH
# times the decoding part: one long prompt, or a burst of them, must not slow every stream for many steps.
# (At 8, a level of `bench serve` at 32 clients whose first 32 requests arrived together with 11 long
# prompts among them ran 16 s of steps of ~650 ms, against a median gap of 128 ms: p99 5.1 times it. At
# 4, on other prompts after a level at 16 clients: gap p99/p50 1.29 against 2.28 at 8, at the same
# throughput, and with the most overdue prompts first TTFT p50 1.7 s against 1.5 s.)
# The most overdue prompts go first (`_most_overdue_first`), the step's first chunk at least
# MIN_PREFILL_CHUNK tokens. With nothing decoding a step takes what its token budget holds up to
# IDLE_STEP_SECONDS of prompt work: a 2,048-token chunk deep in an 8k prompt took 21 s on an AVX2 CPU (fp32),
# near the --step-timeout that declares the target stuck, and a request arriving meanwhile waited all of it.
STEP_STRETCH = 2.0
PREFILL_PACE = 1.25
DRAIN_STEPS = 16
MAX_STRETCH = 3.0
MAX_PACE_STRETCH = 4.0
MIN_PREFILL_CHUNK = 16
IDLE_STEP_SECONDS = 2.0
RECENT_STEPS = 64


@dataclass
class _PrefillBudget:
    """What prompt chunks may still add to a step: tokens, and seconds by the cost model."""
    tokens: int
    seconds: float


@dataclass
class Scheduled:
    """One sequence's share of a step: a decode (its newest token plus its draft tree, and the window of
    an in-target source whose guesses ride in the forward) or `num_new` tokens of the prefill (a prompt,
    or the tokens of a preempted sequence)."""
    seq: Sequence
    draft: DraftTree = field(default_factory=DraftTree)  # as the drafter estimated it, cut to what is verified
    num_new: int = 1
    draft_price: float = 0.0  # the decode tokens verifying the draft (and running the window) costs the batch
    window: Window | None = None
    window_seconds: float = 0.0  # what the window adds to the step, by the cost model
    guesses: list[int] = field(default_factory=list)  # the target's argmax at the window's guess nodes

    @property
    def is_decode(self) -> bool:
        return not self.seq.in_prefill

    @property
    def end(self) -> int:
        """Tokens the cache holds for the sequence once this step's are written."""
        if not self.is_decode:
            return self.seq.num_computed + self.num_new
        return self.seq.num_computed + 1 + len(self.draft) + len(self.window or ())

    @property
    def wants_logits(self) -> bool:
        """A decode, or the chunk that completes a prompt: its last position gives the first token."""
        seq = self.seq
        return self.is_decode or (seq.num_output == 0 and self.end == seq.prefill_target)

    def input(self) -> SequenceInput:
        seq, draft, window = self.seq, self.draft, self.window
        if not self.is_decode:
            return SequenceInput(seq.request_id, seq.tokens[seq.num_computed:self.end], seq.num_computed,
                                 int(self.wants_logits))
        tokens = [seq.tokens[-1], *draft.token_ids]
        if draft.is_chain and window is None:
            return SequenceInput(seq.request_id, tokens, seq.num_computed, len(tokens))
        # A tree: each node at its depth past the newest token, seeing only its ancestors (index + 1: the
        # newest token is row 0); a window's nodes after the draft's, only its guess nodes with logits.
        depths, parents, rows = [0, *draft.depths()], [-1, *(parent + 1 for parent in draft.parents)], []
        if window is not None:
            offset = len(tokens)
            tokens += window.token_ids
            depths += window.depths()
            parents += [0 if parent == ROOT else parent + offset for parent in window.parents]
            rows = [offset + node for node in window.guess_nodes]
        rows = [*range(1 + len(draft)), *rows]
        return SequenceInput(seq.request_id, tokens, seq.num_computed, len(rows),
                             positions=[seq.num_computed + depth for depth in depths], parents=parents, logit_rows=rows)

    def verify_input(self) -> VerifyInput:
        draft = self.draft
        return VerifyInput(self.seq.sampling, self.seq.tokens, list(draft.token_ids), self.seq.generator,
                           None if draft.is_chain else list(draft.parents))


class Scheduler:
    def __init__(self, runner: ModelRunner, compute_thread: ThreadPoolExecutor, drafters: Drafters,
                 metrics: TargetMetrics, max_num_seqs: int = 64, max_step_tokens: int = defaults.MAX_STEP_TOKENS,
                 cost_model: StepCostModel | None = None, max_waiting: int = defaults.MAX_WAITING,
                 step_timeout_s: float = defaults.STEP_TIMEOUT_S,
                 report_serving: Callable[[bool], Awaitable[None]] | None = None, step_log: StepLog | None = None):
        if max_step_tokens < max_num_seqs:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must be at least max_num_seqs ({max_num_seqs}): "
                             "every running sequence decodes at least one token a step")
        self._runner = runner
        self._drafters = drafters
        self._cost = cost_model or StepCostModel()
        self._metrics = metrics
        self._max_num_seqs = max_num_seqs
        self._max_step_tokens = max_step_tokens
        self._max_waiting = max_waiting
        self._step_timeout_s = step_timeout_s
        self._report_serving = report_serving  # told False while a step is stuck, True when it ends
        self._step_log = step_log  # where each step is written, if anywhere
        self._exported_quiet = None  # the profile's fit as last exported
        self._stuck = False
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # in admission order: the newest last, preempted first
        self._wake = asyncio.Event()
        self._compute_thread = compute_thread
        self._prompt_arrivals = 0.0  # prefill seconds submitted per step, a moving mean over ~RECENT_STEPS
        self._draft_seconds = 0.0  # seconds of the draft tokens a step verified, a moving mean likewise
        self._round_trip = 0.0  # seconds a step waits for the drafters, a moving mean likewise
        self._step_seconds = 0.0  # seconds of a step's forward and verification, likewise (set by the compute thread)
        self._forward_seconds = 0.0  # the latest step's forward and verification (set by the compute thread)
        self._host_seconds = 0.0  # seconds of a step beyond its forward and round trip, a moving mean likewise
        # The decodes' tokens per second over what plain decoding would make (a step of their newest tokens
        # alone, as the cost model prices it), a moving mean likewise: what a second of drafting costs `auto`
        # in tokens, beside plain decoding's rate (`MethodChooser._worth`).
        self._speedup = 1.0
        self._step_excess = 0.0  # what the latest step's forward ran over the cost model's prediction (likewise)
        self._overhang = AskOverhang()
        self._gates: dict[str, DraftingGate] = {}  # by method
        self._calibration = AcceptanceCalibration()
        self._arrived = 0.0  # prefill seconds submitted since the last step
        metrics.kv_blocks_total.set(runner.allocator.num_blocks)

    # -- requests -------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        if self._stuck:
            raise Unavailable(f"the target is stuck: a step has run over --step-timeout "
                              f"({self._step_timeout_s:g} s); retry later")
        if self._blocks_needed(seq) > self._runner.allocator.num_blocks:
            raise ResourceExhausted(f"prompt_token_ids: {len(seq.prompt)} prompt tokens + {seq.max_tokens} max tokens "
                                    f"need more KV cache than the server has "
                                    f"({self._runner.allocator.num_blocks * self._runner.allocator.block_size} tokens)")
        if len(self._waiting) >= self._max_waiting:
            self._metrics.requests_rejected.inc()
            raise ResourceExhausted(f"the server is at capacity: {len(self._waiting)} requests are waiting "
                                    f"(--max-waiting {self._max_waiting}); retry later")
        self._waiting.append(seq)
        self._arrived += self._cost.chunk_seconds(0, len(seq.prompt))
        self._metrics.requests_waiting.set(len(self._waiting))
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """The client went away: drop the sequence at the next step boundary (its KV may be in use now)."""
        seq.dropped = seq.dropped or "aborted"
        self._wake.set()

    # -- the loop -------------------------------------------------------------

    async def run(self) -> None:
        while True:
            if not (self._waiting or self._running):
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.step()
            except Exception:  # a bug in one step must not take the server down with it
                log.exception("step failed; failing the running requests")
                for seq in list(self._running):
                    self._fail(seq)

    async def step(self) -> None:
        step_started = time.perf_counter()
        self._drop_marked()
        self._prompt_arrivals = _moved(self._prompt_arrivals, self._arrived)
        self._arrived = 0.0
        decodes = [s for s in self._running if not s.in_prefill]
        # What decoding costs without drafts: the step's prompt chunks are done whatever is drafted, so
        # drafts, windows and round trips are weighed against this, in the tokens it decodes per second.
        plain_seconds = self._cost.predict(StepShape.of((s.num_computed, 1) for s in decodes)) + self._host_seconds
        wanting, asking = self._asking(decodes, plain_seconds)
        self._compare_at_probes(asking)
        shadows = self._shadows(asking)
        round_trip, answers = 0.0, Answers.none()
        if asking:
            asked = time.perf_counter()
            answers = await self._drafters.propose([pair for group in asking.values() for pair in group], shadows)
            round_trip = time.perf_counter() - asked
        self._round_trip = _moved(self._round_trip, round_trip)
        asked_ids = {seq.request_id for group in asking.values() for seq, _ in group}
        plan = self._plan(decodes, answers, asked_ids)
        if not plan:
            return
        # The step's prompt chunks, as planned: a prompt's last chunk is a decode once committed.
        chunks = [item.num_new for item in plan if not item.is_decode] if self._step_log is not None else []
        outcomes = await self._compute(plan)
        if wanting:  # a step that could have asked: whether it did is what the overhang compares
            self._overhang.observe(asking, self._step_excess)
        for method, group in asking.items():  # each asked sequence that verified, with what its draft gained the batch
            method_ids = {s.request_id for s, _ in group}
            verified = [(item, outcome) for item, outcome in zip(plan, outcomes)
                        if item.seq.request_id in method_ids and isinstance(outcome, VerifyResult)]
            gains = [(item.seq, outcome.num_accepted - item.draft_price) for item, outcome in verified]
            overhang = self._overhang.seconds(method)
            self._metrics.ask_overhang.labels(method).set(overhang)
            method_round_trip = answers.round_trips.get(method, round_trip) + overhang
            if method in answers.unanswered:
                self._gate(method).went_unanswered(method_round_trip)
            else:
                self._gate(method).asked(method_round_trip, gains)
            for (item, outcome), (_, gain) in zip(verified, gains):
                self._drafters.observe(item.seq, item.guesses, len(item.draft), outcome.path)
                if item.seq.chooser is not None:
                    item.seq.chooser.observe(method, gain, item.draft_price)
        realized = 0
        for item, outcome in zip(plan, outcomes):
            if isinstance(outcome, Exception):
                self._fail(item.seq)
            elif outcome is None:  # a prompt chunk with more to come
                item.seq.num_computed = item.end
            else:
                realized += (1 + outcome.num_accepted) * item.is_decode
                if item.draft:
                    self._calibration.observe(item.seq.drafting_method, item.draft, outcome.num_accepted)
                self._commit(item.seq, item.draft, outcome)
                if item.seq.chooser is not None:
                    item.seq.chooser.settle(item.seq.tokens, item.seq.status == SequenceStatus.FINISHED)
        self._metrics.realized_step_tokens.inc(realized)
        self._observe_speedup(realized, sum(item.is_decode for item in plan), plain_seconds,
                              time.perf_counter() - step_started)
        # What every step costs besides its forward: planning, committing, streaming the tokens out (on
        # this thread, partly while the forward runs). A plain step takes it too, so it is part of what
        # drafts and round trips are weighed against (left out, at batch 1 it was ~8% of a step).
        self._host_seconds = _moved(self._host_seconds,
                                    max(time.perf_counter() - step_started - round_trip - self._forward_seconds, 0.0))
        self._metrics.step_host.set(self._host_seconds)
        if self._step_log is not None:
            self._log_step(time.perf_counter() - step_started, round_trip, asking, plan, chunks, outcomes)
        self._export_cost()
        self._update_gauges()

    def _observe_speedup(self, realized: int, decodes: int, plain_seconds: float, seconds: float) -> None:
        """A step's decodes made `realized` tokens in `seconds`, where plain decoding would have made one
        each in `plain_seconds`."""
        if decodes and seconds > 0:
            self._speedup = _moved(self._speedup, (realized / seconds) / (decodes / plain_seconds))

    def _export_cost(self) -> None:
        """The fitted terms: the online fit's after every step, the profile's when it changes (at start-up)."""
        fits = [("online", self._cost.coefficients)]
        if self._cost.quiet is not self._exported_quiet:
            self._exported_quiet = self._cost.quiet
            fits.append(("profile", self._cost.quiet.coefficients))
        for fit, coefficients in fits:
            for term, seconds in coefficients._asdict().items():
                self._metrics.step_cost.labels(term, fit).set(seconds)

    def _log_step(self, seconds: float, round_trip: float,
                  asking: dict[str, list[tuple[Sequence, int]]], plan: list[Scheduled], chunks: list[int],
                  outcomes: list[VerifyResult | Exception | None]) -> None:
        self._step_log.write(
            started=time.time() - seconds, seconds=seconds, forward_seconds=self._forward_seconds, round_trip_seconds=round_trip,
            decodes=len(plan) - len(chunks), prefill_tokens=sum(chunks), prefill_sequences=len(chunks),
            asked={method: len(group) for method, group in asking.items()},
            draft_tokens=sum(len(item.draft) for item in plan),
            accepted_tokens=sum(outcome.num_accepted for outcome in outcomes if isinstance(outcome, VerifyResult)),
            running=len(self._running), waiting=len(self._waiting), speedup=self._speedup)

    def _asking(self, decodes: list[Sequence],
                plain_seconds: float) -> tuple[bool, dict[str, list[tuple[Sequence, int]]]]:
        """Whether any decoding sequence wants a draft this step, and the (sequence, draft budget) pairs to
        ask each method's drafter for: each drafter has its own gate, because what its asks cost and gain is
        its own."""
        wanted: dict[str, list[tuple[Sequence, int]]] = {}
        self._drafters.new_step()
        # What waiting for each drafter costs one sequence, in tokens: the share of a plain decoding step its
        # round trip is (the batch decodes one token a sequence a step, and all of them wait).
        round_trip_cost = {method: gate.round_trip / plain_seconds for method, gate in self._gates.items()
                           if gate.round_trip is not None and plain_seconds > 0}
        budgets = [(seq, k) for seq in decodes if self._drafters.serves(seq) and (k := seq.draft_budget()) > 0]
        # A step carrying prompt chunks takes longer whatever is drafted and reads as a speedup under 1:
        # time is never priced under plain decoding's rate.
        choices = self._drafters.choose_methods(_sequences(budgets), round_trip_cost, max(1.0, self._speedup))
        for (seq, k), (method, why) in zip(budgets, choices):
            if seq.chooser is not None:
                self._metrics.auto_choices.labels(method, why).inc()
            wanted.setdefault(method, []).append((seq, k))
        asking: dict[str, list[tuple[Sequence, int]]] = {}
        passed_over: dict[str, list[Sequence]] = {}  # the sequences of an asked drafter's group it is not asked for
        for method, group in wanted.items():
            if picked := self._gate(method).to_ask(_sequences(group), len(decodes), plain_seconds,
                                                   self._step_seconds, drafters=len(wanted)):
                asking[method], passed_over[method] = _split(group, picked)
        # The drafters are asked concurrently: while the step waits for the slowest one asked, a drafter whose
        # round trip is no longer costs it no wait, and rides along.
        longest = max((self._gate(method).line.seconds(len(group)) for method, group in asking.items()), default=0.0)
        for method, group in wanted.items():
            gate = self._gate(method)
            if method not in asking and (riders := gate.riding(_sequences(group), longest)):
                asking[method], passed_over[method] = _split(group, riders)
            if method in asking:
                gate.left_out(passed_over[method])
            else:
                gate.skipped(_sequences(group))
        if len(asking) < len(wanted):
            self._metrics.drafting_skipped.inc()
        return bool(wanted), asking

    @staticmethod
    def _compare_at_probes(asking: dict[str, list[tuple[Sequence, int]]]) -> None:
        """An asked `auto` sequence the gate had passed over (its ask is a probe) has its chooser compare
        the drafters this step (`MethodChooser.compare`)."""
        for seq, _ in itertools.chain.from_iterable(asking.values()):
            if seq.chooser is not None and seq.unasked_steps > 0:
                seq.chooser.compare()

    def _shadows(self, asking: dict[str, list[tuple[Sequence, int]]]) -> list[tuple[Sequence, int, str]]:
        """(sequence, draft budget, method) for each drafter an asked `auto` sequence's chooser wants asked
        beside its choice, to score it without verifying its draft: at a shadow step, and at a probe."""
        shadows = []
        for seq, k in itertools.chain.from_iterable(asking.values()):
            if seq.chooser is None:
                continue
            for method in seq.chooser.shadows:
                self._metrics.auto_choices.labels(method, "shadow").inc()
                shadows.append((seq, k, method))
        return shadows

    def _gate(self, method: str) -> DraftingGate:
        return self._gates.setdefault(method, DraftingGate())

    # -- planning a step ------------------------------------------------------

    def _plan(self, decodes: list[Sequence], answers: Answers, asked: set[str]) -> list[Scheduled]:
        """The step's work within the token budget and the free KV blocks: every decode (with the windows
        that pay at this load; drafts and windows trimmed to the budget, dropped and then the newest sequences
        preempted where memory is short), then prompt chunks, the most overdue first, admitting waiting
        sequences as their turn comes; then the drafts cut to what raises the step's goodput by the cost model."""
        decoding = [Scheduled(s, d) if (d := answers.drafts.get(s.request_id)) else Scheduled(s) for s in decodes]
        self._add_windows(decoding, asked)
        decoding = self._fit_decodes(decoding)
        self._metrics.window_tokens.labels("ran").inc(sum(len(item.window or ()) for item in decoding))
        prefilling = self._plan_prefills(decoding)
        self._choose_drafts(decoding, prefilling, answers.shadows)
        self._metrics.prefill_chunks.inc(sum(item.end < item.seq.prefill_target for item in prefilling))
        return decoding + prefilling

    def _plan_prefills(self, decoding: list[Scheduled]) -> list[Scheduled]:
        room = max(self._max_num_seqs - len(self._running), 0)
        joining = [s for s in self._running if s.in_prefill] + list(itertools.islice(self._waiting, room))
        budget = _PrefillBudget(self._max_step_tokens - sum(item.end - item.seq.num_computed for item in decoding),
                                self._prefill_seconds(decoding, joining))
        free = self._runner.allocator.num_free_blocks - sum(self._new_blocks(item) for item in decoding)
        watermark = math.ceil(ADMISSION_WATERMARK * self._runner.allocator.num_blocks)
        prefilling: list[Scheduled] = []
        for seq in self._most_overdue_first(joining):
            admitting = seq.status is SequenceStatus.WAITING
            item = self._chunk(seq, budget, free - watermark * admitting, first=not prefilling)
            if item is None:  # the budget or the memory is spent: the prompts after it wait their turn
                break
            if admitting:
                self._waiting.remove(seq)
                self._admit(seq)
            prefilling.append(item)
            free -= self._new_blocks(item)
        return prefilling

    def _most_overdue_first(self, joining: list[Sequence]) -> list[Sequence]:
        """The joining prompts by response ratio, highest first: (seconds waited + prompt work left) / work
        left, the work by the cost model. Among prompts that arrived together the shortest goes first, which
        brings the most first tokens soonest; a long one's ratio climbs as it waits, so it is not passed
        over for ever (waited its work's worth, it goes before a new prompt of any length). A preempted
        sequence counts its wait from its request's arrival."""
        now = time.perf_counter()

        def ratio(seq: Sequence) -> float:
            work = max(self._cost.chunk_seconds(seq.num_computed, seq.prefill_target - seq.num_computed), MIN_SECONDS)
            return (now - seq.clock.started + work) / work
        return sorted(joining, key=ratio, reverse=True)

    def _add_windows(self, decoding: list[Scheduled], asked: set[str]) -> None:
        """Each asked sequence's window, if its drafter has one and what the window is expected to bring
        pays for its tokens (with DRAFT_MARGIN to spare, as a draft token must) at this step's load, priced
        as draft tokens are (`StepCostModel.quiet`)."""
        windows = [(item, window) for item in decoding
                   if item.seq.request_id in asked and (window := self._drafters.window(item.seq)) is not None
                   and item.end + len(window) <= self._runner.max_context_length]
        if not windows:  # most steps: no sequence's drafter has a window
            return
        plain_seconds = self._cost.quiet.predict(StepShape.of((item.seq.num_computed, 1) for item in decoding))
        decoded_per_second = len(decoding) / max(plain_seconds + self._host_seconds, MIN_SECONDS)
        step_tokens = len(decoding)
        for item, window in windows:
            seconds = self._paying_window_seconds(item.seq, window, step_tokens, decoded_per_second)
            if seconds is not None:
                item.window, item.window_seconds = window, seconds
                step_tokens += len(window)
            else:
                self._metrics.window_tokens.labels("skipped").inc(len(window))

    def _paying_window_seconds(self, seq: Sequence, window: Window, step_tokens: int,
                               decoded_per_second: float) -> float | None:
        """What `window` adds to a step of `step_tokens` new tokens by the quiet cost model, if what it is
        expected to bring pays for that; None if it does not (and so would not run). Each of its tokens is
        priced at the step's size so far, its own earlier ones counted: priced all at the step's size
        before it, a window of ~30 tokens on a batch-1 step stood below the profile's first knee (4 tokens)
        whole and cost nothing, and ran in nearly every step of a Spec-Bench run (`lookahead` 1.15x
        `none`, against 1.52x in a run whose profile put the knee lower)."""
        positions = (seq.num_computed + depth for depth in window.depths())
        seconds = sum(self._cost.quiet.token_prices(positions, step_tokens))
        return seconds if window.expected_yield > (1 + DRAFT_MARGIN) * seconds * decoded_per_second else None

    def _prefill_seconds(self, decoding: list[Scheduled], joining: list[Sequence]) -> float:
        """Seconds of prompt work a step may carry beside its decodes: STEP_STRETCH - 1 times the decoding
        part of the batch once the joining prompts are in it, or, if more, their remaining work over
        DRAIN_STEPS up to MAX_STRETCH - 1 times that decoding part, or PREFILL_PACE times the prompt work
        arriving per step up to MAX_PACE_STRETCH - 1 times it. IDLE_STEP_SECONDS when nothing decodes."""
        if not decoding:
            return IDLE_STEP_SECONDS
        plain = StepShape.of([(item.seq.num_computed, 1) for item in decoding]
                             + [(seq.prefill_target, 1) for seq in joining])
        decoding_part = self._cost.predict(plain) + self._draft_seconds + self._round_trip
        backlog = sum(self._cost.chunk_seconds(seq.num_computed, seq.prefill_target - seq.num_computed)
                      for seq in joining)
        burst = min(max((STEP_STRETCH - 1) * decoding_part, backlog / DRAIN_STEPS),
                    (MAX_STRETCH - 1) * decoding_part)
        pace = min(PREFILL_PACE * self._prompt_arrivals, (MAX_PACE_STRETCH - 1) * decoding_part)
        return max(burst, pace)

    def _choose_drafts(self, decoding: list[Scheduled], prefilling: list[Scheduled],
                       shadows: dict[tuple[str, str], DraftTree]) -> None:
        """The target alone decides how much of each draft to verify: it knows what verifying costs (priced
        by `StepCostModel.quiet`), and how far each drafter's estimates have come true."""
        base = StepShape.of([(item.seq.num_computed, 1 + len(item.window or ())) for item in decoding]
                            + [(item.seq.num_computed, item.num_new) for item in prefilling])
        candidates = [self._calibration.corrected(item.seq.drafting_method, item.draft) for item in decoding]
        cached = [item.seq.num_computed for item in decoding]
        choice = choose_drafts(candidates, cached, self._cost.quiet, base.tokens, self._host_seconds)
        decoded_per_second = len(decoding) / choice.plain_seconds if choice.plain_seconds > 0 else 0.0
        if shadows:
            self._price_shadows(decoding, candidates, cached, base.tokens, decoded_per_second, shadows)
        for item, length, added in zip(decoding, choice.lengths, choice.added_seconds):
            item.draft = item.draft.truncated(length)
            item.draft_price = (added + (item.window_seconds if item.window else 0.0)) * decoded_per_second
        # What the kept drafts add to the step in seconds as steps take now, for the prefill budget.
        planned = StepShape.of((item.seq.num_computed, item.end - item.seq.num_computed) for item in decoding + prefilling)
        predicted = self._cost.predict(planned)
        self._draft_seconds = _moved(self._draft_seconds, predicted - self._cost.predict(base))
        self._metrics.step_draft_tokens.observe(sum(choice.lengths))
        self._metrics.predicted_step_tokens.inc(choice.expected_tokens)
        self._metrics.predicted_step_seconds.inc(predicted)

    def _price_shadows(self, decoding: list[Scheduled], candidates: list[DraftTree], cached: list[int],
                       step_tokens: int, decoded_per_second: float, shadows: dict[tuple[str, str], DraftTree]) -> None:
        """Each shadow draft as far as this step would have verified it in place of its sequence's draft, and
        what that would have cost the batch: handed to the sequence's chooser, to score once the sequence's
        tokens reach past it. One choice per method, its shadows in place of their sequences' drafts. A
        drafter with a window (lookahead) is charged the window too, wherever it would have run: an ask of
        it runs one, though the shadow's score cannot see what the window would bring."""
        by_method: dict[str, dict[str, DraftTree]] = {}
        for (sid, method), draft in shadows.items():
            by_method.setdefault(method, {})[sid] = draft
        for method, drafts in by_method.items():
            instead = [self._calibration.corrected(method, drafts[item.seq.request_id])
                       if item.seq.request_id in drafts else candidate for item, candidate in zip(decoding, candidates)]
            choice = choose_drafts(instead, cached, self._cost.quiet, step_tokens, self._host_seconds)
            for item, length, added in zip(decoding, choice.lengths, choice.added_seconds):
                if (draft := drafts.get(item.seq.request_id)) is not None and item.seq.chooser is not None:
                    window_seconds = self._shadow_window_seconds(item.seq, method, step_tokens, decoded_per_second)
                    item.seq.chooser.shadowed(ShadowDraft(method, len(item.seq.tokens), draft.truncated(length),
                                                          (added + window_seconds) * decoded_per_second))

    def _shadow_window_seconds(self, seq: Sequence, method: str, step_tokens: int,
                               decoded_per_second: float) -> float:
        """What the window of `method`'s drafter would have added to this step had the sequence asked it: 0
        for a drafter without one, or where it would not have paid (and so not run)."""
        window = self._drafters.window(seq, method)
        if window is None:
            return 0.0
        return self._paying_window_seconds(seq, window, step_tokens, decoded_per_second) or 0.0

    def _fit_decodes(self, decoding: list[Scheduled]) -> list[Scheduled]:
        """Drafts, then windows, trimmed to the token budget (every decode keeps its one token); where the
        free blocks cannot hold the step, the drafts and windows go, then the newest running sequences, until
        it fits."""
        spare = self._max_step_tokens - len(decoding)
        for item in decoding:
            item.draft = item.draft.truncated(max(spare, 0))
            spare -= len(item.draft)
        for item in decoding:
            if item.window is not None and len(item.window) > spare:
                item.window = None
            spare -= len(item.window or ())
        while sum(self._new_blocks(item) for item in decoding) > self._runner.allocator.num_free_blocks:
            if any(item.draft or item.window for item in decoding):
                for item in decoding:
                    item.draft, item.window = DraftTree(), None
                continue
            victim = self._running[-1]
            self._preempt(victim)
            decoding = [item for item in decoding if item.seq is not victim]
        return decoding

    def _chunk(self, seq: Sequence, budget: _PrefillBudget, free_blocks: int, first: bool) -> Scheduled | None:
        """The next piece of `seq`'s prefill that fits the budget (taken from it; the step's first
        piece gets at least MIN_PREFILL_CHUNK tokens) and the free blocks, or None."""
        allocator = self._runner.allocator
        room = (len(allocator.block_table(seq.request_id)) + free_blocks) * allocator.block_size - seq.num_computed
        affordable = self._cost.tokens_within(budget.seconds, seq.num_computed)
        if first:
            affordable = max(affordable, MIN_PREFILL_CHUNK)
        num_new = min(seq.prefill_target - seq.num_computed, budget.tokens, affordable, room)
        if num_new <= 0:
            return None
        budget.tokens -= num_new
        budget.seconds -= self._cost.chunk_seconds(seq.num_computed, num_new)
        return Scheduled(seq, num_new=num_new)

    def _new_blocks(self, item: Scheduled) -> int:
        return self._runner.allocator.blocks_needed(item.seq.request_id, item.end)

    # -- running a step ------------------------------------------------------------

    async def _compute(self, plan: list[Scheduled]) -> list[VerifyResult | Exception | None]:
        """The step's `_run_batch` on the compute thread, watched: still running after step_timeout_s, it is
        stuck (a deadlock, a hung device), and the requests waiting on it are failed with DEADLINE_EXCEEDED
        rather than left to wait without end; the target is not serving until the step ends."""
        computing = asyncio.get_running_loop().run_in_executor(self._compute_thread, self._run_batch, plan)
        started = time.perf_counter()
        done, _ = await asyncio.wait([computing], timeout=self._step_timeout_s)
        if not done:
            await self._set_stuck(True)
            await asyncio.wait([computing])
            log.warning("the stuck step ended after %.1f s; serving again", time.perf_counter() - started)
            await self._set_stuck(False)
        return computing.result()

    async def _set_stuck(self, stuck: bool) -> None:
        self._stuck = stuck
        self._metrics.step_stuck.set(int(stuck))
        if stuck:
            self._metrics.stuck_steps.inc()
            waiting = [seq for seq in [*self._running, *self._waiting] if not seq.dropped]
            log.error("a step has run over --step-timeout (%g s): the target is stuck; failing the %d requests "
                      "waiting on it with DEADLINE_EXCEEDED and reporting NOT_SERVING until it ends",
                      self._step_timeout_s, len(waiting))
            for seq in waiting:  # dropped at the next step boundary, once the stuck step lets go of their KV
                seq.outputs.put_nowait(DeadlineExceeded(
                    f"the target did not answer in time: a step has run over --step-timeout "
                    f"({self._step_timeout_s:g} s)"))
                seq.dropped = "stuck"
        if self._report_serving is not None:
            await self._report_serving(not stuck)

    def _run_batch(self, plan: list[Scheduled]) -> list[VerifyResult | Exception | None]:
        """Worker thread: the step's forward and verification (None for a prompt chunk with more to
        come). If the batch fails, its sequences are run one at a time, so only the sequence the
        error belongs to fails."""
        try:
            return self._forward_and_verify(plan)
        except Exception as error:
            for item in plan:  # whatever the failed pass wrote past the committed tokens goes
                self._runner.allocator.truncate(item.seq.request_id, item.seq.num_computed)
            if len(plan) == 1:
                log.exception("sequence %s failed in the decoding step", plan[0].seq.request_id)
                return [error]
            log.warning("a step of %d sequences failed (%r); running them one at a time", len(plan), error)
            return [self._run_batch([item])[0] for item in plan]

    @torch.inference_mode()  # the logits come from the model under it; the processors write into them
    def _forward_and_verify(self, plan: list[Scheduled]) -> list[VerifyResult | None]:
        """One forward pass over the whole batch, then verification of the rows that have logits."""
        started = time.perf_counter()
        inputs = [item.input() for item in plan]
        shape = StepShape.of((i.start_position, len(i.token_ids)) for i in inputs)
        feature_rows, feature_layers = self._feature_rows(plan, inputs)
        if feature_rows:
            logits, features = self._runner.forward_with_features(inputs, [r for rows in feature_rows.values()
                                                                           for r in rows], feature_layers)
        else:
            logits = self._runner.forward(inputs)
        verified = [item for item in plan if item.wants_logits]
        if any(item.window for item in verified):
            logits = _take_guesses(verified, logits)
        results = verify(logits, [item.verify_input() for item in verified]) if verified else []
        for item, result in zip(verified, results):  # an accepted tree path not in place moves into place
            if not item.draft.is_chain:
                self._runner.keep_path(item.seq.request_id, item.seq.num_computed + 1, result.path)
        if feature_rows:
            self._keep_features(plan, feature_rows, features, dict(zip(map(id, verified), results)))
        in_order = iter(results)
        seconds = time.perf_counter() - started
        self._step_excess = seconds - self._cost.predict(shape)
        self._cost.observe(shape, seconds)
        self._step_seconds = _moved(self._step_seconds, seconds)
        self._forward_seconds = seconds
        self._metrics.forward_time.observe(seconds)
        self._metrics.realized_step_seconds.inc(seconds)
        self._metrics.step_batch_size.observe(len(plan))
        self._metrics.step_tokens.observe(shape.tokens)
        return [next(in_order) if item.wants_logits else None for item in plan]

    def _feature_rows(self, plan: list[Scheduled],
                      inputs: list[SequenceInput]) -> tuple[dict[int, list[int]], tuple[int, ...]]:
        """By plan index, the flattened rows of the step whose features the sequence's drafter drafts from:
        every new token of a sequence that keeps a feature log from its first token on; and which features
        (the target layers whose input, () the final-normed output). A step computes one kind: a sequence
        whose drafter drafts from another (a drafter restarted with another head, or two such drafters
        served at once) loses its log, and with it its drafts: speed, never output."""
        rows, first, layers = {}, 0, None
        for index, (item, inp) in enumerate(zip(plan, inputs)):
            seq, wanted = item.seq, self._servable(self._drafters.feature_layers(item.seq))
            if seq.features is not None and seq.features.layers != wanted:
                seq.features = None
            if seq.features is None and inp.start_position == 0 and wanted is not None:
                seq.features = FeatureLog(wanted)
            if seq.features is not None and inp.start_position <= seq.features.length:
                layers = seq.features.layers if layers is None else layers
                if seq.features.layers == layers:
                    rows[index] = list(range(first, first + len(inp.token_ids)))
                else:
                    seq.features = None
            first += len(inp.token_ids)
        return rows, layers or ()

    def _servable(self, layers: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """`layers` if this model has them all: a drafter asking for a layer it lacks gets no features (and
        drafts nothing), rather than failing the steps of everyone."""
        return layers if layers is None or self._runner.has_layers(layers) else None

    def _keep_features(self, plan: list[Scheduled], feature_rows: dict[int, list[int]], features: torch.Tensor,
                       results: dict[int, VerifyResult]) -> None:
        """Each sequence's features of the tokens it keeps: a prompt chunk's, or a decode's newest token and
        the accepted path (its rows follow the plan's order in `features`)."""
        at = 0
        for index, rows in feature_rows.items():
            item = plan[index]
            mine = features[at:at + len(rows)]
            at += len(rows)
            result = results.get(id(item))
            if item.is_decode and result is not None:
                mine = mine[[0, *(1 + node for node in result.path)]]
            item.seq.features.write(item.seq.num_computed, mine)

    # -- admission, preemption and retirement ----------------------------------

    def _admit(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.scheduled_at is None:  # the first admission; a preempted sequence comes back in its place
            seq.scheduled_at = time.perf_counter()
            self._metrics.queue_time.observe(seq.scheduled_at - seq.clock.started)
        self._running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s KV blocks and put it first in line: it is recomputed from its tokens when
        memory allows, and its output does not change (the logits are batch invariant)."""
        log.info("preempting %s (%d tokens): the KV cache is full", seq.request_id, len(seq.tokens))
        self._runner.allocator.free(seq.request_id)
        self._running.remove(seq)
        seq.preempt()
        self._waiting.appendleft(seq)
        self._metrics.preemptions.inc()

    def _blocks_needed(self, seq: Sequence) -> int:
        """KV blocks of the sequence at its longest: more than the cache has, and it can never finish."""
        worst_tokens = len(seq.prompt) + seq.max_tokens + seq.speculative.num_speculative_tokens
        return math.ceil(worst_tokens / self._runner.allocator.block_size)

    def _drop_marked(self) -> None:
        for seq in [s for s in self._running if s.dropped]:
            self._finish(seq, seq.dropped)
        for seq in [s for s in self._waiting if s.dropped]:  # never admitted, or preempted: no KV blocks
            seq.status = SequenceStatus.FINISHED
            self._waiting.remove(seq)
            self._drafters.release(seq)
            self._metrics.requests_finished.labels(seq.dropped).inc()
        self._update_gauges()

    def _fail(self, seq: Sequence) -> None:
        seq.outputs.put_nowait(InternalError("internal error in the decoding step"))
        self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        self._runner.allocator.free(seq.request_id)
        self._drafters.release(seq)
        self._running.remove(seq)
        self._metrics.requests_finished.labels(reason).inc()
        self._update_gauges()

    def _update_gauges(self) -> None:
        allocator = self._runner.allocator
        self._metrics.requests_running.set(len(self._running))
        self._metrics.requests_waiting.set(len(self._waiting))
        self._metrics.kv_blocks_used.set(allocator.num_blocks - allocator.num_free_blocks)

    # -- committing a step's result -------------------------------------------

    def _commit(self, seq: Sequence, draft: DraftTree, result: VerifyResult) -> None:
        out = seq.commit(result.tokens(list(draft.token_ids)), result.num_accepted, len(draft), result.logprobs)
        self._runner.allocator.truncate(seq.request_id, seq.num_computed)  # roll back rejected drafts
        self._record(seq, draft, out)
        seq.outputs.put_nowait(out)
        if out.finish_reason:
            self._finish(seq, FINISH_REASON_NAMES[out.finish_reason])
            self._metrics.e2e_latency.labels(seq.speculative.method).observe(time.perf_counter() - seq.clock.started)

    def _record(self, seq: Sequence, draft: DraftTree, out: StepOutput) -> None:
        m, method = self._metrics, seq.speculative.method
        time_to_first_token, gap = seq.clock.tick(len(out.token_ids))
        if time_to_first_token is not None:
            m.time_to_first_token.labels(method).observe(time_to_first_token)
        else:
            for _ in out.token_ids:  # one observation per token
                m.inter_token_latency.labels(method).observe(gap)
            m.verification_steps.labels(method).inc()
            m.draft_tokens.labels(method).inc(len(draft))
            m.accepted_tokens.labels(method).inc(out.accepted_draft_tokens)
            for depth in draft.depths():
                m.draft_tokens_per_position.labels(method, str(depth - 1)).inc()
            for position in range(out.accepted_draft_tokens):
                m.accepted_per_position.labels(method, str(position)).inc()
        m.output_tokens.labels(method).inc(len(out.token_ids))

    async def close(self) -> None:
        self._compute_thread.shutdown(wait=True)
        if self._step_log is not None:
            self._step_log.close()


def _take_guesses(verified: list[Scheduled], logits: torch.Tensor) -> torch.Tensor:
    """Each window's argmax at its guess nodes, onto its item; what is left are the rows to verify."""
    verify_rows, guess_rows, at = [], [], 0
    for item in verified:
        verify_rows.extend(range(at, at + 1 + len(item.draft)))
        at += 1 + len(item.draft)
        if item.window:
            guess_rows.extend(range(at, at + len(item.window.guess_nodes)))
            at += len(item.window.guess_nodes)
    guesses = iter(logits[guess_rows].max(dim=-1).indices.tolist())
    for item in verified:
        if item.window:
            item.guesses = [next(guesses) for _ in item.window.guess_nodes]
    return logits[verify_rows]


def _sequences(group: list[tuple[Sequence, int]]) -> list[Sequence]:
    return [seq for seq, _ in group]


def _split(group: list[tuple[Sequence, int]],
           picked: list[Sequence]) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
    """The (sequence, draft budget) pairs of `group` whose sequence was picked, and the sequences not picked."""
    ids = {seq.request_id for seq in picked}
    return ([(seq, k) for seq, k in group if seq.request_id in ids],
            [seq for seq, _ in group if seq.request_id not in ids])


def _moved(mean: float, value: float) -> float:
    """A moving mean over about RECENT_STEPS steps, after one more step's value."""
    return mean + (value - mean) / RECENT_STEPS
