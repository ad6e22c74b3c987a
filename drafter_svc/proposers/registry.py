"""Every proposer a drafter service can serve, by method name. A new drafter: one file, one line here."""
from __future__ import annotations

from drafter_svc.proposers.base import Proposer
from drafter_svc.proposers.draft_model import DraftModelProposer
from drafter_svc.proposers.eagle import EagleProposer
from drafter_svc.proposers.ngram import NgramProposer
from drafter_svc.proposers.suffix import SuffixProposer
from drafter_svc.proposers.trie import TrieProposer

PROPOSERS: dict[str, type[Proposer]] = {}


def register(proposer: type[Proposer]) -> type[Proposer]:
    """Make `proposer` servable as `specd serve drafter --method <its schema's method>`."""
    PROPOSERS[proposer.schema.method] = proposer
    return proposer


register(NgramProposer)
register(SuffixProposer)
register(TrieProposer)
register(DraftModelProposer)
register(EagleProposer)
