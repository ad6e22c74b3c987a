"""The stack a benchmark talks to: one already running (--gateway) or one it
starts on free loopback ports, with the services' logs kept beside the results.
Every method runs on the one target; each method's requests are in a corpus scope of
their own (gateway_requests.make_request), so the drafters that learn across requests
draft a method's requests from that method's outputs alone."""
from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specd.v1 import target_pb2, target_pb2_grpc
from specd_cli.bench.errors import BenchError
from specd_cli.stack import DEFAULT_DRAFTERS, MODEL_DRAFTER_METHODS, Stack, StackPorts, warm_corpus_args

METRICS_TIMEOUT_S = 5.0


@dataclass
class Deployment:
    gateway: str  # gRPC host:port, or the HTTP API's base URL when the bench speaks HTTP
    target: str | None  # known when started here or given with --target
    methods: list[str]  # the methods to compare, `none` first


@dataclass
class _LoggedStack(Stack):
    """A Stack whose services write to log files, so the progress bar stays readable."""
    log_dir: Path = field(default_factory=Path)

    def start(self, service: str) -> None:
        with (self.log_dir / f"{service}.log").open("ab") as log:
            self.processes[service] = subprocess.Popen(self.command(service), stdout=log, stderr=subprocess.STDOUT)



@contextmanager
def deployment(gateway: str | None, target: str | None, model: str, threads: int, dtype: str, log_dir: Path,
               methods: list[str] | None = None, draft_layers: int | None = None,
               protocol: str = "grpc", warm_corpus: str | None = None, step_logs: bool = False) -> Iterator[Deployment]:
    """Use the given gateway, or start gateway + target + drafters and stop them on exit: every CPU drafter
    and lookahead, and the model drafters among `methods` (in the target's dtype; draft_model on the target's
    first `draft_layers` layers when given). `protocol`: which of the gateway's APIs the bench speaks;
    `warm_corpus`: what the learning drafters start from (stack.warm_corpus_args); `step_logs`: the target
    writes its steps to steps.jsonl beside its log (target_svc.step_log)."""
    if gateway:
        yield Deployment(gateway, target, resolve_methods(methods, target))
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    model_drafters = tuple(m for m in MODEL_DRAFTER_METHODS if m in (methods or ()))
    steps = ["--step-log", str(log_dir / "steps.jsonl")] if step_logs else []
    profile = ["--step-cost-profile", str(log_dir / "step_cost_profile.json")]  # kept with the run's logs
    stack = _LoggedStack(model=model, ports=StackPorts.free(), threads=threads,
                         extra_target_args=["--dtype", dtype, *profile, *steps],
                         drafters=(*DEFAULT_DRAFTERS, *model_drafters),
                         model_drafter_args=["--dtype", dtype, *(["--draft-layers", str(draft_layers)]
                                                                 if draft_layers else [])],
                         drafter_args=warm_corpus_args(warm_corpus), log_dir=log_dir)
    try:
        try:
            stack.up()
        except (RuntimeError, TimeoutError) as err:
            raise BenchError(f"could not start the stack: {err} (service logs in {log_dir})") from err
        address = stack.http_url if protocol == "http" else stack.address("gateway")
        yield Deployment(address, stack.address("target"), resolve_methods(methods, stack.address("target")))
    finally:
        _keep_metrics(stack)
        stack.down()


def _keep_metrics(stack: _LoggedStack) -> None:
    """Each service's metrics as the run left them, beside its log (gone with the stack otherwise): which
    drafter `auto` chose and why, the windows run and skipped, the step cost model, the drafters' caches."""
    for service in stack.services:
        try:
            with urllib.request.urlopen(stack.metrics_url(service), timeout=METRICS_TIMEOUT_S) as response:
                (stack.log_dir / f"{service}.metrics.txt").write_bytes(response.read())
        except OSError:  # a service that is down has none to keep; the run's results stand without them
            pass


def served_methods(target: str, timeout_s: float = 10.0) -> list[str]:
    """The methods the target serves, "none" included, from its GetModelInfo."""
    try:
        with grpc.insecure_channel(target) as channel:
            info = target_pb2_grpc.TargetStub(channel).GetModelInfo(target_pb2.ModelInfoRequest(), timeout=timeout_s)
    except grpc.RpcError as err:
        raise BenchError(f"cannot list the methods of the target at {target}: {err.code().name}; "
                         f"pass --methods instead") from err
    return list(info.methods)


def resolve_methods(requested: list[str] | None, target: str | None) -> list[str]:
    """The methods to compare, `none` first: it is the reference every speedup and output check uses."""
    if requested is None:
        if target is None:
            raise BenchError("with --gateway, pass --methods (e.g. none,ngram) or --target so they can be listed")
        requested = served_methods(target)
    return ["none", *[m for m in dict.fromkeys(requested) if m != "none"]]
