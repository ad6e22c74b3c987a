"""Train an EAGLE head on prepared shards (EAGLE's recipe): for every pair (x_{p+1}, f_p) the head's output
g_p regresses the target's next feature f_{p+1} (smooth L1) and its draft logits match the target's
next-token distribution over the draft vocabulary (cross-entropy, weighted by `token_weight`: EAGLE's 0.1
by default). Input features
get uniform noise, as the head drafts from its own estimates after the first token.

Progress (tokens/s, losses, held-out top-1: how often the head's first draft token is the target's
argmax) is logged; a checkpoint every CHECKPOINT_EVERY steps makes the run resumable.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from safetensors.torch import load_file

from engine.eagle import WEIGHTS_FILE, EagleConfig, save_head
from engine.eagle_module import EagleHeadModule
from specd_cli.train.data import Shard

log = logging.getLogger(__name__)

FEATURE_NOISE = 0.2  # half-width of the uniform noise on input features
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass(frozen=True)
class TrainSettings:
    epochs: float = 2.0
    learning_rate: float = 5e-4
    batch_tokens: int = 4096  # tokens per optimizer step (gradient accumulated over sequences)
    draft_vocab_size: int = 8192
    token_weight: float = 0.1
    held_out_sequences: int = 32
    log_every: int = 20  # optimizer steps
    checkpoint_every: int = 200
    seed: int = 0


def draft_vocabulary(shards: list[Shard], size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the data, most frequent first (EAGLE-3's d2t)."""
    counts = Counter()
    for shard in shards:
        for tokens in shard.tokens:
            counts.update(tokens.tolist())
    return torch.tensor([token for token, _ in counts.most_common(size)], dtype=torch.int64)


def train(shards: list[Shard], config_of_target, target_embed: torch.Tensor, target_lm_head: torch.Tensor,
          out_dir: Path, settings: TrainSettings = TrainSettings(), target_name: str = "",
          device: str = "cpu", init: Path | None = None) -> dict[str, float]:
    """Train (or resume) a head into out_dir on `device`, from scratch or from the head in `init`; returns
    the final held-out metrics."""
    torch.manual_seed(settings.seed)
    sequences = [(t.long().to(device), f.to(device)) for shard in shards for t, f in zip(shard.tokens, shard.features)]
    held = min(settings.held_out_sequences, len(sequences) // 10)  # a tenth at most
    held_out, training = sequences[:held], sequences[held:]
    checkpoint_path = out_dir / CHECKPOINT_FILE
    checkpoint = torch.load(checkpoint_path) if checkpoint_path.exists() else None
    start = checkpoint["state"] if checkpoint else load_file(init / WEIGHTS_FILE) if init else None
    vocab = start["draft_vocab"] if start else draft_vocabulary(shards, settings.draft_vocab_size)
    config = EagleConfig.for_target(config_of_target, len(vocab), target_name)
    module = EagleHeadModule(config, target_embed, target_lm_head, vocab).to(device)
    full_lm_head = target_lm_head.float().to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    total_tokens = settings.epochs * sum(len(t) - 1 for t, _ in training)
    total_steps = max(1, int(total_tokens // settings.batch_tokens))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, total_steps))
    step, position = 0, 0
    if start:
        module.load_inference_state({name: t.float() if t.is_floating_point() else t for name, t in start.items()})
    if checkpoint:
        optimizer.load_state_dict(checkpoint["optimizer"])
        schedule.load_state_dict(checkpoint["schedule"])
        step, position = checkpoint["step"], checkpoint["position"]
        log.info("resumed at step %d of %d", step, total_steps)
    order = torch.randperm(len(training), generator=torch.Generator().manual_seed(settings.seed)).tolist()
    started, seen, running = time.perf_counter(), 0, _Running()
    while step < total_steps:
        batch_tokens = 0
        while batch_tokens < settings.batch_tokens:
            tokens, features = training[order[position % len(training)]]
            position += 1
            loss_feature, loss_token, n = _losses(module, tokens, features.float(), noise=FEATURE_NOISE)
            ((loss_feature + settings.token_weight * loss_token) * n / settings.batch_tokens).backward()
            running.add(loss_feature.item(), loss_token.item(), n)
            batch_tokens += n
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        step += 1
        seen += batch_tokens
        if step % settings.log_every == 0 or step == total_steps:
            log.info("step %d/%d  %.0f tokens/s  feature loss %.4f  token loss %.4f  lr %.2e", step, total_steps,
                     seen / (time.perf_counter() - started), *running.means(), schedule.get_last_lr()[0])
            running = _Running()
        if step % settings.checkpoint_every == 0 or step == total_steps:
            metrics = evaluate(module, held_out, full_lm_head)
            log.info("step %d: held-out top-1 %.3f (feature loss %.4f)", step, metrics["top1"],
                     metrics["feature_loss"])
            torch.save({"state": module.inference_state(), "optimizer": optimizer.state_dict(),
                        "schedule": schedule.state_dict(), "step": step, "position": position}, checkpoint_path)
            save_head(out_dir, config, module.inference_state(), dtype=torch.bfloat16)  # servable if stopped here
    metrics = evaluate(module, held_out, full_lm_head)
    save_head(out_dir, config, module.inference_state(), dtype=torch.bfloat16)
    return metrics


def evaluate(module: EagleHeadModule, held_out: list[tuple[torch.Tensor, torch.Tensor]],
             full_lm_head: torch.Tensor) -> dict[str, float]:
    """Held-out top-1: how often the head's argmax (from the target's true features) is the target's argmax."""
    hits = total = 0
    feature_loss = 0.0
    with torch.no_grad():
        for tokens, features in held_out:
            features = features.float()
            g = module(tokens[None, 1:], features[None, :-1])[0]  # [n-1, D]
            drafted = module.draft_vocab[module.logits(g).argmax(-1)]
            wanted = (features[1:] @ full_lm_head.T).argmax(-1)
            hits += int((drafted == wanted).sum())
            total += len(wanted)
            feature_loss += float(F.smooth_l1_loss(g, features[1:], reduction="sum")) / g.shape[-1]
    return {"top1": hits / max(total, 1), "feature_loss": feature_loss / max(total, 1)}


def _losses(module: EagleHeadModule, tokens: torch.Tensor, features: torch.Tensor,
            noise: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One sequence's mean feature and token losses over its n-1 pairs, and n-1."""
    inputs = features[:-1] + (torch.rand_like(features[:-1]) * 2 - 1) * noise
    g = module(tokens[None, 1:], inputs[None])[0]  # [n-1, D]
    wanted = features[1:]
    with torch.no_grad():
        target_probs = torch.softmax(module.logits(wanted), dim=-1)
    loss_token = -(target_probs * torch.log_softmax(module.logits(g), dim=-1)).sum(-1).mean()
    return F.smooth_l1_loss(g, wanted), loss_token, len(wanted)


def _lr_factor(step: int, total: int, warmup: int = 50) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class _Running:
    def __init__(self):
        self.feature = self.token = 0.0
        self.count = 0

    def add(self, feature: float, token: float, n: int) -> None:
        self.feature += feature * n
        self.token += token * n
        self.count += n

    def means(self) -> tuple[float, float]:
        return self.feature / max(self.count, 1), self.token / max(self.count, 1)
