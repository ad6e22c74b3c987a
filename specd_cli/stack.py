"""Runs the whole system as separate processes on loopback: `specd up`.

Each service is its own `specd serve ...` process, as in a real deployment, so
a drafter can die (and is restarted) without touching the target or gateway.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd import defaults
from specd.model_store import DEFAULT_MODEL, resolve_model
from specd.ports import free_ports
from specd.security import TlsConfig
from target_svc.drafting.registry import IN_TARGET_SOURCES

# Seconds before restarting a service that exited, growing while it keeps exiting; one that has
# run for STABLE_AFTER_S starts over at the first.
RESTART_BACKOFF_S = (1, 2, 4, 8, 16, 30)
STABLE_AFTER_S = 60.0
# How long `Stack.up` waits, by default, for every service to report SERVING.
START_TIMEOUT_S = 300.0
# Every CPU drafter service. A deployment not told its `method` serves `auto` over its drafters.
DRAFTER_METHODS = ("ngram", "suffix", "trie")
# The drafters that run a model, started on request (`specd up --drafters ngram,eagle`).
MODEL_DRAFTER_METHODS = ("draft_model", "eagle")
ALL_DRAFTER_METHODS = (*DRAFTER_METHODS, *MODEL_DRAFTER_METHODS)
# The drafters whose global caches start from a warm corpus (drafter_svc.warm_corpus).
WARM_CORPUS_METHODS = ("suffix", "trie")
# Drafting that runs inside the target (no service of its own): lookahead's window rides in its forward.
IN_TARGET_METHODS = tuple(IN_TARGET_SOURCES)
# What `specd up` serves unless told which: the CPU drafters and lookahead.
DEFAULT_DRAFTERS = (*DRAFTER_METHODS, *IN_TARGET_METHODS)


def drafter_service(method: str) -> str:
    """The service name of the drafter serving `method`, as in docker-compose.yml."""
    return f"drafter-{method}"


def while_down(service: str) -> str:
    """What a client sees while `service` is down."""
    if service.startswith("drafter-"):
        return "requests go on draft-free meanwhile"
    return {"target": "the gateway answers UNAVAILABLE meanwhile",
            "gateway": "clients cannot connect meanwhile"}[service]


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


@dataclass
class StackPorts:
    """Each service's gRPC and /metrics port, by service name: by default those `specd serve` listens
    on, the drafters' one after another from the drafter's default."""
    grpc: dict[str, int] = field(default_factory=lambda: {
        "gateway": _port(defaults.GATEWAY_ADDRESS), "target": _port(defaults.TARGET_ADDRESS),
        **{drafter_service(m): _port(defaults.DRAFTER_ADDRESS) + i for i, m in enumerate(ALL_DRAFTER_METHODS)}})
    metrics: dict[str, int] = field(default_factory=lambda: {
        "gateway": _port(defaults.GATEWAY_METRICS_ADDRESS), "target": _port(defaults.TARGET_METRICS_ADDRESS),
        **{drafter_service(m): _port(defaults.DRAFTER_METRICS_ADDRESS) + i for i, m in enumerate(ALL_DRAFTER_METHODS)}})
    http: int | None = _port(defaults.GATEWAY_HTTP_ADDRESS)  # the gateway's OpenAI-compatible API; None: off

    @classmethod
    def free(cls) -> StackPorts:
        """Free ports for every service: a stack beside any other (tests, benchmarks)."""
        services = ["gateway", "target", *map(drafter_service, ALL_DRAFTER_METHODS)]
        ports = iter(free_ports(2 * len(services) + 1))
        return cls({s: next(ports) for s in services}, {s: next(ports) for s in services}, next(ports))


@dataclass
class Stack:
    """gateway + target + a drafter service per method as child processes; `supervise` restarts any
    that dies."""
    model: str = DEFAULT_MODEL
    ports: StackPorts = field(default_factory=StackPorts)
    drafters: tuple[str, ...] = DEFAULT_DRAFTERS  # methods: a service each, or in the target (IN_TARGET_METHODS)
    host: str = "127.0.0.1"
    threads: int | None = None
    extra_target_args: list[str] = field(default_factory=list)
    model_drafter_args: list[str] = field(default_factory=list)  # engine and draft-model flags of model drafters
    drafter_args: dict[str, list[str]] = field(default_factory=dict)  # by method: that drafter's own flags
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    started_at: dict[str, float] = field(default_factory=dict)

    @property
    def services(self) -> list[str]:
        """In start order: the drafters, the target, the gateway."""
        return [*(drafter_service(m) for m in self.drafters if m not in IN_TARGET_METHODS), "target", "gateway"]

    def services_of(self, role: str) -> list[str]:
        """The services that run `specd serve ROLE` (every drafter-METHOD for "drafter")."""
        return [s for s in self.services if s == role or s.startswith(f"{role}-")]

    def address(self, service: str) -> str:
        return f"{self.host}:{self.ports.grpc[service]}"

    def metrics_url(self, service: str) -> str:
        return f"http://{self.host}:{self.ports.metrics[service]}/metrics"

    @property
    def http_url(self) -> str | None:
        """The base URL of the gateway's OpenAI-compatible API (what an `openai` client takes)."""
        return f"http://{self.host}:{self.ports.http}/v1" if self.ports.http is not None else None

    def command(self, service: str) -> list[str]:
        role = "drafter" if service.startswith("drafter-") else service
        base = [sys.executable, "-m", "specd_cli.main", "serve", role, "--listen", self.address(service),
                "--metrics-listen", f"{self.host}:{self.ports.metrics[service]}"]
        threads = ["--threads", str(self.threads)] if self.threads else []
        if role == "drafter":
            method = service.removeprefix("drafter-")
            own = self.drafter_args.get(method, [])
            if method in MODEL_DRAFTER_METHODS:
                return [*base, "--method", method, "--model", self.model, *threads, *self.model_drafter_args, *own]
            return [*base, "--method", method, "--model", self.model, *own]
        if service == "target":
            drafters = [arg for m in self.drafters for arg in
                        ("--drafter", m if m in IN_TARGET_METHODS else f"{m}={self.address(drafter_service(m))}")]
            return [*base, "--model", self.model, *drafters, *threads, *self.extra_target_args]
        http = ["--http-listen", f"{self.host}:{self.ports.http}"] if self.ports.http is not None else ["--no-http"]
        return [*base, "--model", self.model, "--target", self.address("target"), *http]

    def start(self, service: str) -> None:
        self.processes[service] = subprocess.Popen(self.command(service))
        self.started_at[service] = time.monotonic()

    def up(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start every service and wait until each reports SERVING: the drafters, then the target, then the
        gateway, so that the target times its own steps as it starts (its step cost model's profile) while
        nothing else of the stack is loading on the same cores."""
        resolve_model(self.model)  # convert once here, not racing in two services
        deadline = time.monotonic() + timeout_s
        drafters = [s for s in self.services if s not in ("target", "gateway")]
        for group in (drafters, ["target"], ["gateway"]):
            for service in group:
                self.start(service)
            for service in group:
                self.wait_healthy(service, deadline)

    def wait_healthy(self, service: str, deadline: float) -> None:
        wait_serving(service, self.address(service), self.processes[service], deadline)

    def kill(self, service: str) -> None:
        self.processes[service].kill()
        self.processes[service].wait()

    def down(self) -> None:
        """SIGTERM everything (graceful shutdown), then wait."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()

    def supervise(self, stop: threading.Event) -> None:
        """Until `stop` is set: restart any service that exits, after a back-off that grows while
        it keeps dying; then stop everything."""
        failures = dict.fromkeys(self.processes, 0)
        restart_due: dict[str, float] = {}
        while not stop.wait(0.2):
            now = time.monotonic()
            for service, proc in self.processes.items():
                if proc.poll() is None:
                    if now - self.started_at[service] > STABLE_AFTER_S:
                        failures[service] = 0
                elif service not in restart_due:
                    delay = RESTART_BACKOFF_S[min(failures[service], len(RESTART_BACKOFF_S) - 1)]
                    failures[service] += 1
                    restart_due[service] = now + delay
                    print(f"specd: {service} exited with code {proc.returncode}; restarting it in {delay:g} s "
                          f"({while_down(service)})", file=sys.stderr, flush=True)
                elif now >= restart_due[service]:
                    del restart_due[service]
                    self.start(service)
        self.down()


def wait_serving(name: str, address: str, process: subprocess.Popen, deadline: float) -> None:
    """Until the service `process` runs at `address` reports SERVING; RuntimeError if it exits first,
    TimeoutError past `deadline` (time.monotonic())."""
    tls = TlsConfig.from_env()  # the services' own, from the environment they inherit
    channel = grpc.secure_channel(address, tls.channel_credentials()) if tls else grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not become healthy")
            time.sleep(0.2)


def warm_corpus_args(warm_corpus: str | None) -> dict[str, list[str]]:
    """The drafters' own flags (Stack.drafter_args) that start the learning ones from `warm_corpus` (a file or
    "none"; None: the corpus shipped for the model)."""
    return {method: ["--warm-corpus", warm_corpus] for method in WARM_CORPUS_METHODS} if warm_corpus else {}


def run_stack(model: str = DEFAULT_MODEL, threads: int | None = None, target_args: list[str] | None = None,
              drafters: tuple[str, ...] = DEFAULT_DRAFTERS, model_drafter_args: list[str] | None = None,
              http: bool = True, warm_corpus: str | None = None) -> int:
    stack = Stack(model=model, threads=threads, extra_target_args=target_args or [], drafters=drafters,
                  model_drafter_args=model_drafter_args or [], drafter_args=warm_corpus_args(warm_corpus))
    if not http:
        stack.ports.http = None
    try:
        stack.up()
    except (RuntimeError, TimeoutError) as err:
        print(f"specd: {err}", file=sys.stderr)
        stack.down()
        return 1
    print("specd is up:")
    for service in reversed(stack.services):
        print(f"  {service:14} grpc {stack.address(service):18} metrics {stack.metrics_url(service)}")
    if stack.http_url:
        print(f"  {'gateway':14} http {stack.http_url}  (OpenAI-compatible)")
    print('try:  specd generate --chat "Write a haiku about speculative decoding"', flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stack.supervise(stop)
    return 0
