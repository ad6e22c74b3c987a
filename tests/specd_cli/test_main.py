"""The `specd` command as a whole: every command but `specd bench` runs without the optional `bench` extra."""
from __future__ import annotations

import subprocess
import sys


def _specd_without_the_bench_extra(*argv: str) -> subprocess.CompletedProcess:
    """`specd ARGV` in a fresh interpreter in which matplotlib and tqdm cannot be imported."""
    code = ("import sys; sys.modules.update(matplotlib=None, tqdm=None)\n"
            f"from specd_cli.main import main; sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_cli_starts_without_the_bench_extra():
    result = _specd_without_the_bench_extra("serve", "drafter", "--help")
    assert result.returncode == 0, result.stderr
    assert "--listen" in result.stdout


def test_bench_without_the_extra_says_in_one_line_how_to_install_it():
    result = _specd_without_the_bench_extra("bench", "spec")
    assert result.returncode == 2
    assert result.stderr == "specd bench: needs matplotlib and tqdm: pip install 'specd[bench]'\n"


def test_specd_up_hands_its_capacity_flags_to_the_target_as_serve_target_reads_them():
    from specd_cli.main import SCHEDULER_FLAGS, _build_parser, _scheduler_args
    parser = _build_parser()
    up = parser.parse_args(["up", "--kv-cache-tokens", "4096", "--max-num-seqs", "8", "--max-step-tokens", "256",
                            "--max-waiting", "3", "--kv-cache-memory", "0.5"])
    target = parser.parse_args(["serve", "target", *_scheduler_args(up)])
    assert {name: getattr(target, name) for name in SCHEDULER_FLAGS} == \
        {"kv_cache_tokens": 4096, "kv_cache_memory": 0.5, "max_num_seqs": 8, "max_step_tokens": 256, "max_waiting": 3}


def test_specd_up_hands_the_draft_model_flags_to_its_model_drafters_only():
    from specd_cli.main import _build_parser, _draft_model_args, _proposer_args
    from specd_cli.stack import Stack
    parser = _build_parser()
    up = parser.parse_args(["up", "--drafters", "ngram,draft_model", "--draft-layers", "8", "--dtype", "bfloat16"])
    stack = Stack(model="some-model", drafters=up.drafters, model_drafter_args=_draft_model_args(up))
    assert "--draft-layers" not in stack.command("drafter-ngram")
    drafter = parser.parse_args(stack.command("drafter-draft_model")[3:])  # past `python -m specd_cli.main`
    assert _proposer_args(drafter) == {"model": "some-model", "num_layers": 8, "device": "auto", "dtype": "bfloat16",
                                       "kv_cache_tokens": 65536, "num_threads": None}


def test_a_soak_runs_the_learning_drafters_at_bounds_its_warm_up_reaches():
    from specd_cli.main import _build_parser, _proposer_args
    from specd_cli.soak.driver import soak_stack
    from specd_cli.soak.settings import SoakSettings
    stack = soak_stack(SoakSettings(suffix_cached_requests=5, trie_nodes=700))
    parser = _build_parser()
    bounds = {method: _proposer_args(parser.parse_args(stack.command(f"drafter-{method}")[3:]))
              for method in ("suffix", "trie", "ngram")}
    assert bounds["suffix"]["max_cached_requests"] == 5 and bounds["trie"]["max_nodes"] == 700 and not bounds["ngram"]


def test_the_learning_drafters_start_from_the_models_corpus_unless_specd_up_names_another_or_none(tmp_path):
    from drafter_svc import warm_corpus
    from specd.model_store import DEFAULT_MODEL
    from specd_cli.main import _build_parser, _proposer_args
    from specd_cli.stack import Stack, warm_corpus_args
    parser = _build_parser()
    mine = tmp_path / "mine.npz"
    warm_corpus.save(mine, [[1, 2, 3]], "some-model")

    def warm_outputs(warm: str | None, method: str) -> list[list[int]]:
        up = parser.parse_args(["up", *(["--warm-corpus", warm] if warm else [])])
        stack = Stack(drafter_args=warm_corpus_args(up.warm_corpus))
        return _proposer_args(parser.parse_args(stack.command(f"drafter-{method}")[3:]))["warm_outputs"]

    shipped = warm_corpus.load(warm_corpus.SHIPPED[DEFAULT_MODEL])
    assert warm_outputs(None, "suffix") == warm_outputs(None, "trie") == shipped
    assert warm_outputs("none", "suffix") == warm_outputs("none", "trie") == []
    assert warm_outputs(str(mine), "trie") == [[1, 2, 3]]


def test_every_service_takes_its_tls_identity_and_the_gateway_its_api_key_from_the_environment(monkeypatch):
    from specd_cli.main import _build_parser
    monkeypatch.setenv("SPECD_TLS_CERT", "/certs/svc.pem")
    monkeypatch.setenv("SPECD_TLS_KEY", "/certs/svc.key")
    monkeypatch.setenv("SPECD_TLS_CA", "")  # set but empty: not given
    monkeypatch.setenv("SPECD_API_KEY", "k")
    parser = _build_parser()
    for service in ("gateway", "target", "drafter"):
        args = parser.parse_args(["serve", service])
        assert (args.tls_cert, args.tls_key, args.tls_ca, args.reflection) == \
            ("/certs/svc.pem", "/certs/svc.key", None, None)
    assert parser.parse_args(["serve", "gateway"]).api_key == "k"
    assert not hasattr(parser.parse_args(["serve", "target"]), "api_key")  # only the public gateway has one


def test_a_service_given_half_a_tls_identity_exits_naming_the_flag():
    result = _specd_without_the_bench_extra("serve", "drafter", "--tls-cert", "/nonexistent.pem")
    assert result.returncode == 2
    assert result.stderr.strip() == "specd: --tls-cert and --tls-key: give both, or neither"
