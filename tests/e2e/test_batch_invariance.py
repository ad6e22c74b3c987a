"""bf16 and fp32 on the real model: a token's logits do not depend on what else is in the batch.

That is what makes greedy speculation token-for-token the output without it. (On this model the PyTorch reference attention, and SDPA over gathered
blocks before it, change logits by up to ~0.6 between the two ways below.)
"""
import pytest
import torch

from specd.model_store import resolve_model
from engine.config import EngineConfig
from engine.runner import ModelRunner, SequenceInput

pytestmark = pytest.mark.e2e
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def invariant_runner(dtype: torch.dtype) -> ModelRunner:
    """The real model in `dtype`; the test is skipped where the runner found at load that its matmuls or
    attention make a row depend on the others (CPUs whose kernels are not row independent: fp32 without
    AVX512F)."""
    runner = ModelRunner(resolve_model(), kv_cache_tokens=1024, engine=EngineConfig(dtype=dtype))
    if not runner.batch_invariant:
        pytest.skip(f"the engine's {dtype} logits are not batch invariant on this CPU")
    return runner


@DTYPES
def test_logits_are_the_same_decoded_alone_or_verified_among_drafts_beside_others(dtype):
    gen = torch.Generator().manual_seed(0)
    prompt, other, drafts = (torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (37, 300, 6))
    alone = invariant_runner(dtype)
    alone.forward([SequenceInput("s", prompt, 0, 1)])
    decoded = [alone.forward([SequenceInput("s", [t], 37 + i, 1)])[0] for i, t in enumerate(drafts)]
    crowded = invariant_runner(dtype)
    crowded.forward([SequenceInput("o", other, 0, 1)])
    crowded.forward([SequenceInput("s", prompt, 0, 1), SequenceInput("x", other[:50], 0, 1)])
    verified = crowded.forward([SequenceInput("o", [5, 6, 7], 300, 3), SequenceInput("s", drafts, 37, 6)])[3:]
    assert all(torch.equal(d, v) for d, v in zip(decoded, verified, strict=True))


@DTYPES
def test_a_prompt_prefilled_beside_long_ones_gets_the_logits_it_gets_alone(dtype):
    """Over 128 rows a matmul's rows may depend on the count (oneDNN's bf16 down projection did at 150-256
    rows): each prompt's prefill goes through the matmuls on its own."""
    gen = torch.Generator().manual_seed(1)
    prompt, long_one, other = (torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (60, 140, 30))
    runner = invariant_runner(dtype)
    alone = runner.forward([SequenceInput("alone", prompt, 0, 1)])[0]
    together = runner.forward([SequenceInput("long", long_one, 0, 1), SequenceInput("s", prompt, 0, 1),
                               SequenceInput("o", other, 0, 1)])[1]
    assert torch.equal(alone, together)


# (prompt length, decoy nodes before the path): where a kernel that read a tree query's ancestors at
# their slots changed the logits (by up to 0.5) from the path's own as a chain.
TREE_CASES = [(5, 3), (30, 7), (61, 1), (190, 3), (190, 7)]


@DTYPES
def test_a_tree_node_gets_the_bits_its_path_gets_as_a_chain(dtype):
    """Verified in a tree whose path to it is not the first nodes, a node's logits are those of its path
    decoded as a chain: what keeps greedy tree speculation token for token the output without it."""
    tree_runner, chain_runner = invariant_runner(dtype), invariant_runner(dtype)
    for case, (length, decoys) in enumerate(TREE_CASES):
        gen = torch.Generator().manual_seed(case)
        prompt, new = (torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (length, 1 + decoys + 4))
        root, decoy, path = new[0], new[1:1 + decoys], new[1 + decoys:]
        # root ─┬─ a chain of decoys
        #       └─ p0 ── p1 ── p2 ── p3
        parents = [-1, 0, *range(1, decoys), 0, *range(1 + decoys, 4 + decoys)]
        positions = [length, *range(length + 1, length + 1 + decoys), *range(length + 1, length + 5)]
        seq = f"s{case}"
        for runner in (tree_runner, chain_runner):
            runner.forward([SequenceInput(seq, prompt, 0, 1)])
        tree = tree_runner.forward([SequenceInput(seq, [root, *decoy, *path], length, len(new), positions=positions,
                                                  parents=parents)])
        chain = chain_runner.forward([SequenceInput(seq, [root, *path], length, 5)])
        assert torch.equal(tree[[0, *range(1 + decoys, 5 + decoys)]], chain), (length, decoys)
