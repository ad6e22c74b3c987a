"""Random verification and attention batches, for the kernel tests and the kernel benchmark."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.dispatch import packs_caches
from kernels.layout import ancestor_mask, pack_keys, pack_values, target_row_offsets


@dataclass
class DraftBatch:
    """Every input of every verification kernel, for one random batch."""
    draft_token_ids: torch.Tensor  # [N]
    parent_ids: torch.Tensor  # [N] local parent index, -1 = the root; chains: i - 1
    cu_draft_lens: torch.Tensor  # [B+1]
    target_probs: torch.Tensor  # [N+B, V]
    target_argmax: torch.Tensor  # [N+B]
    draft_probs: torch.Tensor  # [N, V]
    uniform_accept: torch.Tensor  # [N]
    uniform_final: torch.Tensor  # [B]
    num_accepted: torch.Tensor  # [B] any count in 0..draft length, for sample_recovered alone
    start_positions: torch.Tensor  # [B]

    @property
    def num_seqs(self) -> int:
        return self.cu_draft_lens.numel() - 1


def random_batch(draft_lens: list[int], vocab: int, *, tree: bool = False, seed: int = 0,
                 match_rate: float = 0.7, device: str | torch.device = "cpu") -> DraftBatch:
    """Drafts of the given lengths; each draft token is the target's argmax at its parent's row
    with probability match_rate, so that acceptance paths of every length occur."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(draft_lens, dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    num_drafts, num_seqs = int(cu[-1]), len(draft_lens)
    parents = _cat([_random_parents(n, tree, gen) for n in draft_lens])
    target_probs = torch.softmax(torch.randn(num_drafts + num_seqs, vocab, generator=gen) * 3, dim=-1)
    target_argmax = target_probs.argmax(dim=-1)
    parent_rows = torch.repeat_interleave(target_row_offsets(cu)[:-1], lens) + 1 + parents  # [N]
    matches = torch.rand(num_drafts, generator=gen) < match_rate
    drafts = torch.where(matches, target_argmax[parent_rows], torch.randint(0, vocab, (num_drafts,), generator=gen))
    batch = DraftBatch(
        draft_token_ids=drafts, parent_ids=parents, cu_draft_lens=cu, target_probs=target_probs,
        target_argmax=target_argmax,
        draft_probs=torch.softmax(torch.randn(num_drafts, vocab, generator=gen), dim=-1),
        uniform_accept=torch.rand(num_drafts, generator=gen), uniform_final=torch.rand(num_seqs, generator=gen),
        num_accepted=(torch.rand(num_seqs, generator=gen) * (lens + 1)).long(),
        start_positions=torch.randint(0, 1000, (num_seqs,), generator=gen))
    return DraftBatch(**{name: value.to(device) for name, value in vars(batch).items()})


def random_kv_moves(draft_lens: list[int], num_pools: int, kv_heads: int, head_dim: int, *, seed: int = 0,
                    device: str | torch.device = "cpu") -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Pools holding one tree per sequence after its root, and the moves that compact a random
    accepted path of each tree down to the slots right after the root: (pools, src_slots, dst_slots)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(n + 1 for n in draft_lens)
    pools = [torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(device) for _ in range(num_pools)]
    src, dst, root = [], [], 0
    for n in draft_lens:
        path_len = int(torch.randint(0, n + 1, (1,), generator=gen))
        path = torch.randperm(n, generator=gen)[:path_len].sort().values  # path nodes come in index order
        src.append(root + 1 + path)
        dst.append(root + 1 + torch.arange(path_len))
        root += n + 1
    return pools, _cat(src).to(device), _cat(dst).to(device)


def _random_parents(num_nodes: int, tree: bool, gen: torch.Generator) -> torch.Tensor:
    """[num_nodes] each node's parent: any earlier node or the root (-1) for trees, the previous one for chains."""
    index = torch.arange(num_nodes)
    if not tree:
        return index - 1
    return (torch.rand(num_nodes, generator=gen) * (index + 1)).long() - 1


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@dataclass
class AttentionBatch:
    """Every input of `paged_attention`, for one random batch over a shuffled paged cache."""
    query: torch.Tensor  # [T, H, Dh]
    key_cache: torch.Tensor  # packed (kernels.layout) or [slots, KV, Dh]
    value_cache: torch.Tensor  # likewise
    block_tables: torch.Tensor  # [B, W]
    query_start: torch.Tensor  # [B+1]
    context_start: torch.Tensor  # [B]
    tree_mask: torch.Tensor | None
    tree_offsets: torch.Tensor  # [B]
    block_size: int
    scale: float

    def args(self) -> tuple:
        return tuple(vars(self).values())


def random_attention_batch(num_new: list[int], cached: list[int], *, trees: frozenset[int] = frozenset(),
                           heads: int = 9, kv_heads: int = 3, head_dim: int = 64, block_size: int = 16,
                           dtype: torch.dtype = torch.float32, seed: int = 0, device: str | torch.device = "cpu",
                           packed: bool | None = None) -> AttentionBatch:
    """Sequence b brings num_new[b] queries after cached[b] cached tokens; the sequences in `trees`
    get random token trees, the others are chains. Blocks are spread over the cache at random. The caches
    are packed where the device's kernel reads them so (packs_caches), unless `packed` says otherwise."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-(c + n) // block_size) for c, n in zip(cached, num_new))
    num_blocks = len(num_new) * width + 1
    tables = torch.randperm(num_blocks, generator=gen)[:len(num_new) * width].view(len(num_new), width)
    masks, offsets = [], []
    for b, n in enumerate(num_new):
        offsets.append(sum(m.numel() for m in masks) if b in trees else -1)
        if b in trees:
            masks.append(ancestor_mask([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]).flatten())

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    keys, values = (randn(num_blocks * block_size, kv_heads, head_dim) for _ in range(2))
    if packed if packed is not None else packs_caches(torch.device(device)):
        keys, values = pack_keys(keys, block_size), pack_values(values, block_size)
    return AttentionBatch(
        query=randn(sum(num_new), heads, head_dim), key_cache=keys, value_cache=values,
        block_tables=tables.to(device),
        query_start=torch.tensor([0, *num_new], device=device).cumsum(0),
        context_start=torch.tensor(cached, dtype=torch.int64, device=device),
        tree_mask=torch.cat(masks).to(device) if masks else None,
        tree_offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        block_size=block_size, scale=head_dim ** -0.5)
