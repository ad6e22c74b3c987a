"""specd.v1.Drafter: a thin gRPC shell that syncs sequence state and asks the proposer for drafts."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from drafter_svc.metrics import DrafterMetrics
from drafter_svc.proposers.base import DraftRequest, Proposer
from drafter_svc.sequences import SequenceRegistry, SequenceState, SequenceUpdate
from specd.errors import InvalidArgument, check_length
from specd.limits import MAX_PROPOSE_SEQUENCES, MAX_PROPOSE_TOKENS, MAX_RELEASE_SEQUENCES
from specd.options import options_from_pb
from specd.rpc import rpc_handler
from specd.types import MAX_SPECULATIVE_TOKENS
from specd.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

# Updates of at most this many new tokens in all are answered on the event loop (when the worker is idle).
INLINE_TOKENS = 512
# A sequence's first update carries its whole prompt, which a model drafter runs its model over (to fill
# its KV cache): a 1,500-token prompt can outlast the target's 50 ms deadline for the step. So for those an
# entry appending more tokens than this gets no draft in this answer and is taken in right after it,
# while the target runs its forward; the sequence's next ask finds it ready. The text drafters take a
# prompt in at under a microsecond a token (their indexes are built as they are searched) and answer at once.
DEFERRED_TOKENS = 128

# One sequence's share of a Propose: its update, its draft budget, and (from position 0) its options.
Entry = tuple[SequenceUpdate, int, dict | None]


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Applies each entry's committed tokens, then asks the proposer for the whole batch at once."""

    def __init__(self, proposer: Proposer, sequences: SequenceRegistry, metrics: DrafterMetrics):
        self._proposer = proposer
        self._sequences = sequences
        self._metrics = metrics
        self.rpc_metrics = metrics.rpc  # what @rpc_handler counts calls in
        # A step of 64 sequences costs ~1.5 ms of CPU, but a model's forward or a batch of new prompts more,
        # so large updates run off the event loop; one thread, so requests touch the state one at a time.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter")
        self._worker_jobs = 0  # submitted and not yet done
        self._report_state()

    @rpc_handler
    async def Propose(self, request: drafter_pb2.ProposeRequest, context) -> drafter_pb2.ProposeResponse:
        return await self._answer(request)

    @rpc_handler
    async def ProposeStream(self, requests: AsyncIterator[drafter_pb2.ProposeRequest], context):
        async for request in requests:
            yield await self._answer(request)

    async def _answer(self, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        requested = self._parse_updates(request)
        runs_model = getattr(self._proposer, "runs_model", False)
        deferred = [runs_model and len(update.appended_token_ids) > DEFERRED_TOKENS for update, _, _ in requested]
        now = [entry for entry, defer in zip(requested, deferred) if not defer]
        later = [entry for entry, defer in zip(requested, deferred) if defer]
        appended = sum(len(update.appended_token_ids) for update, _, _ in now)
        if self._worker_jobs == 0 and appended <= INLINE_TOKENS and not runs_model:
            # A step's few new tokens: the hop to the worker (~0.15 ms) costs more than the work, and with
            # the worker idle the state is ours alone.
            drafts = self._propose(now)
        else:
            drafts = await self._submit(self._propose, now)
        if later:  # queued on the one worker before this answer leaves, so before any later request
            self._index_in_background(later)
        by_id = {draft.sequence_id: draft for draft in drafts}
        return drafter_pb2.ProposeResponse(drafts=[by_id.get(update.sequence_id, drafter_pb2.Draft(
            sequence_id=update.sequence_id)) for update, _, _ in requested])

    def _index_in_background(self, entries: list[Entry]) -> None:
        """Apply and index `entries` on the worker, proposing nothing. If that fails, the drafter lacks
        their tokens, and their next update is answered with resync_needed."""
        def failed(job: asyncio.Future) -> None:
            if not job.cancelled() and job.exception() is not None:
                log.error("indexing %d new sequences failed", len(entries), exc_info=job.exception())
        self._submit(self._index, entries).add_done_callback(failed)

    def _submit(self, work, *args) -> asyncio.Future:
        """`work(*args)` queued on the worker thread now. The job counts until the thread is done with
        it, even when the RPC that waits for it is cancelled first."""
        loop = asyncio.get_running_loop()
        self._worker_jobs += 1
        job = self._worker.submit(work, *args)
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._worker_job_done))
        return asyncio.wrap_future(job)

    def _worker_job_done(self) -> None:
        self._worker_jobs -= 1

    @rpc_handler
    async def Release(self, request: drafter_pb2.ReleaseRequest, context) -> drafter_pb2.ReleaseResponse:
        check_length("sequence_ids", request.sequence_ids, MAX_RELEASE_SEQUENCES)
        await self._submit(self._release, list(request.sequence_ids))
        return drafter_pb2.ReleaseResponse()

    @rpc_handler
    async def Describe(self, request: drafter_pb2.DescribeRequest, context):
        return self._proposer.schema.to_pb()

    def _propose(self, requested: list[Entry]) -> list[drafter_pb2.Draft]:
        states = self._apply(requested)
        batch = [DraftRequest(state, max_tokens, state.options)
                 for state, (_, max_tokens, _) in zip(states, requested) if state is not None]
        started = time.perf_counter()
        drafts = self._proposer.propose(batch)
        self._metrics.observe_drafts(drafts, time.perf_counter() - started)
        self._metrics.resyncs.inc(len(states) - len(batch))
        self._evict()
        next_draft = iter(drafts).__next__  # drafts come in batch order, which skips the resyncs
        return [drafter_pb2.Draft(sequence_id=update.sequence_id, resync_needed=True) if state is None
                else next_draft().to_pb(update.sequence_id)
                for (update, _, _), state in zip(requested, states)]

    def _index(self, entries: list[Entry]) -> None:
        """The entries' tokens applied and indexed by the proposer (asked for 0 tokens)."""
        self._proposer.propose([DraftRequest(state, 0, state.options) for state in self._apply(entries)
                                if state is not None])
        self._evict()

    def _apply(self, requested: list[Entry]) -> list[SequenceState | None]:
        """Each entry's sequence with its update applied (options, prompt length and scope set from its
        first); None where the update does not follow what the drafter holds."""
        states = [self._sequences.apply(update) for update, _, _ in requested]
        for state, (update, _, options) in zip(states, requested):
            if state is not None and options is not None:
                state.options, state.prompt_length = options, update.prompt_length
                state.corpus_scope = update.corpus_scope
        return states

    def _release(self, sequence_ids: list[str]) -> None:
        for sequence_id in sequence_ids:
            state = self._sequences.release(sequence_id)
            if state is not None:
                self._proposer.release(state)
        self._evict()

    def _evict(self) -> None:
        """Keep the state within its bounds, and say how big it is."""
        for state, reason in self._sequences.evict():
            self._proposer.release(state)
            self._metrics.evictions.labels(reason).inc()
        self._report_state()

    def _report_state(self) -> None:
        self._metrics.sequences.set(len(self._sequences))
        self._metrics.tokens_held.set(self._sequences.tokens_held)
        for kind, size in getattr(self._proposer, "sizes", dict)().items():
            self._metrics.proposer_state.labels(kind).set(size)

    def _parse_updates(self, request: drafter_pb2.ProposeRequest) -> list[Entry]:
        """Every entry, validated before any state changes, so a bad request leaves no trace."""
        check_length("sequences", request.sequences, MAX_PROPOSE_SEQUENCES)
        if request.vocab_size <= 0:
            raise InvalidArgument("vocab_size", f"must be > 0 (the target's vocabulary size), got {request.vocab_size}")
        total = sum(len(pb.appended_token_ids) for pb in request.sequences)
        if total > MAX_PROPOSE_TOKENS:
            raise InvalidArgument("sequences", f"at most {MAX_PROPOSE_TOKENS} appended_token_ids in all, got {total}")
        parsed, seen = [], set()
        for i, pb in enumerate(request.sequences):
            field = f"sequences[{i}]"
            update = SequenceUpdate.from_pb(pb, field, request.vocab_size)
            if update.features is not None and not self._proposer.schema.wants_features:
                update = replace(update, features=None)  # nothing here would ever take them in
            if update.sequence_id in seen:
                raise InvalidArgument(f"{field}.sequence_id", f"{update.sequence_id!r} appears twice in one request")
            seen.add(update.sequence_id)
            if not 0 <= pb.max_draft_tokens <= MAX_SPECULATIVE_TOKENS:
                raise InvalidArgument(f"{field}.max_draft_tokens",
                                      f"must be in 0..{MAX_SPECULATIVE_TOKENS}, got {pb.max_draft_tokens}")
            options = None if pb.start_position else \
                self._proposer.schema.resolve(options_from_pb(pb.options, f"{field}.options"), f"{field}.options")
            parsed.append((update, pb.max_draft_tokens, options))
        return parsed
