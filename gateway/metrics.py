"""The gateway's Prometheus metrics, on a registry of its own."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specd.rpc import RpcMetrics

_LATENCY_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.rpc_metrics = RpcMetrics(r)
        self.time_to_first_token = Histogram(
            "specd_gateway_time_to_first_token_seconds",
            "Seconds from request arrival to the first token from the target", registry=r, buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(
            "specd_gateway_inter_token_latency_seconds",
            "Seconds between consecutive chunks of a stream divided by the tokens in the later chunk "
            "(one observation per chunk)", registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e_request_latency = Histogram(
            "specd_gateway_e2e_request_latency_seconds",
            "Seconds from request arrival to its last chunk, for finished requests", registry=r,
            buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("specd_gateway_prompt_tokens", "Prompt tokens sent to the target", registry=r)
        self.completion_tokens = Counter("specd_gateway_completion_tokens",
                                         "Completion tokens received from the target and streamed to clients",
                                         registry=r)
        self.requests_finished = Counter(
            "specd_gateway_requests_finished",
            "Requests that ran to the end, by finish reason "
            "(errors and cancellations: specd_rpc_requests_total by code)",
            ["reason"], registry=r)
        self.requests_running = Gauge("specd_gateway_requests_running", "Generate streams in progress", registry=r)

    def observe_request(self, prompt_tokens: int, started: float) -> RequestObserver:
        self.prompt_tokens.inc(prompt_tokens)
        return RequestObserver(self, started)


class RequestObserver:
    """The latency and token metrics of one stream, fed as its chunks arrive."""

    def __init__(self, metrics: GatewayMetrics, started: float):
        self._metrics = metrics
        self._started = started
        self._last_chunk_at: float | None = None

    def on_chunk(self, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.perf_counter()
        if self._last_chunk_at is None:
            self._metrics.time_to_first_token.observe(now - self._started)
        else:
            self._metrics.inter_token_latency.observe((now - self._last_chunk_at) / num_tokens)
        self._last_chunk_at = now
        self._metrics.completion_tokens.inc(num_tokens)

    def on_finish(self, reason: str) -> None:
        self._metrics.e2e_request_latency.observe(time.perf_counter() - self._started)
        self._metrics.requests_finished.labels(reason).inc()
