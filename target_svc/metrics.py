"""The target service's Prometheus metrics, on a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specd.serving import RpcMetrics

_LATENCY_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 2.5, 5, 10, 30, 60, 120)
_FAST_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1)


class TargetMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.rpc_metrics = RpcMetrics(r)
        self.requests_running = Gauge("specd_requests_running", "Sequences in the running batch", registry=r)
        self.requests_waiting = Gauge("specd_requests_waiting", "Sequences queued for admission", registry=r)
        self.requests_finished = Counter("specd_requests_finished", "Finished requests by finish reason",
                                         ["reason"], registry=r)
        self.queue_time = Histogram("specd_request_queue_time_seconds", "Arrival to first scheduled step",
                                    registry=r, buckets=_LATENCY_BUCKETS)
        self.time_to_first_token = Histogram("specd_time_to_first_token_seconds", "Arrival to first token, by method",
                                             ["method"], registry=r, buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(
            "specd_inter_token_latency_seconds",
            "Time between consecutive output tokens, by method (a step's gap divided by the tokens it produced)",
            ["method"], registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e_latency = Histogram("specd_e2e_request_latency_seconds", "Arrival to last token, by method",
                                     ["method"], registry=r, buckets=_LATENCY_BUCKETS)
        self.draft_tokens = Counter("specd_draft_tokens", "Draft tokens sent to verification, by method",
                                    ["method"], registry=r)
        self.accepted_tokens = Counter("specd_accepted_tokens", "Draft tokens the target kept, by method",
                                       ["method"], registry=r)
        self.accepted_per_position = Counter(
            "specd_accepted_tokens_per_position",
            "Draft tokens kept, by method and 0-based draft position (acceptance by position)",
            ["method", "position"], registry=r)
        self.verification_steps = Counter(
            "specd_verification_steps",
            "Decode steps per sequence, by method; tokens out / steps = mean acceptance length",
            ["method"], registry=r)
        self.output_tokens = Counter("specd_output_tokens", "Tokens generated, by method", ["method"], registry=r)
        self.step_batch_size = Histogram("specd_step_batch_size", "Sequences in one forward pass", registry=r,
                                         buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.step_tokens = Histogram("specd_step_tokens", "Tokens (prompt + verified) in one forward pass",
                                     registry=r, buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384))
        self.forward_time = Histogram("specd_forward_seconds", "One forward pass plus verification", registry=r,
                                      buckets=_LATENCY_BUCKETS)
        self.kv_blocks_used = Gauge("specd_kv_cache_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge("specd_kv_cache_blocks_total", "KV cache blocks in the pool", registry=r)
        self.drafter_rpc_latency = Histogram("specd_drafter_rpc_seconds", "Propose RPC wall time, by method",
                                             ["method"], registry=r, buckets=_FAST_BUCKETS)
        self.drafter_failures = Counter(
            "specd_drafter_rpc_failures",
            "Propose RPCs that failed or missed their deadline (the step went on draft-free), by method and code",
            ["method", "code"], registry=r)
