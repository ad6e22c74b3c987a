"""Prometheus metrics of one drafter service, in a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specd.drafts import DraftTree
from specd.rpc import RpcMetrics


class DrafterMetrics:
    def __init__(self, method: str):
        self.registry = CollectorRegistry()
        self.rpc = RpcMetrics(self.registry)
        self.sequences = Gauge("specd_drafter_sequences", "Sequences whose committed tokens this drafter holds",
                               registry=self.registry)
        self.tokens_held = Gauge("specd_drafter_tokens_held", "Committed tokens this drafter holds, all sequences",
                                 registry=self.registry)
        self.proposer_state = Gauge("specd_drafter_proposer_state",
                                    "What the proposer keeps across sequences, by kind (suffix: the global tree's "
                                    "nodes and the requests whose outputs it holds)", ["kind"], registry=self.registry)
        self.evictions = Counter("specd_drafter_evictions",
                                 "Sequences dropped without a Release: idle too long, or the least recently used "
                                 "when over --max-sequences / --max-tokens-held", ["reason"], registry=self.registry)
        # One service serves one method, so every labelled series is bound to it here.
        self.proposals = Counter("specd_drafter_proposals", "Sequences the proposer was asked to draft for",
                                 ["method"], registry=self.registry).labels(method)
        self.draft_tokens = Counter("specd_drafter_draft_tokens", "Draft tokens proposed",
                                    ["method"], registry=self.registry).labels(method)
        self.empty_drafts = Counter("specd_drafter_empty_drafts",
                                    "Sequences the proposer was asked to draft for that got no draft (nothing matched)",
                                    ["method"], registry=self.registry).labels(method)
        self.resyncs = Counter("specd_drafter_resyncs",
                               "Sequences answered resync_needed: this drafter held fewer tokens than the update "
                               "assumed (e.g. it restarted), so the target must resend them from position 0",
                               ["method"], registry=self.registry).labels(method)
        self.propose_seconds = Histogram("specd_drafter_propose_seconds",
                                         "Seconds the proposer took for one batched Propose, state updates excluded",
                                         ["method"], registry=self.registry,
                                         buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, .01, .025, .05, .1, .5),
                                         ).labels(method)

    def observe_drafts(self, drafts: list[DraftTree], seconds: float) -> None:
        self.proposals.inc(len(drafts))
        self.draft_tokens.inc(sum(map(len, drafts)))
        self.empty_drafts.inc(sum(1 for draft in drafts if not draft))
        self.propose_seconds.observe(seconds)
