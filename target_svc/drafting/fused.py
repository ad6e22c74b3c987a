"""`method: fused`: every drafter of the deployment asked at once, their drafts merged into one token tree.

Drafters are right about different texts (n-gram lookup about the prompt, suffix and trie about earlier
answers, lookahead about what the model would say next), and one step can verify all their guesses in
one forward: a path several drafters propose is one branch, and the target's cost model keeps the
nodes of the merged tree that pay, as for any draft (FastDeploy's model draft with n-gram fill-in, and
SpecInfer's merged token trees, are the same idea). The drafters are asked concurrently, so a step waits
for the slowest of them; `method: auto` weighs that against what fusing gains, like any of its choices.
Each drafter's estimates are corrected by how far its own part of the fused drafts came true before they
are merged, so that the merged tree ranks one drafter's guesses against another's fairly, and apart for
the nodes another drafter proposed too and those it proposed alone: where drafters agree they are right
far more often (on 26 Spec-Bench prompts, greedy, fp32: a member's shared nodes were accepted 49-58% of
the times they were verified, its nodes alone 5% for `trie`, 16% for `suffix` and `ngram`, 10% for
lookahead's pool), and corrected by one record for both, a member's lone guesses borrowed the trust its
agreed ones earned. Lookahead's window, when it is one of the drafters, rides along and learns from its
part of the draft.
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
        # Per sequence, for each member that drafted: its draft as sent, where its nodes went in the latest
        # merged draft, and which of them another member proposed too.
        self._placement: dict[str, dict[str, tuple[DraftTree, dict[int, int], list[bool]]]] = {}
        self._calibration = AcceptanceCalibration()  # by member method and whether its nodes were shared

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
            shared = _shared_nodes([tree for _, tree in drafted])
            merged, placements = self._merge(drafted, shared, k)
            drafts[sid] = merged
            self._placement[sid] = {method: (tree, placement, nodes_shared) for (method, tree), placement, nodes_shared
                                    in zip(drafted, placements, shared)}
        return drafts

    def merged(self, seq: Sequence, k: int, replies: dict[str, dict[str, DraftTree]]) -> DraftTree:
        """What `fuse` would draft for the sequence from `replies`, kept apart: nothing learns from it (an
        `auto` sequence's shadow ask of `fused`, made of its members' asks in the same step)."""
        drafted = self._drafted(seq.request_id, replies)
        return self._merge(drafted, _shared_nodes([tree for _, tree in drafted]), k)[0] if drafted else DraftTree()

    def _drafted(self, sid: str, replies: dict[str, dict[str, DraftTree]]) -> list[tuple[str, DraftTree]]:
        return [(m, reply[sid]) for m, reply in replies.items() if m in self.member_methods and sid in reply]

    def _merge(self, drafted: list[tuple[str, DraftTree]], shared: list[list[bool]],
               k: int) -> tuple[DraftTree, list[dict[int, int]]]:
        """The members' drafts, each node corrected by its member's record for nodes shared or alone as it
        is, merged into one tree of at most k nodes."""
        return DraftTree.merge([self._calibration.corrected_nodes([_key(m, s) for s in nodes_shared], tree)
                                for (m, tree), nodes_shared in zip(drafted, shared)], k)

    def window(self, seq: Sequence) -> Window | None:
        windows = [member.window(seq) for member in self._members if isinstance(member, WindowSource)]
        return next((window for window in windows if window is not None), None)

    def observe(self, seq: Sequence, guesses: list[int], num_verified: int, accepted_nodes: tuple[int, ...]) -> None:
        """The step verified the merged draft's first `num_verified` nodes: each member's estimates are checked
        against the accepted path in its own nodes among them, and a member with a window learns from it."""
        drafted = self._placement.pop(seq.request_id, {})
        for member in self._members:
            tree, placement, shared = drafted.get(member.method, (None, {}, []))
            own = {merged: node for node, merged in placement.items() if merged < num_verified}
            accepted = tuple(own[node] for node in accepted_nodes if node in own)
            for kind in (True, False):
                nodes = sorted(node for node in own.values() if shared[node] == kind)
                if nodes:
                    self._calibration.observe_nodes(_key(member.method, kind), tree, nodes,
                                                    [node for node in accepted if shared[node] == kind])
            if isinstance(member, WindowSource):
                member.observe(seq, guesses, len(own), accepted)

    def release(self, seq: Sequence) -> None:
        self._placement.pop(seq.request_id, None)
        for member in self._members:
            member.release(seq)

    async def close(self) -> None:
        pass  # the members are closed as the deployment's own sources


def _key(method: str, shared: bool) -> str:
    """A member's record for its nodes another member proposed too, or for those it proposed alone."""
    return f"{method}/{'shared' if shared else 'alone'}"


def _shared_nodes(trees: list[DraftTree]) -> list[list[bool]]:
    """For each tree, whether each of its nodes' paths from the root is in another of the trees too."""
    paths = [tree.paths() for tree in trees]
    owners: dict[tuple[int, ...], int] = {}
    for mine in paths:
        for path in set(mine):
            owners[path] = owners.get(path, 0) + 1
    return [[owners[path] > 1 for path in mine] for mine in paths]
