"""Build and run the drafter service: one proposer behind specd.v1.Drafter, plus health, reflection and /metrics."""
from __future__ import annotations

from drafter_svc.metrics import DrafterMetrics
from drafter_svc.proposers.registry import PROPOSERS
from drafter_svc.sequences import SequenceRegistry
from drafter_svc.servicer import DrafterServicer
from specd import defaults
from specd.serving import Exposure, Service, ServiceSpec, serve_until_signalled
from specd.v1 import drafter_pb2, drafter_pb2_grpc

DRAFTER_SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


def create_service(method: str = "ngram", address: str = defaults.DRAFTER_ADDRESS,
                   metrics_address: str | None = defaults.DRAFTER_METRICS_ADDRESS,
                   sequences: SequenceRegistry | None = None, proposer_args: dict | None = None,
                   exposure: Exposure = Exposure()) -> Service:
    """A drafter service for `method` (not started). Port 0 in either address picks a free port.
    `sequences` bounds the per-sequence state (default: SequenceRegistry's bounds); `proposer_args`
    are the proposer's own settings (suffix: max_cached_requests); `exposure` its TLS and reflection."""
    if method not in PROPOSERS:
        raise ValueError(f"unknown drafter method {method!r}; this drafter serves {', '.join(PROPOSERS)}")
    proposer = PROPOSERS[method](**(proposer_args or {}))
    metrics = DrafterMetrics(method)
    servicer = DrafterServicer(proposer, SequenceRegistry() if sequences is None else sequences, metrics)
    spec = ServiceSpec(drafter_pb2_grpc.add_DrafterServicer_to_server, servicer, DRAFTER_SERVICE_NAME)
    return Service(f"drafter[{method}]", [spec], address, metrics_address, metrics.registry, exposure)


async def serve(method: str = "ngram", address: str = defaults.DRAFTER_ADDRESS,
                metrics_address: str | None = defaults.DRAFTER_METRICS_ADDRESS,
                sequences: SequenceRegistry | None = None, grace: float = defaults.SHUTDOWN_GRACE_S,
                proposer_args: dict | None = None, exposure: Exposure = Exposure()) -> None:
    """Run the drafter until SIGTERM or SIGINT, then shut down gracefully."""
    await serve_until_signalled(create_service(method, address, metrics_address, sequences, proposer_args, exposure),
                                grace)
