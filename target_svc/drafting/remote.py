"""A drafter service as a draft source: one batched Propose per step, on a long-lived stream.

A drafter is an optimisation, never a dependency: any failure or a missed
deadline means "no drafts this step" for its sequences, and the request goes
on draft-free. Every request stays within the drafter API's size bounds.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from specd.drafts import DraftTree
from specd.errors import InvalidArgument
from engine.features import to_bytes
from specd.limits import (MAX_DRAFTER_SEQUENCE_TOKENS, MAX_PROPOSE_FEATURE_BYTES, MAX_PROPOSE_SEQUENCES,
                          MAX_PROPOSE_TOKENS, MAX_RELEASE_SEQUENCES)
from specd.options import OptionSchema, options_to_pb
from specd.rpc import service_channel
from specd.security import TlsConfig
from specd.v1 import drafter_pb2, drafter_pb2_grpc
from target_svc.metrics import TargetMetrics
from target_svc.sequence import Sequence

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 1.0
RELEASE_RETRY_MAX_S = 30.0
DESCRIBE_RETRY_S = 2.0


class _StreamEnded(Exception):
    """The drafter ended the Propose stream without an error status."""


def _failure_code(error: Exception) -> str:
    """The drafter_failures label of a failed ask."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code().name
    return "DEADLINE_EXCEEDED" if isinstance(error, asyncio.TimeoutError) else "UNAVAILABLE"


class RemoteDrafter:
    """One drafter service; remembers how many of each sequence's tokens it has been told."""

    def __init__(self, method: str, address: str, vocab_size: int, timeout_s: float, metrics: TargetMetrics,
                 startup_timeout_s: float = 10.0, tls: TlsConfig | None = None):
        self.method = method
        self.address = address
        self._timeout_s = timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._metrics = metrics
        self._channel = service_channel(address, tls)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        self._stream: grpc.aio.StreamStreamCall | None = None  # asks go here, one message each way per step
        self.vocab_size = vocab_size  # the target's, sent with every ask: the drafter checks token ids by it
        self._schema: OptionSchema | None = None
        self._synced: dict[str, int] = {}
        # Every sequence an update has been sent for, answered or not (a late answer may still have reached the
        # drafter): each is released when it finishes.
        self._told: set[str] = set()
        self._synced_features: dict[str, int] = {}  # features the drafter holds, for methods that want them
        self._sending_features: dict[str, int] = {}  # what they will be once the pending ask is answered
        # Finished sequences the drafter has not yet confirmed dropping; retried until it does.
        self._unreleased: set[str] = set()
        # For a drafter that learns from outputs: finished sequences' tokens it has not been sent, sent
        # before their release (once, and at most a request's worth waiting while the drafter is down: what
        # it learns is worth speed, never a retry loop or unbounded memory).
        self._final_updates: list[drafter_pb2.SequenceUpdate] = []
        self._release_task: asyncio.Task | None = None
        self._describe_task: asyncio.Task | None = None

    @property
    def schema(self) -> OptionSchema:
        assert self._schema is not None, "start() first"
        return self._schema

    async def start(self) -> None:
        """Learn the method's options from the service itself. A drafter that is down costs speed,
        not the target: after `startup_timeout_s` the method is served with its options unchecked
        (and draft-free while the drafter is down) until the drafter answers."""
        if not await self._describe(self._startup_timeout_s):
            log.warning("drafter %s at %s is not answering; serving %s draft-free, its options unchecked, "
                        "until it does", self.method, self.address, self.method)
            self._schema = OptionSchema(self.method, known=False)
            self._describe_task = asyncio.get_running_loop().create_task(self._describe_until_answered())

    async def _describe(self, timeout_s: float) -> bool:
        try:
            info = await self._stub.Describe(drafter_pb2.DescribeRequest(), wait_for_ready=True, timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        if info.method != self.method:
            raise RuntimeError(f"the drafter at {self.address} serves {info.method!r}, not {self.method!r}")
        self._schema = OptionSchema.from_pb(info)
        return True

    async def _describe_until_answered(self) -> None:
        while not await self._describe(DESCRIBE_RETRY_S):
            await asyncio.sleep(DESCRIBE_RETRY_S)
        log.info("drafter %s at %s answered: its options are known", self.method, self.address)

    async def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, DraftTree] | None:
        """Drafts of at most k tokens for each (sequence, k); None if the drafter failed."""
        wanted = self._within_bounds(wanted)
        if not wanted:
            return {}
        feature_bytes = MAX_PROPOSE_FEATURE_BYTES
        updates = []
        for seq, k in wanted:
            update = self._update(seq, k, feature_bytes)
            feature_bytes -= len(update.features.data)
            updates.append(update)
        request = drafter_pb2.ProposeRequest(sequences=updates, vocab_size=self.vocab_size)
        self._told.update(seq.request_id for seq, _ in wanted)
        started = time.perf_counter()
        try:
            response = await asyncio.wait_for(self._exchange(request), self._timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, _StreamEnded) as err:
            # The stream is out of step now (a late answer would be taken for the next one): the next ask opens another.
            self._close_stream()
            self._metrics.drafter_failures.labels(self.method, _failure_code(err)).inc()
            return None
        finally:
            self._metrics.drafter_rpc_latency.labels(self.method).observe(time.perf_counter() - started)
        return self._accept(wanted, response)

    async def _exchange(self, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        """One request and its answer on the open ProposeStream (opened here when there is none). Steps
        ask one after another, so one exchange at a time."""
        if self._stream is None or self._stream.done():  # none yet, or it ended since the last step
            self._stream = self._stub.ProposeStream()
        try:
            await self._stream.write(request)
        except asyncio.InvalidStateError as ended:  # it ended after the check above
            raise _StreamEnded from ended
        response = await self._stream.read()
        if response is grpc.aio.EOF:  # the drafter ended it (it is shutting down)
            raise _StreamEnded
        return response

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    def _within_bounds(self, wanted: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The sequences this step's request can carry: none longer than the drafter holds, and no
        more new tokens than one request may sync (the rest are synced in later steps)."""
        kept, tokens = [], 0
        for seq, k in wanted:
            unsynced = len(seq.tokens) - self._synced.get(seq.request_id, 0)
            if len(seq.tokens) > MAX_DRAFTER_SEQUENCE_TOKENS or tokens + unsynced > MAX_PROPOSE_TOKENS:
                continue
            kept.append((seq, k))
            tokens += unsynced
            if len(kept) == MAX_PROPOSE_SEQUENCES:
                break
        return kept

    def _update(self, seq: Sequence, k: int, feature_bytes: int) -> drafter_pb2.SequenceUpdate:
        start = self._synced.get(seq.request_id, 0)
        update = drafter_pb2.SequenceUpdate(sequence_id=seq.request_id, start_position=start,
                                            appended_token_ids=seq.tokens[start:], max_draft_tokens=k)
        if start == 0:  # the drafter keeps a sequence's options, prompt length and scope from its first update on
            update.options.CopyFrom(options_to_pb(seq.speculative.options))
            update.prompt_length, update.corpus_scope = len(seq.prompt), seq.speculative.corpus_scope
        if self._schema is not None and self._schema.wants_features and seq.features is not None:
            update.features.CopyFrom(self._features(seq, start, feature_bytes))
        return update

    def _features(self, seq: Sequence, start: int, max_bytes: int) -> drafter_pb2.Features:
        """The features the drafter has not been sent (all from 0 when the tokens are), at most max_bytes
        of them: the rest go with later updates."""
        first = self._synced_features.get(seq.request_id, 0) if start else 0
        rows = seq.features.rows(first, seq.features.length)
        rows = rows[:max(0, max_bytes // (rows.shape[1] * rows.element_size()))]
        dtype, data = to_bytes(rows)
        self._sending_features[seq.request_id] = first + rows.shape[0]
        return drafter_pb2.Features(start_position=first, hidden_size=rows.shape[1], dtype=dtype, data=data)

    def _accept(self, wanted: list[tuple[Sequence, int]],
                response: drafter_pb2.ProposeResponse) -> dict[str, DraftTree] | None:
        if len(response.drafts) != len(wanted):
            self._metrics.drafter_failures.labels(self.method, "MALFORMED").inc()
            return None
        drafts = {}
        for (seq, k), pb in zip(wanted, response.drafts):
            sent_features = self._sending_features.pop(seq.request_id, 0)
            if seq.request_id not in self._told:  # it finished while this ask was out; its release is on its way
                continue
            # Only after a successful reply do we know the drafter holds every token (and feature sent).
            self._synced[seq.request_id] = 0 if pb.resync_needed else len(seq.tokens)
            self._synced_features[seq.request_id] = 0 if pb.resync_needed else sent_features
            draft = DraftTree.from_pb(pb)
            try:
                draft.validate("draft")
            except InvalidArgument:
                self._metrics.drafter_failures.labels(self.method, "MALFORMED").inc()
                continue
            drafts[seq.request_id] = draft.truncated(k)
        return drafts

    def release(self, sequence: Sequence) -> None:
        """Tell the drafter the sequence finished, in the background, retrying until it has heard
        (a drafter that restarted meanwhile holds nothing: telling it is harmless). A drafter that learns
        from outputs is sent the tokens committed since its last update first: the gate skips asks, and
        `auto` asks another drafter on most steps, so it would otherwise learn only part of the output."""
        if self._learns_from(sequence):
            self._final_updates.append(self._update(sequence, 0, 0))
        for held in (self._synced_features, self._sending_features, self._synced):
            held.pop(sequence.request_id, None)
        if sequence.request_id in self._told:
            self._told.discard(sequence.request_id)
            self._unreleased.add(sequence.request_id)
        if self._unreleased and (self._release_task is None or self._release_task.done()):
            self._release_task = asyncio.get_running_loop().create_task(self._release_until_heard())

    def _learns_from(self, sequence: Sequence) -> bool:
        """Whether the drafter learns from outputs, holds the sequence, has tokens of it still to learn, and
        room for them among the waiting updates (one request's worth)."""
        unsent = len(sequence.tokens) - self._synced.get(sequence.request_id, 0)
        # Usually none wait; while the drafter is down, up to one request's worth.
        waiting = sum(len(update.appended_token_ids) for update in self._final_updates)
        return (self._schema is not None and self._schema.learns_outputs and sequence.request_id in self._told
                and 0 < unsent and waiting + unsent <= MAX_PROPOSE_TOKENS
                and len(self._final_updates) < MAX_PROPOSE_SEQUENCES)

    async def _send_final_updates(self) -> None:
        """The finished sequences' last tokens, one request (the waiting ones fit in one); dropped if it fails."""
        if self._final_updates:
            batch, self._final_updates = self._final_updates, []
            try:
                await self._stub.Propose(drafter_pb2.ProposeRequest(sequences=batch, vocab_size=self.vocab_size),
                                         timeout=RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                log.debug("drafter %s: final updates failed (%s); dropped", self.method, err.code().name)

    async def _release_until_heard(self) -> None:
        backoff = RELEASE_TIMEOUT_S
        while self._unreleased:
            ids = sorted(self._unreleased)[:MAX_RELEASE_SEQUENCES]
            await self._send_final_updates()  # theirs are among these: each is queued before its release
            try:
                await self._stub.Release(drafter_pb2.ReleaseRequest(sequence_ids=ids), timeout=RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                log.debug("drafter %s: release failed (%s); retrying in %g s", self.method, err.code().name, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, RELEASE_RETRY_MAX_S)
                continue
            self._unreleased.difference_update(ids)
            backoff = RELEASE_TIMEOUT_S

    async def close(self) -> None:
        self._close_stream()
        for task in (self._release_task, self._describe_task):
            if task is not None:
                task.cancel()
        await self._channel.close()
