"""Every draft source of the deployment, by method: one step asks them all concurrently. Where there are
several that draft from tokens alone, `fused` asks them together and merges their drafts."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping
from typing import NamedTuple

from specd.drafts import DraftTree
from specd.options import OptionSchema
from specd.types import AUTO_METHOD, NONE_SCHEMA
from target_svc.drafting.auto import AUTO_SCHEMA, MethodChooser, MethodRecord
from target_svc.drafting.base import DraftSource, Window, WindowSource
from target_svc.drafting.fused import FUSED_METHOD, FusedSource
from target_svc.sequence import Sequence


class Answers(NamedTuple):
    """What one step's asks brought: drafts by sequence id, each asked method's round trip in seconds, the
    methods whose drafter did not answer, and the shadow asks' drafts by (sequence id, method), empty where
    the drafter answered with none."""
    drafts: dict[str, DraftTree]
    round_trips: dict[str, float]
    unanswered: set[str]
    shadows: dict[tuple[str, str], DraftTree]

    @classmethod
    def none(cls) -> Answers:
        """A step that asked nothing."""
        return cls({}, {}, set(), {})


class Drafters:
    def __init__(self, sources: list[DraftSource], vocab_size: int):
        self._sources = {source.method: source for source in sources}
        self._vocab_size = vocab_size
        self._auto_record = MethodRecord()  # what each drafter has gained `auto` sequences so far

    async def start(self) -> None:
        """Every source ready; then `fused` over those that draft from tokens alone (a remote source's
        schema, which says whether it drafts from the target's features, is known once it started)."""
        await asyncio.gather(*(source.start() for source in self._sources.values()))
        from_tokens = [source for source in self._sources.values() if not source.schema.wants_features]
        if len(from_tokens) > 1:
            self._sources[FUSED_METHOD] = FusedSource(from_tokens)

    @property
    def methods(self) -> list[str]:
        return list(self.schemas)

    @property
    def schemas(self) -> dict[str, OptionSchema]:
        """Every served method's options ("none" included, and "auto" where it has drafters to choose
        from), as the methods declare them."""
        auto = {AUTO_METHOD: AUTO_SCHEMA} if self.auto_methods else {}
        return {NONE_SCHEMA.method: NONE_SCHEMA, **{m: s.schema for m, s in self._sources.items()}, **auto}

    @property
    def auto_methods(self) -> list[str]:
        """The drafters `method: auto` chooses among: all but those that draft from the target's features,
        which must follow a sequence from its first token. `fused` is one of them since small steps are
        priced as measured (`StepCostModel.small_steps`): its merged trees had been verified up to 8 nodes
        deep, their last ones rarely accepted, and it was left out (0.95x `suffix` among the choices);
        priced so, it was the fastest method on Spec-Bench at batch 1 (1.92x `none`, `suffix` 1.85x)."""
        return [m for m, source in self._sources.items() if not source.schema.wants_features]

    def serves(self, seq: Sequence) -> bool:
        """Whether a source here drafts for the sequence's method."""
        return seq.speculative.method in self._sources or (seq.speculative.method == AUTO_METHOD
                                                           and bool(self.auto_methods))

    def new_step(self) -> None:
        """A step is about to ask: `auto`'s shadow steps are counted in these."""
        self._auto_record.new_step()

    def choose_methods(self, wanting: list[Sequence], round_trip_cost: Mapping[str, float],
                       speedup: float = 1.0) -> list[tuple[str, str]]:
        """For each sequence, the drafter to ask this step and why: "method" (its own method's), or under `auto`
        "trial", "best" (its chooser's), or "batch": where the `auto` sequences' best choices differ, every
        one of them asks the drafter most of them chose. Each drafter a step asks costs the batch its
        round trip and its work on the target's cores, which the step cost model learns as slower forwards
        once every step asks (measured at 16 clients on a 2-core Xeon, fp32: `auto` sequences spread over
        four drafters ran forwards of the same tokens 15-20% slower than `suffix` alone did, and `auto` was
        0.92x `none` against `suffix`'s 1.27x). `round_trip_cost`: by method, the tokens an ask's round trip
        is worth to one sequence; `speedup`: the deployment's tokens per second over plain decoding's."""
        choices = [self._choose_method(seq, round_trip_cost, speedup) for seq in wanting]
        best = Counter(method for method, why in choices if why == "best")
        if len(best) > 1:
            order = self.auto_methods  # ties go to the drafter listed first
            batch_method = max(best, key=lambda m: (best[m], -order.index(m)))
            for index, (seq, (method, why)) in enumerate(zip(wanting, choices)):
                if why == "best" and method != batch_method:
                    seq.chooser.follow(batch_method)
                    choices[index] = (batch_method, "batch")
        return choices

    def _choose_method(self, seq: Sequence, round_trip_cost: Mapping[str, float], speedup: float) -> tuple[str, str]:
        if seq.speculative.method != AUTO_METHOD:
            return seq.speculative.method, "method"
        if seq.chooser is None:
            seq.chooser = MethodChooser(self.auto_methods, self._auto_record)
        return seq.chooser.choose(round_trip_cost, speedup)

    def feature_layers(self, seq: Sequence) -> tuple[int, ...] | None:
        """The target features the sequence's drafter drafts from (the layers whose input it takes, () for
        the final-normed output), or None if it does not draft from features."""
        source = self._sources.get(seq.speculative.method)
        return source.schema.feature_layers if source is not None and source.schema.wants_features else None

    async def propose(self, wanted: list[tuple[Sequence, int]],
                      shadows: list[tuple[Sequence, int, str]] = ()) -> Answers:
        """Drafts for every (sequence, k) with k > 0, and for every shadow ask (sequence, k, method) a draft
        kept apart, asking all sources concurrently, each once (a source answers one ask at a time: `fused`
        sequences and shadow asks join the asks its drafters get anyway)."""
        by_method: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, k in wanted:
            if k > 0 and seq.drafting_method in self._sources:
                by_method.setdefault(seq.drafting_method, []).append((seq, k))
        fused_group = by_method.pop(FUSED_METHOD, [])
        asks = {method: list(group) for method, group in by_method.items()}
        fused = self._sources.get(FUSED_METHOD)
        for method in (fused.member_methods if fused_group else []):
            asks.setdefault(method, []).extend(fused_group)
        for seq, k, method in shadows:  # a shadow of `fused` is made of its members' drafts: they are asked
            for asked_method in fused.member_methods if method == FUSED_METHOD else [method]:
                group = asks.setdefault(asked_method, [])
                if all(asked is not seq for asked, _ in group):
                    group.append((seq, k))
        replies = await asyncio.gather(*(self._timed(m, group) for m, group in asks.items()))
        answers, answered = Answers.none(), {}
        for method, reply, seconds in replies:
            answers.round_trips[method] = seconds
            if reply is None:
                answers.unanswered.add(method)
                continue
            # a token the model cannot embed would fail the step: drop such drafts
            reply = {sid: d for sid, d in reply.items() if all(0 <= t < self._vocab_size for t in d.token_ids)}
            answers.drafts.update({seq.request_id: reply[seq.request_id] for seq, _ in by_method.get(method, [])
                                   if seq.request_id in reply})
            answered[method] = reply
        if fused_group:
            # What fusing costs the step: waiting for the slowest member, then merging their drafts.
            merging = time.perf_counter()
            answers.drafts.update(fused.fuse(fused_group, answered))
            answers.round_trips[FUSED_METHOD] = (max(answers.round_trips[m] for m in fused.member_methods)
                                                 + time.perf_counter() - merging)
            if answers.unanswered.issuperset(fused.member_methods):
                answers.unanswered.add(FUSED_METHOD)
        for seq, k, method in shadows:
            if method == FUSED_METHOD and not answers.unanswered.issuperset(fused.member_methods):
                answers.shadows[seq.request_id, method] = fused.merged(seq, k, answered)
            elif method in answered:
                answers.shadows[seq.request_id, method] = answered[method].get(seq.request_id, DraftTree())
        return answers

    async def _timed(self, method: str,
                     group: list[tuple[Sequence, int]]) -> tuple[str, dict[str, DraftTree] | None, float]:
        started = time.perf_counter()
        reply = await self._sources[method].propose(group)
        return method, reply, time.perf_counter() - started

    def window(self, seq: Sequence, method: str | None = None) -> Window | None:
        """The guesses the sequence's drafter (or `method`'s, asked in its shadow) would have ride in this
        step's forward, if it is such a source."""
        source = self._sources.get(method or seq.drafting_method)
        return source.window(seq) if isinstance(source, WindowSource) else None

    def observe(self, seq: Sequence, guesses: list[int], num_verified: int, accepted_nodes: tuple[int, ...]) -> None:
        """An asked sequence verified: its drafter, if its guesses ride in the forward, learns from the step."""
        source = self._sources.get(seq.drafting_method)
        if isinstance(source, WindowSource):
            source.observe(seq, guesses, num_verified, accepted_nodes)

    def release(self, seq: Sequence) -> None:
        """Every source that may hold the sequence forgets it (under auto, any of them: `fused` releases
        its members)."""
        methods = [seq.speculative.method]
        if seq.speculative.method == AUTO_METHOD:
            methods = [FUSED_METHOD] if FUSED_METHOD in self._sources else self.auto_methods
        for method in methods:
            if (source := self._sources.get(method)) is not None:
                source.release(seq)

    async def close(self) -> None:
        await asyncio.gather(*(source.close() for source in self._sources.values()))
