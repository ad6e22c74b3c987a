"""The gateway's Prometheus metrics, on a registry of its own."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specd.latency import LATENCY_BUCKETS, TokenClock
from specd.rpc import RpcMetrics



class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.rpc_metrics = RpcMetrics(r)
        self.time_to_first_token = Histogram(
            "specd_gateway_time_to_first_token_seconds",
            "Seconds from request arrival to the first token from the target", registry=r, buckets=LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(
            "specd_gateway_inter_token_latency_seconds",
            "Seconds between consecutive chunks of a stream divided by the tokens in the later chunk "
            "(one observation per chunk)", registry=r, buckets=LATENCY_BUCKETS)
        self.e2e_request_latency = Histogram(
            "specd_gateway_e2e_request_latency_seconds",
            "Seconds from request arrival to its last chunk, for finished requests", registry=r,
            buckets=LATENCY_BUCKETS)
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
        self.http_requests = Counter("specd_gateway_http_requests",
                                     "Requests to the OpenAI-compatible HTTP API, by route and the status answered",
                                     ["route", "status"], registry=r)

    def observe_request(self, prompt_tokens: int, started: float) -> RequestObserver:
        self.prompt_tokens.inc(prompt_tokens)
        return RequestObserver(self, started)


class RequestObserver:
    """The latency and token metrics of one stream, fed as its chunks arrive."""

    def __init__(self, metrics: GatewayMetrics, started: float):
        self._metrics = metrics
        self._clock = TokenClock(started)

    def on_chunk(self, num_tokens: int) -> None:
        time_to_first_token, gap = self._clock.tick(num_tokens)
        if time_to_first_token is not None:
            self._metrics.time_to_first_token.observe(time_to_first_token)
        elif gap is not None:  # one observation per chunk
            self._metrics.inter_token_latency.observe(gap)
        self._metrics.completion_tokens.inc(num_tokens)

    def on_finish(self, reason: str) -> None:
        self._metrics.e2e_request_latency.observe(time.perf_counter() - self._clock.started)
        self._metrics.requests_finished.labels(reason).inc()
