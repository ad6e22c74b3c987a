"""The target model runner: one forward pass over a batch of sequences on the paged KV cache."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from engine.attention import PagedAttention, SeqSpan
from engine.config import EngineConfig
from engine.kv_cache import BlockAllocator, KVCache, OutOfBlocks, kv_bytes_per_token
from engine.llama import LayerInputs, LlamaModel


@dataclass
class SequenceInput:
    """One sequence's new tokens in a forward pass; the defaults describe a chain."""
    seq_id: str
    token_ids: list[int]  # new tokens: the prompt for a prefill, last token + drafts for a verify step
    start_position: int  # tokens of this sequence already in the KV cache; the new tokens' K/V follow them
    num_logits: int  # logits wanted for the LAST num_logits of token_ids
    positions: list[int] | None = None  # RoPE position of each new token; None: start_position + i
    # Attention structure: parents[i] is the index in token_ids of the token new token i follows
    # (-1: the cached prefix). None: a chain, each token following the one before it.
    parents: list[int] | None = None
    # The indices in token_ids whose logits are wanted, where they are not the last ones (a verify step
    # whose lookahead window wants only its top level's); None: the last num_logits.
    logit_rows: list[int] | None = None

    def __post_init__(self):
        if self.positions is None:
            self.positions = list(range(self.start_position, self.start_position + len(self.token_ids)))
        if self.logit_rows is None:
            self.logit_rows = list(range(len(self.token_ids) - self.num_logits, len(self.token_ids)))


class ModelRunner:
    def __init__(self, model_dir: str | Path, kv_cache_tokens: int = 16384, block_size: int = 16,
                 num_threads: int | None = None, engine: EngineConfig = EngineConfig(),
                 kv_cache_memory_gib: float | None = None, num_layers: int | None = None):
        """The KV cache holds kv_cache_tokens, or as many tokens as kv_cache_memory_gib holds. num_layers:
        run only the model's first layers (see LlamaModel.from_pretrained)."""
        self._serve(lambda: LlamaModel.from_pretrained(model_dir, engine, num_layers), engine, num_threads,
                    kv_cache_tokens, block_size, kv_cache_memory_gib)
        self.eos_token_ids: list[int] = _eos_token_ids(Path(model_dir), self.config)

    def _serve(self, load: Callable[[], LlamaModel], engine: EngineConfig, num_threads: int | None,
               kv_cache_tokens: int, block_size: int, kv_cache_memory_gib: float | None = None) -> None:
        """Threads and kernels set up for the device, then the model `load` gives and its KV cache."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.device = torch.device(engine.device)
        kernels.prepare(self.device)
        self.model = load()
        self.config = self.model.config
        self.vocab_size: int = self.config.vocab_size
        self.max_context_length: int = self.config.max_position_embeddings
        self.eos_token_ids: list[int] = []
        if kv_cache_memory_gib is not None:
            bytes_per_token = kv_bytes_per_token(self.config.num_hidden_layers, self.model.num_kv_heads,
                                                 self.model.head_dim, engine.dtype)
            kv_cache_tokens = int(kv_cache_memory_gib * 2 ** 30 // bytes_per_token)
        num_blocks = -(-kv_cache_tokens // block_size)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.cache = KVCache(self.config.num_hidden_layers, self.model.num_kv_heads, self.model.head_dim,
                             num_blocks, block_size, engine)

    @property
    def attention_backend(self) -> str:
        """The paged-attention kernel this runner's forwards use: "cpu" (C++), "triton" or "reference"."""
        return kernels.attention_backend(self.device)

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's logits are the same bits whatever else is in its step (so greedy
        speculation is exactly the output without it): row-independent matmuls, checked at load,
        and a paged-attention kernel that computes each query on its own (not the reference)."""
        return self.model.matmul_rows_independent and self.attention_backend != "reference"

    def forward(self, batch: list[SequenceInput]) -> torch.Tensor:
        """ONE forward pass over every sequence's new tokens (flattened, no padding).

        Reserves KV capacity for start_position+len(token_ids) per sequence (raises
        OutOfBlocks before touching anything if it cannot), writes the new K/V into
        the cache and returns fp32 logits [sum(len(logit_rows)), vocab] in batch order,
        whatever the engine's dtype.
        Committed lengths are the caller's: it calls allocator.truncate to roll back.
        """
        return self.forward_with_features(batch, [])[0]

    def forward_with_features(self, batch: list[SequenceInput], feature_rows: list[int],
                              feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the features an EAGLE head drafts from, of the new tokens at the flattened rows
        `feature_rows`, in the engine's dtype: the final-normed hidden states [len(feature_rows), D], or with
        `feature_layers` the residual stream entering each of those layers, concatenated [.., len * D] (EAGLE-3)."""
        if not self.has_layers(feature_layers):
            raise ValueError(f"feature_layers {feature_layers}: the model's layers are "
                             f"0..{self.config.num_hidden_layers - 1}")
        attention, input_ids, positions, logit_rows = self._plan(batch)
        with torch.inference_mode():
            rows = torch.tensor(feature_rows, dtype=torch.int64, device=self.device)
            layer_inputs = LayerInputs(feature_layers, rows) if feature_layers else None
            h = self.model.final_hidden(self.model.embedding(input_ids), positions, attention, layer_inputs)  # [T, D]
            if layer_inputs is not None:
                features = layer_inputs.concatenated()
            else:
                features = self.model.normed(h[rows]) if feature_rows else h[rows]
            return self.model.logits(h, logit_rows), features

    def has_layers(self, layers: tuple[int, ...]) -> bool:
        """Whether the model has every one of these layers (features can be taken at their inputs)."""
        return all(0 <= layer < self.config.num_hidden_layers for layer in layers)

    def _plan(self, batch: list[SequenceInput]) -> tuple[PagedAttention, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Checks the batch, reserves its KV capacity, and lays it out: the attention plan, then token ids,
        positions [T] and logit rows [R]."""
        self._validate(batch)
        self._reserve_all(batch)
        spans = [SeqSpan(s.start_position, len(s.token_ids), self.allocator.block_table(s.seq_id), s.parents)
                 for s in batch]
        write_slots = torch.cat([self.allocator.slots(s.seq_id, s.start_position, _end(s)) for s in batch])  # [T]
        return PagedAttention(spans, write_slots, self.cache), *self._flatten(batch)

    def keep_path(self, seq_id: str, first: int, path: Sequence[int]) -> None:
        """A verified draft tree's accepted nodes `path` (by their index among the draft's nodes, whose
        K/V the forward wrote from position `first` on) take positions first, first + 1, ... in the
        cache: one `compact_kv` over every layer, only for the nodes not already in place (none for a
        chain). The caller truncates past the path."""
        moves = [(node, depth) for depth, node in enumerate(path) if node != depth]  # from, to past `first`
        if not moves:
            return
        slots = self.allocator.slots(seq_id, first, first + max(node for node, _ in moves) + 1)
        src, dst = (slots[torch.tensor(offsets)].to(self.device) for offsets in zip(*moves))
        kernels.compact_kv([*self.cache.keys, *self.cache.values], src, dst)

    def _validate(self, batch: list[SequenceInput]) -> None:
        if not batch:
            raise ValueError("empty batch")
        if len({s.seq_id for s in batch}) != len(batch):
            raise ValueError("a sequence appears twice in one batch")
        for s in batch:
            if not s.token_ids or not 0 <= s.num_logits <= len(s.token_ids) or s.start_position < 0 \
                    or not all(0 <= row < len(s.token_ids) for row in s.logit_rows):
                raise ValueError(f"bad input for {s.seq_id!r}: {len(s.token_ids)} tokens, num_logits={s.num_logits}, "
                                 f"logit_rows={s.logit_rows}, start_position={s.start_position}")
            if len(s.positions) != len(s.token_ids) or s.parents is not None and len(s.parents) != len(s.token_ids):
                raise ValueError(f"{s.seq_id!r}: positions and parents need one entry per new token")
            if s.start_position + len(s.token_ids) > self.max_context_length or \
                    not 0 <= min(s.positions) <= max(s.positions) < self.max_context_length:
                raise ValueError(f"{s.seq_id!r} would exceed the {self.max_context_length}-token context")

    def _reserve_all(self, batch: list[SequenceInput]) -> None:
        """All or nothing across the batch, so a failure leaves every sequence as it was."""
        needed = sum(self.allocator.blocks_needed(s.seq_id, _end(s)) for s in batch)
        if needed > self.allocator.num_free_blocks:
            raise OutOfBlocks(f"batch needs {needed} blocks, {self.allocator.num_free_blocks} free")
        for s in batch:
            self.allocator.reserve(s.seq_id, _end(s))

    def _flatten(self, batch: list[SequenceInput]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, positions [T] and the rows [sum(len(logit_rows))] whose logits are wanted."""
        ids, positions, rows, first = [], [], [], 0
        for s in batch:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            positions.extend(s.positions)
            rows.extend(first + row for row in s.logit_rows)
            first += n
        return tuple(torch.tensor(v, dtype=torch.int64, device=self.device) for v in (ids, positions, rows))


def _end(s: SequenceInput) -> int:
    return s.start_position + len(s.token_ids)


def _eos_token_ids(model_dir: Path, config) -> list[int]:
    """generation_config.json wins over config.json; either may hold an int or a list."""
    eos = getattr(config, "eos_token_id", None)
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
