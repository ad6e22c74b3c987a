"""`method: fused`: every drafter of the deployment asked at once, their drafts merged into one token tree.

Drafters are right about different texts (n-gram lookup about the prompt, suffix and trie about earlier
answers, lookahead about what the model would say next), and one step can verify all their guesses in
one forward: a path several drafters propose is one branch, and the target's cost model keeps the
nodes of the merged tree that pay, as for any draft (FastDeploy's model draft with n-gram fill-in, and
SpecInfer's merged token trees, are the same idea). The drafters are asked concurrently, so a step waits
for the slowest of them; `method: auto` weighs that against what fusing gains, like any of its choices.
Each drafter's estimates are corrected by how far its own part of the fused drafts came true before they
are merged, so that the merged tree ranks one drafter's guesses against another's fairly. Lookahead's
window, when it is one of the drafters, rides along and learns from its part of the draft.
"""
from __future__ import annotations

import asyncio

from specd.drafts import DraftTree
from specd.options import OptionSchema
from target_svc.drafting.base import DraftSource, Window, WindowSource
from target_svc.drafting.calibration import AcceptanceCalibration
from target_svc.sequence import Sequence

FUSED_METHOD = "fused"
FUSED_SCHEMA = OptionSchema(FUSED_METHOD)  # no options: each drafter runs on its deployment defaults


class FusedSource:
    def __init__(self, members: list[DraftSource]):
        self._members = members
        # Per sequence, for each member that drafted: its draft as sent, and where its nodes went in the
        # latest merged draft.
        self._placement: dict[str, dict[str, tuple[DraftTree, dict[int, int]]]] = {}
        self._calibration = AcceptanceCalibration()  # by member method

    method = FUSED_METHOD
    schema = FUSED_SCHEMA

    async def start(self) -> None:
        pass  # the members are started as the deployment's own sources

    @property
    def member_methods(self) -> list[str]:
        return [member.method for member in self._members]

    async def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, DraftTree] | None:
        """Asks every member itself: for use on its own (the target's step shares one ask per member per step
        among the members' own sequences and fused ones, and calls `fuse`)."""
        replies = await asyncio.gather(*(member.propose(wanted) for member in self._members))
        if all(reply is None for reply in replies):
            return None
        return self.fuse(wanted, {m: reply for m, reply in zip(self.member_methods, replies) if reply is not None})

    def fuse(self, wanted: list[tuple[Sequence, int]],
             replies: dict[str, dict[str, DraftTree]]) -> dict[str, DraftTree]:
        """The members' drafts (`replies`, by member method, then by sequence id) merged per sequence."""
        drafts = {}
        for seq, k in wanted:
            sid = seq.request_id
            drafted = self._drafted(sid, replies)
            if not drafted:
                continue
            merged, placements = self._merge(drafted, k)
            drafts[sid] = merged
            self._placement[sid] = {method: (tree, placement)
                                    for (method, tree), placement in zip(drafted, placements)}
        return drafts

    def merged(self, seq: Sequence, k: int, replies: dict[str, dict[str, DraftTree]]) -> DraftTree:
        """What `fuse` would draft for the sequence from `replies`, kept apart: nothing learns from it (an
        `auto` sequence's shadow ask of `fused`, made of its members' asks in the same step)."""
        drafted = self._drafted(seq.request_id, replies)
        return self._merge(drafted, k)[0] if drafted else DraftTree()

    def _drafted(self, sid: str, replies: dict[str, dict[str, DraftTree]]) -> list[tuple[str, DraftTree]]:
        return [(m, reply[sid]) for m, reply in replies.items() if m in self.member_methods and sid in reply]

    def _merge(self, drafted: list[tuple[str, DraftTree]], k: int) -> tuple[DraftTree, list[dict[int, int]]]:
        """The members' drafts, each corrected by its own record, merged into one tree of at most k nodes."""
        return DraftTree.merge([self._calibration.corrected(m, tree) for m, tree in drafted], k)

    def window(self, seq: Sequence) -> Window | None:
        windows = [member.window(seq) for member in self._members if isinstance(member, WindowSource)]
        return next((window for window in windows if window is not None), None)

    def observe(self, seq: Sequence, guesses: list[int], num_verified: int, accepted_nodes: tuple[int, ...]) -> None:
        """The step verified the merged draft's first `num_verified` nodes: each member's estimates are checked
        against the accepted path in its own nodes among them, and a member with a window learns from it."""
        drafted = self._placement.pop(seq.request_id, {})
        for member in self._members:
            tree, placement = drafted.get(member.method, (None, {}))
            own = {merged: node for node, merged in placement.items() if merged < num_verified}
            accepted = tuple(own[node] for node in accepted_nodes if node in own)
            if tree is not None and own:
                self._calibration.observe(member.method, tree.subtree(sorted(own.values())), len(accepted))
            if isinstance(member, WindowSource):
                member.observe(seq, guesses, len(own), accepted)

    def release(self, seq: Sequence) -> None:
        self._placement.pop(seq.request_id, None)
        for member in self._members:
            member.release(seq)

    async def close(self) -> None:
        pass  # the members are closed as the deployment's own sources
