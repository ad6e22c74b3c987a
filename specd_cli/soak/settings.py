"""What a soak runs: how many clients, how long, and which faults when."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SoakSettings:
    clients: int = 16
    warm_up_s: float = 30.0  # the same load, a storm too, before the memory baseline: first-use growth is no leak
    # And at least this many requests per client completed in the warm-up: how much a process allocates before
    # it levels off depends on the steps it has run (their shapes), not on seconds; a busy machine runs fewer.
    warm_up_requests_per_client: int = 4
    duration_s: float = 120.0  # the measured part, after the warm-up
    kill: str | None = "drafter-ngram"  # the service SIGKILLed, or None
    kill_at_s: float | None = None  # into the measured part; None: a third of the way in
    storm_streams: int = 40  # 0: no cancel storm
    storm_at_s: float | None = None  # None: two thirds of the way in
    max_tokens: int = 64
    # No deadline of the clients' own: a request is lost only if the stack fails it (the gateway ends any
    # at its upstream timeout), never because a busy machine made it slow.
    request_timeout_s: float | None = None
    restart_timeout_s: float = 300.0
    idle_timeout_s: float = 60.0  # the report says how soon each gauge was back at zero
    sample_every_s: float = 5.0
    rss_tolerance: float = 0.05  # the most a process's resident memory may move over the measured part
    seed: int = 0
    # The drafters that learn across requests grow until their bounds, by design, and at their defaults
    # (10,000 requests' outputs, 1,000,000 trie nodes) far past a soak's requests. A soak runs them with bounds
    # its warm-up reaches, so that flat memory after it says the bounds hold.
    suffix_cached_requests: int = 32
    trie_nodes: int = 20_000

    def drafter_args(self) -> dict[str, list[str]]:
        """The learning drafters' flags for their bounds, by method (`Stack.drafter_args`)."""
        return {"suffix": ["--max-cached-requests", str(self.suffix_cached_requests)],
                "trie": ["--max-trie-nodes", str(self.trie_nodes)]}

    @property
    def kill_time_s(self) -> float:
        return self.duration_s / 3 if self.kill_at_s is None else self.kill_at_s

    @property
    def storm_time_s(self) -> float:
        return 2 * self.duration_s / 3 if self.storm_at_s is None else self.storm_at_s
