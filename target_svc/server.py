"""Builds and runs the target service."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from specd.model_store import DEFAULT_MODEL, resolve_model
from specd import defaults
from specd.security import TlsConfig
from specd.serving import Exposure, Service, ServiceSpec, serve_until_signalled
from specd.types import SpeculativeConfig
from specd.v1 import target_pb2, target_pb2_grpc
from target_svc.cost_model import StepCostModel
from target_svc.drafting.base import DraftSource
from target_svc.drafting.drafters import Drafters
from target_svc.drafting.registry import IN_TARGET_SOURCES
from target_svc.drafting.remote import RemoteDrafter
from engine.config import EngineConfig
from engine.runner import ModelRunner
from target_svc.metrics import TargetMetrics
from target_svc.scheduler import Scheduler
from target_svc.servicer import TargetServicer
from target_svc.step_log import StepLog

log = logging.getLogger(__name__)


@dataclass
class TargetOptions:
    model: str = DEFAULT_MODEL
    address: str = defaults.TARGET_ADDRESS
    metrics_address: str | None = defaults.TARGET_METRICS_ADDRESS
    # method -> drafter service address, or None for a proposer that runs in the target
    drafters: dict[str, str | None] = field(default_factory=dict)
    default_speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    drafter_timeout_s: float = 0.05
    drafter_startup_timeout_s: float = 10.0  # then a drafter still down is served draft-free until it answers
    kv_cache_tokens: int = 32768
    kv_cache_memory_gib: float | None = None  # instead of kv_cache_tokens: as many tokens as fit in this memory
    max_num_seqs: int = 64
    max_step_tokens: int = defaults.MAX_STEP_TOKENS
    max_waiting: int = defaults.MAX_WAITING
    step_timeout_s: float = defaults.STEP_TIMEOUT_S  # a step running longer is stuck: NOT_SERVING until it ends
    # The step cost profile's file: taken from it where it holds this model's on this device, dtype and threads,
    # else measured and written there. None: measured, not kept.
    step_cost_profile: str | None = None
    step_log: str | None = None  # a file each step is written to as a JSON line (target_svc.step_log), or none
    default_max_tokens: int = 256
    num_threads: int | None = None
    engine: EngineConfig = EngineConfig()  # device and dtype of the model and its KV cache
    shutdown_grace_s: float = defaults.SHUTDOWN_GRACE_S
    tls: TlsConfig | None = None  # its server's identity, and its channels' to the drafters
    reflection: bool | None = None  # None: on loopback only


class TargetService(Service):
    """The gRPC server plus the scheduler loop it feeds."""

    def __init__(self, options: TargetOptions):
        self.metrics = TargetMetrics()
        model_dir = resolve_model(options.model)
        # Every torch op of the model runs on this one thread, loading included: a second
        # thread touching torch brings a second OpenMP pool, and on a small machine the two
        # pools' spinning workers halve the speed of each forward (measured: 45 ms -> 80 ms).
        self.compute_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-compute")
        self.runner = self.compute_thread.submit(
            ModelRunner, model_dir, kv_cache_tokens=options.kv_cache_tokens, num_threads=options.num_threads,
            engine=options.engine, kv_cache_memory_gib=options.kv_cache_memory_gib).result()
        self._report_engine(options.engine)
        self.cost_model = self._profiled_cost_model(model_dir, options)
        self.drafters = Drafters([self._draft_source(method, address, options) for method, address
                                  in options.drafters.items()], self.runner.vocab_size)
        self.scheduler = Scheduler(self.runner, self.compute_thread, self.drafters, self.metrics,
                                   max_num_seqs=options.max_num_seqs, max_step_tokens=options.max_step_tokens,
                                   cost_model=self.cost_model, max_waiting=options.max_waiting,
                                   step_timeout_s=options.step_timeout_s, report_serving=self.set_serving,
                                   step_log=StepLog(options.step_log) if options.step_log else None)
        info = target_pb2.ModelInfo(model=str(options.model), max_context_length=self.runner.max_context_length,
                                    vocab_size=self.runner.vocab_size, eos_token_ids=self.runner.eos_token_ids,
                                    default_max_tokens=options.default_max_tokens)
        self.servicer = TargetServicer(self.scheduler, info, options.default_speculative, self.metrics)
        spec = ServiceSpec(target_pb2_grpc.add_TargetServicer_to_server, self.servicer,
                           target_pb2.DESCRIPTOR.services_by_name["Target"].full_name)
        super().__init__("target", [spec], options.address, options.metrics_address, self.metrics.registry,
                         Exposure(tls=options.tls, reflection=options.reflection))
        self._loop_task: asyncio.Task | None = None

    def _profiled_cost_model(self, model_dir: Path, options: TargetOptions) -> StepCostModel:
        """The step cost model, its profile taken from options.step_cost_profile where that holds this
        target's, else measured here (and written there)."""
        cost_model = StepCostModel()
        key = f"{model_dir} {options.engine.device} {options.engine.dtype_name} threads={options.num_threads}"
        started = time.perf_counter()
        if options.step_cost_profile and cost_model.load_profile(options.step_cost_profile, key):
            source = f"from {options.step_cost_profile}"
        else:
            self.compute_thread.submit(cost_model.profile, self.runner).result()
            source = f"{time.perf_counter() - started:.1f} s profile"
            if options.step_cost_profile:
                cost_model.save_profile(options.step_cost_profile, key)
        c = cost_model.coefficients
        knees = "".join(f" + {extra * 1e3:.3f} ms more past {knee}" for knee, extra
                        in zip(cost_model.knees, (c.per_token_past_first_knee, c.per_token_past_second_knee)))
        log.info("step cost (%s): %.2f ms + %.3f ms per new token%s + %.5f ms per token of sequence length + %.6f "
                 "ms per query-key pair", source, c.fixed * 1e3, c.per_token * 1e3, knees, c.per_context * 1e3,
                 c.per_pair * 1e3)
        return cost_model

    def _report_engine(self, engine: EngineConfig) -> None:
        cache = self.runner.cache
        attention, invariant = self.runner.attention_backend, self.runner.batch_invariant
        log.info("engine: %s %s, %s attention, batch invariant: %s; KV cache %d tokens x %d bytes = %.0f MiB",
                 engine.device, engine.dtype_name, attention, "yes" if invariant else "no", cache.num_tokens,
                 cache.bytes_per_token, cache.num_tokens * cache.bytes_per_token / 2 ** 20)
        self.metrics.engine_info.labels(engine.device, engine.dtype_name, attention, str(invariant).lower()).set(1)
        self.metrics.kv_bytes_per_token.set(cache.bytes_per_token)
        self.metrics.kv_tokens_total.set(cache.num_tokens)

    def _draft_source(self, method: str, address: str | None, options: TargetOptions) -> DraftSource:
        if address:
            return RemoteDrafter(method, address, self.runner.vocab_size, options.drafter_timeout_s, self.metrics,
                                 options.drafter_startup_timeout_s, options.tls)
        if method not in IN_TARGET_SOURCES:
            raise ValueError(f"no in-target proposer {method!r} (there are: {', '.join(IN_TARGET_SOURCES) or 'none'}); "
                             f"a drafter service is given as METHOD=ADDRESS")
        return IN_TARGET_SOURCES[method]()

    async def start(self) -> None:
        await self.drafters.start()
        self.servicer.serve_methods(lambda: self.drafters.schemas)
        self._loop_task = asyncio.get_running_loop().create_task(self.scheduler.run())
        self._loop_task.add_done_callback(self._on_scheduler_exit)
        await super().start()

    def _on_scheduler_exit(self, task: asyncio.Task) -> None:
        """Drafters may come and go, but without its scheduler loop the target serves nothing."""
        if not task.cancelled():
            log.error("the scheduler loop ended: %r; reporting NOT_SERVING", task.exception())
            asyncio.get_running_loop().create_task(self.set_serving(False))

    async def stop(self, grace: float = defaults.SHUTDOWN_GRACE_S) -> None:
        await super().stop(grace)
        if self._loop_task is not None:
            self._loop_task.cancel()
        await self.scheduler.close()
        await self.drafters.close()


async def serve(options: TargetOptions) -> None:
    await serve_until_signalled(TargetService(options), options.shutdown_grace_s)
