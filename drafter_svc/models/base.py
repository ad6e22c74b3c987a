"""What every model drafter shares: its sequences' KV in one paged cache, given up under memory pressure."""
from __future__ import annotations

import logging

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.sequences import SequenceState
from engine.kv_cache import OutOfBlocks
from engine.runner import ModelRunner
from specd.drafts import DraftTree

log = logging.getLogger(__name__)


class ModelDrafter:
    """Subclasses set `runner` and draft a batch in `_draft` (each request's draft by id(sequence))."""
    runner: ModelRunner

    def __init__(self):
        self._holders: dict[str, SequenceState] = {}  # sequences with K/V in the cache, least recent first

    def _draft(self, batch: list[DraftRequest]) -> dict[int, DraftTree]:
        raise NotImplementedError

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        for request in batch:
            self._holders.pop(request.sequence.sequence_id, None)
            self._holders[request.sequence.sequence_id] = request.sequence  # most recent last
        try:
            drafts = self._draft(batch)
        except OutOfBlocks:  # the sequences not in this step give their K/V up, then it is tried once more
            self._forget_all_but(batch)
            try:
                drafts = self._draft(batch)
            except OutOfBlocks:
                log.warning("%s: KV cache too small for a step of %d sequences: no drafts", type(self).__name__,
                            len(batch))
                self._forget_all_but([])
                drafts = {}
        return [drafts.get(id(request.sequence), DraftTree()) for request in batch]

    def release(self, sequence: SequenceState) -> None:
        self._holders.pop(sequence.sequence_id, None)
        self.runner.allocator.free(sequence.sequence_id)
        sequence.proposer_state = None

    def sizes(self) -> dict[str, int]:
        allocator = self.runner.allocator
        return {"kv_blocks_used": allocator.num_blocks - allocator.num_free_blocks}

    def _forget_all_but(self, batch: list[DraftRequest]) -> None:
        keep = {request.sequence.sequence_id for request in batch}
        for sequence in [s for seq_id, s in self._holders.items() if seq_id not in keep]:
            self.release(sequence)
