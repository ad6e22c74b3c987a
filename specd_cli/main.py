"""The `specd` command line: start the services, stream text from them."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

import grpc

from drafter_svc import warm_corpus
from drafter_svc.proposers.registry import PROPOSERS
from drafter_svc.proposers.suffix import MAX_CACHED_REQUESTS
from drafter_svc.proposers.trie import MAX_TRIE_NODES
from specd import defaults
from specd.client import SpecdClient, build_request
from specd.model_store import DEFAULT_MODEL
from specd.options import Option
from specd.types import FINISH_REASON_NAMES, SamplingParams, SpeculativeConfig
from specd.v1 import common_pb2
from specd_cli import security_flags, top
from specd_cli.bench import cli as bench_cli
from specd_cli.train import cli as train_cli
from specd_cli.stack import DEFAULT_DRAFTERS, IN_TARGET_METHODS
from target_svc.drafting.registry import IN_TARGET_SOURCES

log = logging.getLogger(__name__)

DEFAULT_ADDRESSES = {  # `specd serve ROLE`: (gRPC address, /metrics address)
    "gateway": (defaults.GATEWAY_ADDRESS, defaults.GATEWAY_METRICS_ADDRESS),
    "target": (defaults.TARGET_ADDRESS, defaults.TARGET_METRICS_ADDRESS),
    "drafter": (defaults.DRAFTER_ADDRESS, defaults.DRAFTER_METRICS_ADDRESS),
}


def _drafter_methods(value: str) -> tuple[str, ...]:
    """An argparse type: drafter methods, comma-separated, each one a drafter service serves or the target runs."""
    methods = tuple(m.strip() for m in value.split(",") if m.strip())
    known = [*PROPOSERS, *IN_TARGET_METHODS]
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"no drafter serves {', '.join(unknown)} (there are: {', '.join(known)})")
    return methods


def _int_in(low: int, high: int):
    """An argparse type: an int the request's protobuf field can hold."""
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value
    return parse


_INT32 = _int_in(-2 ** 31, 2 ** 31 - 1)
_UINT64 = _int_in(0, 2 ** 64 - 1)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() in ("true", "1")


_OPTION_TYPES = {"int": _INT32, "float": float, "bool": _bool, "string": str}


def _declared_options() -> dict[str, tuple[Option, list[str]]]:
    """Every option the registered drafters declare, by name, with the methods that take it."""
    declared: dict[str, tuple[Option, list[str]]] = {}
    for method, source in [*PROPOSERS.items(), *IN_TARGET_SOURCES.items()]:
        for option in source.schema.options:
            declared.setdefault(option.name, (option, []))[1].append(method)
    return declared


def _add_speculative_flags(parser: argparse.ArgumentParser, deployment: bool) -> None:
    """Speculative settings, as vLLM's speculative_config and as flags (the flags win). A deployment's
    unset ones take specd's defaults; a request's defer to the deployment's."""
    d = SpeculativeConfig()
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--method", help="none, auto, or a served drafter method such as ngram" +
                       (" (default: auto where there are drafters to choose among, else the one drafter, else none)"
                        if deployment else " (default: the server's)"))
    group.add_argument("--num-speculative-tokens", "-k", type=_INT32,
                       help="most draft tokens per sequence per step (a tree's nodes), 0..64" +
                       (f" (default {d.num_speculative_tokens})" if deployment else ""))
    group.add_argument("--speculative-config", type=_json_object, default={}, metavar="JSON",
                       help="vLLM-style speculative_config: method, num_speculative_tokens and the method's own "
                            "options by name, e.g. \'{\"method\": \"ngram\", \"prompt_lookup_max\": 4}\'")
    for name, (option, methods) in _declared_options().items():
        group.add_argument(f"--{name.replace('_', '-')}", dest=f"option_{name}", type=_OPTION_TYPES[option.type],
                           metavar=option.type.upper(),
                           help=f"{option.help} ({'/'.join(methods)} option, default {option.default})")


def _speculative_settings(args: argparse.Namespace) -> dict:
    """speculative_config keys from --speculative-config with the flags that were given on top."""
    settings = dict(args.speculative_config)
    flags = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens,
             **{name: getattr(args, f"option_{name}") for name in _declared_options()}}
    settings.update({key: value for key, value in flags.items() if value is not None})
    return settings


def _speculative_of(args: argparse.Namespace) -> SpeculativeConfig:
    """A deployment's default config."""
    settings, default = _speculative_settings(args), SpeculativeConfig()
    return SpeculativeConfig(settings.pop("method", default.method),
                             settings.pop("num_speculative_tokens", default.num_speculative_tokens), settings)


def _speculative_overrides(args: argparse.Namespace) -> common_pb2.SpeculativeConfig:
    """A request's config: only what was given."""
    settings = _speculative_settings(args)
    pb = common_pb2.SpeculativeConfig(method=settings.pop("method", ""))
    if "num_speculative_tokens" in settings:
        pb.num_speculative_tokens = settings.pop("num_speculative_tokens")
    pb.options.update(settings)
    return pb


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto (CUDA when there is a GPU, else cpu) | cpu | cuda[:N]")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default) | bfloat16 | float16 | auto (bf16 where the hardware runs it fast: "
                             "CUDA, CPUs with AVX-512 BF16 or AMX; fp32 elsewhere); weights, KV cache and "
                             "activations in it, logits and verification in fp32")


# The target's capacity flags, which `specd up` passes on to its target unchanged.
SCHEDULER_FLAGS = ("kv_cache_tokens", "kv_cache_memory", "max_num_seqs", "max_step_tokens", "max_waiting")


def _add_http_flags(parser: argparse.ArgumentParser, listen: bool = True) -> None:
    """The gateway's OpenAI-compatible HTTP API: on by default, beside gRPC."""
    if listen:
        parser.add_argument("--http-listen", default=defaults.GATEWAY_HTTP_ADDRESS, metavar="ADDRESS",
                            help=f"address of the OpenAI-compatible HTTP API (default {defaults.GATEWAY_HTTP_ADDRESS})")
    else:
        parser.set_defaults(http_listen=defaults.GATEWAY_HTTP_ADDRESS)
    parser.add_argument("--no-http", dest="http_listen", action="store_const", const=None,
                        help="serve gRPC only, no HTTP API")


def _add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("capacity and scheduling")
    group.add_argument("--kv-cache-tokens", type=int, default=32768, help="KV cache capacity in tokens")
    group.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                       help="KV cache capacity in GiB instead of tokens (bf16 fits twice the tokens of fp32)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    group.add_argument("--max-step-tokens", type=int, default=defaults.MAX_STEP_TOKENS,
                       help="most tokens in one forward pass (vLLM's max_num_batched_tokens): decodes and their "
                            f"drafts first, then prompts in chunks (default {defaults.MAX_STEP_TOKENS})")
    group.add_argument("--max-waiting", type=int, default=defaults.MAX_WAITING,
                       help="most requests queued for admission; beyond it, RESOURCE_EXHAUSTED at once "
                            f"(default {defaults.MAX_WAITING})")


def _add_draft_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model drafters (draft_model, eagle)")
    group.add_argument("--draft-model", default=None,
                       help="a smaller causal LM with the target's tokenizer: name, .gguf file or directory "
                            "(default: the target's model)")
    group.add_argument("--draft-layers", type=int, default=None, metavar="N",
                       help="run only the draft model's first N layers, then its final norm and LM head "
                            "(LayerSkip's early exit: the target's own first layers as a self-speculative draft)")
    group.add_argument("--eagle-head", default=None, metavar="DIR",
                       help="eagle: a head directory from `specd train eagle`, or an EAGLE-1/EAGLE-2 head as "
                            "EAGLE's authors publish them (config.json + pytorch_model.bin or model.safetensors); "
                            "default: the head shipped for the model")


def _draft_model_args(args: argparse.Namespace) -> list[str]:
    """The draft-model and engine flags as `specd serve drafter` takes them."""
    flags = {"--draft-model": args.draft_model, "--draft-layers": args.draft_layers, "--eagle-head": args.eagle_head,
             "--device": args.device, "--dtype": args.dtype}
    return [item for flag, value in flags.items() if value is not None for item in (flag, str(value))]


def _proposer_args(args: argparse.Namespace) -> dict:
    """The served method's own settings from the drafter's flags."""
    if args.method == "suffix":
        return {"max_cached_requests": args.max_cached_requests, "warm_outputs": _warm_outputs(args)}
    if args.method == "trie":
        return {"max_nodes": args.max_trie_nodes, "warm_outputs": _warm_outputs(args)}
    engine = {"device": args.device, "dtype": args.dtype, "kv_cache_tokens": args.kv_cache_tokens,
              "num_threads": args.threads}
    if args.method == "draft_model":
        return {"model": args.draft_model or args.model, "num_layers": args.draft_layers, **engine}
    if args.method == "eagle":
        return {"head": args.eagle_head, "model": args.model, **engine}
    return {}


def _warm_outputs(args: argparse.Namespace) -> list[list[int]]:
    """The outputs a learning drafter starts from (--warm-corpus; by default the corpus shipped for --model)."""
    try:
        path = warm_corpus.resolve(args.warm_corpus, args.model)
    except FileNotFoundError as err:
        raise SystemExit(f"specd serve drafter: --warm-corpus: {err}") from err
    if path is None:
        return []
    outputs = warm_corpus.load(path)
    log.info("warm corpus %s (made with %s): %d outputs, %d tokens", path, warm_corpus.model_of(path), len(outputs),
             sum(map(len, outputs)))
    return outputs


def _scheduler_args(args: argparse.Namespace) -> list[str]:
    """The capacity flags as `specd serve target` takes them."""
    return [item for name in SCHEDULER_FLAGS if (value := getattr(args, name)) is not None
            for item in (f"--{name.replace('_', '-')}", str(value))]


def _engine_of(args: argparse.Namespace):
    from engine.config import EngineConfig
    try:
        return EngineConfig.parse(args.device, args.dtype)
    except ValueError as err:
        raise SystemExit(f"specd: {err}") from err


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="python logging level (default INFO)")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start gateway + target + the CPU drafters on loopback, until Ctrl-C")
    up.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"model name, .gguf file or Hugging Face directory (default {DEFAULT_MODEL})")
    up.add_argument("--threads", type=int, default=None, help="torch threads of the target (default: torch's)")
    up.add_argument("--drafters", default=",".join(DEFAULT_DRAFTERS), type=_drafter_methods,
                    help=f"the drafters to serve, comma-separated: a service each, lookahead inside the target "
                         f"(default {','.join(DEFAULT_DRAFTERS)})")
    up.add_argument("--warm-corpus", default=None, metavar="FILE|none",
                    help="the outputs the suffix and trie drafters' global caches start from, a file of `specd "
                         "train corpus`, or none (default: the corpus shipped for --model, if any)")
    _add_engine_flags(up)
    _add_scheduler_flags(up)
    _add_draft_model_flags(up)
    _add_http_flags(up, listen=False)
    up.set_defaults(run=_up)

    serve = commands.add_parser("serve", help="start one service")
    serve.set_defaults(run=_serve)
    services = serve.add_subparsers(dest="service", required=True)
    for name, (address, metrics) in DEFAULT_ADDRESSES.items():
        sub = services.add_parser(name, help=f"the {name} service")
        sub.add_argument("--listen", default=address, help=f"gRPC address (default {address})")
        sub.add_argument("--metrics-listen", default=metrics, help=f"Prometheus /metrics address (default {metrics})")
        sub.add_argument("--shutdown-grace", type=float, default=defaults.SHUTDOWN_GRACE_S, metavar="SECONDS",
                         help="after SIGTERM, how long in-flight streams may run before they are cut "
                              f"(default {defaults.SHUTDOWN_GRACE_S:g}; the deployment files allow 15 s in all)")
        security_flags.add_service_flags(sub, public=name == "gateway")
    target, gateway, drafter = (services.choices[n] for n in ("target", "gateway", "drafter"))
    for sub in (target, gateway):
        sub.add_argument("--model", default=DEFAULT_MODEL,
                         help=f"model name, .gguf file or Hugging Face directory (default {DEFAULT_MODEL})")
        _add_speculative_flags(sub, deployment=True)
    target.add_argument("--drafter", action="append", default=[], metavar="METHOD[=ADDRESS]",
                        help=f"a draft source: a drafter service (e.g. ngram={defaults.DRAFTER_ADDRESS}) or, "
                             "without an address, a proposer that runs in the target (repeatable)")
    target.add_argument("--drafter-timeout-ms", type=float, default=50.0,
                        help="deadline of one Propose RPC; a late drafter means a draft-free step (default 50)")
    target.add_argument("--drafter-startup-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="how long to wait at start for a drafter to describe its options; one still down "
                             "then is served draft-free, its options unchecked, until it answers (default 10)")
    target.add_argument("--step-timeout", type=float, default=defaults.STEP_TIMEOUT_S, metavar="SECONDS",
                        help="a step (forward and verification) running longer is stuck: the requests waiting on "
                             "it get DEADLINE_EXCEEDED and health says NOT_SERVING until it ends "
                             f"(default {defaults.STEP_TIMEOUT_S:g})")
    target.add_argument("--step-cost-profile", default=None, metavar="FILE",
                        help="the step cost profile (timed forwards at start, ~12 s): taken from FILE where it "
                             "holds this model's on this device, dtype and threads, else measured and written "
                             "there, so that targets started alike price drafts alike (default: measured, not kept)")
    target.add_argument("--step-log", default=None, metavar="FILE",
                        help="append one JSON line per step to FILE: its time, forward, round trip, decodes, "
                             "prompt tokens, asks, draft and accepted tokens (default: none)")
    _add_engine_flags(target)
    _add_scheduler_flags(target)
    target.add_argument("--default-max-tokens", type=int, default=256,
                        help="max_tokens of requests that do not set it (default 256)")
    target.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    gateway.add_argument("--target", default=defaults.TARGET_ADDRESS,
                         help="target service address; one that resolves to several replicas (a headless Service's "
                              "dns:///target:50052, or ipv4:HOST:PORT,HOST:PORT) is balanced round-robin over "
                              f"those serving (default {defaults.TARGET_ADDRESS})")
    gateway.add_argument("--upstream-timeout", type=float, default=defaults.UPSTREAM_TIMEOUT_S, metavar="SECONDS",
                         help="the longest one request may run, unless the client's deadline is sooner "
                              f"(default {defaults.UPSTREAM_TIMEOUT_S:g})")
    _add_http_flags(gateway)
    drafter.add_argument("--method", default="ngram", help="proposer to serve (default ngram)")
    drafter.add_argument("--max-cached-requests", type=int, default=MAX_CACHED_REQUESTS,
                         help="suffix: finished requests whose outputs the global suffix tree keeps, newest first; "
                              f"0 turns it off (default {MAX_CACHED_REQUESTS})")
    drafter.add_argument("--max-trie-nodes", type=int, default=MAX_TRIE_NODES,
                         help="trie: nodes the global trie keeps; past them its rarely used branches go "
                              f"(default {MAX_TRIE_NODES})")
    drafter.add_argument("--model", default=DEFAULT_MODEL,
                         help="the target's model, name, .gguf file or directory: model drafters load it, suffix "
                              f"and trie start from the corpus shipped for it (default {DEFAULT_MODEL})")
    drafter.add_argument("--warm-corpus", default=None, metavar="FILE|none",
                         help="suffix, trie: the outputs their global caches start from, a file of `specd train "
                              "corpus`, or none to start empty (default: the corpus shipped for --model, if any)")
    _add_draft_model_flags(drafter)
    _add_engine_flags(drafter)
    drafter.add_argument("--kv-cache-tokens", type=int, default=65536,
                         help="model drafters: their own KV cache, in tokens (default 65536)")
    drafter.add_argument("--threads", type=int, default=None, help="model drafters: torch threads (default: torch's)")
    drafter.add_argument("--max-sequences", type=int, default=defaults.DRAFTER_MAX_SEQUENCES,
                         help="sequences held at most; the least recently used beyond are dropped "
                              f"(default {defaults.DRAFTER_MAX_SEQUENCES})")
    drafter.add_argument("--max-tokens-held", type=int, default=defaults.DRAFTER_MAX_TOKENS_HELD,
                         help=f"tokens held at most, all sequences (default {defaults.DRAFTER_MAX_TOKENS_HELD})")
    drafter.add_argument("--sequence-idle-timeout", type=float, default=defaults.DRAFTER_IDLE_TIMEOUT_S, metavar="SECONDS",
                         help="a sequence not asked about for this long is dropped "
                              f"(default {defaults.DRAFTER_IDLE_TIMEOUT_S:g})")

    gen = commands.add_parser("generate", help="stream text from a running gateway")
    gen.add_argument("prompt", help="prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    gen.add_argument("--system", default=None, help="a system message (with --chat)")
    gen.add_argument("--gateway", default=defaults.GATEWAY_ADDRESS,
                     help=f"gateway address (default {defaults.GATEWAY_ADDRESS})")
    gen.add_argument("--max-tokens", type=_INT32, default=0, help="most tokens to generate (default: the server's)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    gen.add_argument("--top-k", type=_INT32, default=0, help="keep the k most likely tokens (default 0 = off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1)")
    gen.add_argument("--seed", type=_UINT64, default=None, help="seed of this request's random stream")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per chunk, then one with usage")
    gen.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="deadline of the whole request (default: none of the client's own)")
    _add_speculative_flags(gen, deployment=False)
    security_flags.add_client_flags(gen)
    gen.set_defaults(run=_generate)
    top.register(commands)
    bench_cli.register(commands)
    train_cli.register(commands)
    return parser


def _generate(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_stream_generation(args))
    except grpc.aio.AioRpcError as err:
        print(f"specd: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1


async def _stream_generation(args: argparse.Namespace) -> int:
    messages = None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.repetition_penalty, args.seed,
                              args.max_tokens)
    request = build_request(None if args.chat else args.prompt, messages, sampling, args.stop,
                            _speculative_overrides(args))
    async with SpecdClient(args.gateway, tls_ca=args.tls_ca, api_key=args.api_key) as client:
        async for chunk in client.generate(request, timeout=args.timeout):
            if args.json:
                print(json.dumps({"text": chunk.text, "token_ids": list(chunk.token_ids),
                                  "accepted_draft_tokens": chunk.accepted_draft_tokens}), flush=True)
            else:
                print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                _print_final(chunk, args.json)
    return 0


def _print_final(chunk, as_json: bool) -> None:
    usage = {f.name: getattr(chunk.usage, f.name) for f in chunk.usage.DESCRIPTOR.fields}
    reason = FINISH_REASON_NAMES.get(chunk.finish_reason, "unspecified")
    if as_json:
        print(json.dumps({"finish_reason": reason, "usage": usage}), flush=True)
    else:
        steps = usage["verification_steps"]
        tau = (usage["completion_tokens"] - 1) / steps if steps else 1.0
        print(f"\n[{reason}] {usage['completion_tokens']} tokens: a prefill and {steps} decoding steps "
              f"({tau:.2f} tokens/step, "
              f"{usage['accepted_draft_tokens']}/{usage['draft_tokens']} drafts accepted)", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    try:
        tls = security_flags.tls_of(args)
    except ValueError as error:
        print(f"specd: {error}", file=sys.stderr)
        return 2
    if args.service == "target":
        from target_svc.server import TargetOptions, serve
        drafters = {method: address or None for method, _, address in (spec.partition("=") for spec in args.drafter)}
        asyncio.run(serve(TargetOptions(
            model=args.model, address=args.listen, metrics_address=args.metrics_listen, drafters=drafters,
            default_speculative=_speculative_of(args), drafter_timeout_s=args.drafter_timeout_ms / 1000,
            drafter_startup_timeout_s=args.drafter_startup_timeout,
            kv_cache_tokens=args.kv_cache_tokens, kv_cache_memory_gib=args.kv_cache_memory,
            engine=_engine_of(args), max_num_seqs=args.max_num_seqs, max_step_tokens=args.max_step_tokens,
            max_waiting=args.max_waiting, step_timeout_s=args.step_timeout, step_cost_profile=args.step_cost_profile,
            step_log=args.step_log, default_max_tokens=args.default_max_tokens, num_threads=args.threads,
            shutdown_grace_s=args.shutdown_grace, tls=tls, reflection=args.reflection)))
    elif args.service == "gateway":
        from gateway.server import serve
        asyncio.run(serve(model=args.model, target_address=args.target, address=args.listen,
                          metrics_address=args.metrics_listen, default_speculative=_speculative_of(args),
                          upstream_timeout_s=args.upstream_timeout, http_address=args.http_listen,
                          grace=args.shutdown_grace, tls=tls, api_key=args.api_key, reflection=args.reflection))
    else:
        from drafter_svc.sequences import SequenceRegistry
        from drafter_svc.server import serve
        from specd.serving import Exposure
        sequences = SequenceRegistry(args.max_sequences, args.max_tokens_held, args.sequence_idle_timeout)
        asyncio.run(serve(method=args.method, address=args.listen, metrics_address=args.metrics_listen,
                          sequences=sequences, grace=args.shutdown_grace, proposer_args=_proposer_args(args),
                          exposure=Exposure(tls=tls, reflection=args.reflection)))
    return 0


def _up(args: argparse.Namespace) -> int:
    from specd_cli.stack import run_stack
    _engine_of(args)  # a bad value is refused here, not by the target after the others started
    return run_stack(args.model, args.threads, ["--device", args.device, "--dtype", args.dtype, *_scheduler_args(args)],
                     args.drafters, _draft_model_args(args), http=args.http_listen is not None,
                     warm_corpus=args.warm_corpus)


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
