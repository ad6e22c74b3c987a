"""Continuous batching: requests join and leave between steps.

One step, for every running sequence at once: ask the drafters (with a
deadline), run ONE forward pass over prompts being prefilled and every decoding
sequence's last token plus drafts, verify, roll back rejected KV entries and
stream the committed tokens. Model compute runs on a worker thread, never on
the event loop. An error that belongs to one sequence fails that sequence only.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from specd.errors import InternalError, ResourceExhausted
from specd.types import FINISH_REASON_NAMES
from target_svc.drafting.drafters import Drafters
from target_svc.drafting.length import DEFAULT_DRAFT_TOKEN_COST, worth_verifying
from target_svc.metrics import TargetMetrics
from target_svc.engine.runner import ModelRunner, SequenceInput
from target_svc.sequence import Sequence, SequenceStatus, StepOutput
from target_svc.verifier import VerifyInput, VerifyResult, verify

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: ModelRunner, compute_thread: ThreadPoolExecutor, drafters: Drafters,
                 metrics: TargetMetrics, max_num_seqs: int = 64, max_step_tokens: int = 4096,
                 draft_token_cost: float = DEFAULT_DRAFT_TOKEN_COST):
        self._runner = runner
        self._drafters = drafters
        self._draft_token_cost = draft_token_cost
        self._metrics = metrics
        self._max_num_seqs = max_num_seqs
        self._max_step_tokens = max_step_tokens
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        # Blocks promised to admitted sequences for their worst case, so a
        # running sequence never runs out of KV memory mid-generation.
        self._promised_blocks: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._compute_thread = compute_thread
        metrics.kv_blocks_total.set(runner.allocator.num_blocks)

    # -- requests -------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        if self._blocks_needed(seq) > self._runner.allocator.num_blocks:
            raise ResourceExhausted(f"prompt_token_ids: {len(seq.prompt)} prompt tokens + {seq.max_tokens} max tokens "
                                    f"need more KV cache than the server has "
                                    f"({self._runner.allocator.num_blocks * self._runner.allocator.block_size} tokens)")
        self._waiting.append(seq)
        self._metrics.requests_waiting.set(len(self._waiting))
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """The client went away: drop the sequence at the next step boundary (its KV may be in use now)."""
        seq.aborted = True
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
        self._drop_aborted()
        prefills = self._admit()
        decodes = [s for s in self._running if not s.in_prefill]
        if not prefills and not decodes:
            return
        drafts = await self._drafters.propose([(s, s.draft_budget()) for s in decodes])
        batch = prefills + decodes
        # The target alone decides how much of each draft to verify: it knows what verifying costs.
        seq_drafts = [worth_verifying(drafts[s.request_id], self._draft_token_cost) if s.request_id in drafts else []
                      for s in batch]
        outcomes = await asyncio.get_running_loop().run_in_executor(
            self._compute_thread, self._run_batch, batch, seq_drafts)
        for seq, draft, outcome in zip(batch, seq_drafts, outcomes):
            if isinstance(outcome, Exception):
                self._fail(seq)
            else:
                self._commit(seq, draft, outcome)
        self._update_gauges()

    def _run_batch(self, batch: list[Sequence], seq_drafts: list[list[int]]) -> list[VerifyResult | Exception]:
        """Worker thread: the step's forward and verification. If the batch fails, its sequences
        are run one at a time, so only the sequence the error belongs to fails."""
        try:
            return self._forward_and_verify(batch, seq_drafts)
        except Exception as error:
            for seq in batch:  # whatever the failed pass wrote past the committed tokens goes
                self._runner.allocator.truncate(seq.request_id, seq.num_computed)
            if len(batch) == 1:
                log.exception("sequence %s failed in the decoding step", batch[0].request_id)
                return [error]
            log.warning("a step of %d sequences failed (%r); running them one at a time", len(batch), error)
            return [self._run_batch([seq], [draft])[0] for seq, draft in zip(batch, seq_drafts)]

    @torch.inference_mode()  # the logits come from the model under it; the processors write into them
    def _forward_and_verify(self, batch: list[Sequence], seq_drafts: list[list[int]]) -> list[VerifyResult]:
        """One forward pass over the whole batch, then verification."""
        started = time.perf_counter()
        inputs = [self._input_of(seq, draft) for seq, draft in zip(batch, seq_drafts)]
        logits = self._runner.forward(inputs)
        results = verify(logits, [VerifyInput(s.sampling, s.tokens, d, s.generator) for s, d in zip(batch, seq_drafts)])
        self._metrics.forward_time.observe(time.perf_counter() - started)
        self._metrics.step_batch_size.observe(len(batch))
        self._metrics.step_tokens.observe(sum(len(i.token_ids) for i in inputs))
        return results

    @staticmethod
    def _input_of(seq: Sequence, draft: list[int]) -> SequenceInput:
        if seq.in_prefill:
            return SequenceInput(seq.request_id, seq.prompt, 0, 1)
        return SequenceInput(seq.request_id, [seq.tokens[-1], *draft], seq.num_computed, len(draft) + 1)

    # -- admission and retirement ---------------------------------------------

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self._max_step_tokens
        free = self._runner.allocator.num_blocks - sum(self._promised_blocks.values())
        while self._waiting and len(self._running) < self._max_num_seqs:
            seq = self._waiting[0]
            blocks = self._blocks_needed(seq)
            if blocks > free or (admitted and len(seq.prompt) > budget):
                break
            self._waiting.popleft()
            free -= blocks
            budget -= len(seq.prompt)
            self._promised_blocks[seq.request_id] = blocks
            seq.status, seq.scheduled_at = SequenceStatus.RUNNING, time.perf_counter()
            self._metrics.queue_time.observe(seq.scheduled_at - seq.clock.started)
            self._running.append(seq)
            admitted.append(seq)
        self._update_gauges()
        return admitted

    def _blocks_needed(self, seq: Sequence) -> int:
        worst_tokens = len(seq.prompt) + seq.max_tokens + seq.speculative.num_speculative_tokens
        return math.ceil(worst_tokens / self._runner.allocator.block_size)

    def _drop_aborted(self) -> None:
        for seq in [s for s in self._running if s.aborted]:
            self._finish(seq, "aborted")
        for seq in [s for s in self._waiting if s.aborted]:
            seq.status = SequenceStatus.FINISHED
            self._waiting.remove(seq)
        self._update_gauges()

    def _fail(self, seq: Sequence) -> None:
        seq.outputs.put_nowait(InternalError("internal error in the decoding step"))
        self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        self._runner.allocator.free(seq.request_id)
        self._promised_blocks.pop(seq.request_id, None)
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

    def _commit(self, seq: Sequence, draft: list[int], result: VerifyResult) -> None:
        out = seq.commit(result.tokens(draft), result.num_accepted, len(draft))
        self._runner.allocator.truncate(seq.request_id, seq.num_computed)  # roll back rejected drafts
        self._record(seq, draft, out)
        seq.outputs.put_nowait(out)
        if out.finish_reason:
            self._finish(seq, FINISH_REASON_NAMES[out.finish_reason])
            self._metrics.e2e_latency.labels(seq.speculative.method).observe(time.perf_counter() - seq.clock.started)

    def _record(self, seq: Sequence, draft: list[int], out: StepOutput) -> None:
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
            for position in range(len(draft)):
                m.draft_tokens_per_position.labels(method, str(position)).inc()
            for position in range(out.accepted_draft_tokens):
                m.accepted_per_position.labels(method, str(position)).inc()
        m.output_tokens.labels(method).inc(len(out.token_ids))

    async def close(self) -> None:
        self._compute_thread.shutdown(wait=True)
