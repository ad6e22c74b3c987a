"""Every Triton kernel compiles for an NVIDIA GPU (sm_90), checked without one.

The interpreter runs kernels as NumPy and so misses what only the compiler
rejects (types that differ between loop iterations or branches, say).
"""
import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.triton_impl import attention, chain, kv, tree  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # fusion changes no result here

I64, F32 = "*i64", "*fp32"
CHAIN_ACCEPT = {"draft_ptr": I64, "cu_ptr": I64, "target_probs_ptr": F32, "draft_probs_ptr": F32,
                "uniform_ptr": F32, "num_accepted_ptr": I64, "vocab": "i32"}
SAMPLE = {"draft_ptr": I64, "cu_ptr": I64, "target_probs_ptr": F32, "draft_probs_ptr": F32,
          "num_accepted_ptr": I64, "uniform_ptr": F32, "next_token_ptr": I64, "vocab": "i32"}
TREE_SAMPLE = {"draft_ptr": I64, "parent_ptr": I64, "cu_ptr": I64, "probs_ptr": F32, "uniform_ptr": F32,
               "uniform_final_ptr": F32, "num_accepted_ptr": I64, "accepted_nodes_ptr": I64, "next_token_ptr": I64,
               "vocab": "i32"}
BF16 = "*bf16"
PAGED = {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "out_ptr": BF16, "tables_ptr": I64, "query_start_ptr": I64,
         "context_start_ptr": I64, "tree_mask_ptr": "*u8", "tree_offsets_ptr": I64, "seq_of_row_ptr": I64,
         "q_stride": "i32", "table_width": "i32", "block_size": "i32", "scale": "fp32", "group": "i32",
         "num_kv_heads": "i32", "head_dim": "i32"}
MOVE = {"pool_ptrs": I64, "slots_ptr": I64, "staged_ptr": F32, "num_moves": "i32", "width": "i32"}
KERNELS = {
    "greedy_accept": (chain._greedy_accept_kernel, {
        "draft_ptr": I64, "cu_ptr": I64, "argmax_ptr": I64, "num_accepted_ptr": I64, "next_token_ptr": I64},
        {"BLOCK_K": 16}),
    "chain_accept, q=1": (chain._chain_accept_kernel, CHAIN_ACCEPT, {"HAS_DRAFT_PROBS": False, "BLOCK_K": 16}),
    "chain_accept, draft probs": (chain._chain_accept_kernel, CHAIN_ACCEPT, {"HAS_DRAFT_PROBS": True, "BLOCK_K": 16}),
    "sample_recovered, q=1": (chain._sample_recovered_kernel, SAMPLE,
                              {"PROB_SCALE": 2.0 ** 40, "HAS_DRAFT_PROBS": False, "BLOCK_V": 1024}),
    "sample_recovered, draft probs": (chain._sample_recovered_kernel, SAMPLE,
                                      {"PROB_SCALE": 2.0 ** 40, "HAS_DRAFT_PROBS": True, "BLOCK_V": 1024}),
    "tree_accept": (tree._tree_accept_kernel, {
        "draft_ptr": I64, "parent_ptr": I64, "cu_ptr": I64, "argmax_ptr": I64, "num_accepted_ptr": I64,
        "accepted_nodes_ptr": I64, "next_token_ptr": I64}, {"BLOCK_N": 16}),
    "tree_accept, int32 parent ids": (tree._tree_accept_kernel, {
        "draft_ptr": I64, "parent_ptr": "*i32", "cu_ptr": I64, "argmax_ptr": I64, "num_accepted_ptr": I64,
        "accepted_nodes_ptr": I64, "next_token_ptr": I64}, {"BLOCK_N": 16}),
    "tree_sample": (tree._tree_sample_kernel, TREE_SAMPLE, {"PROB_SCALE": 2.0 ** 40, "BLOCK_N": 16, "BLOCK_V": 1024}),
    "tree_sample, int32 parent ids": (tree._tree_sample_kernel, {**TREE_SAMPLE, "parent_ptr": "*i32"},
                                      {"PROB_SCALE": 2.0 ** 40, "BLOCK_N": 16, "BLOCK_V": 1024}),
    "tree_attention": (tree._tree_attention_kernel, {
        "parent_ptr": I64, "cu_ptr": I64, "start_pos_ptr": I64, "mask_offsets_ptr": I64, "positions_ptr": I64,
        "mask_ptr": "*i1"}, {"BLOCK_ROWS": 16, "BLOCK_ENTRIES": 256}),
    "tree_attention, int32 parent ids": (tree._tree_attention_kernel, {
        "parent_ptr": "*i32", "cu_ptr": I64, "start_pos_ptr": I64, "mask_offsets_ptr": I64, "positions_ptr": I64,
        "mask_ptr": "*i1"}, {"BLOCK_ROWS": 16, "BLOCK_ENTRIES": 256}),
    "paged_attention, chains": (attention._paged_attention_kernel, PAGED,
                                {"GROUP": 4, "BLOCK_D": 64, "BLOCK_N": 64, "HAS_TREE": False}),
    "paged_attention, trees": (attention._paged_attention_kernel, PAGED,
                               {"GROUP": 4, "BLOCK_D": 64, "BLOCK_N": 64, "HAS_TREE": True}),
    "move_entries, to staging": (kv._move_entries_kernel, MOVE, {"TO_POOLS": False, "BLOCK_M": 16, "BLOCK_W": 256}),
    "move_entries, to pools": (kv._move_entries_kernel, MOVE, {"TO_POOLS": True, "BLOCK_M": 16, "BLOCK_W": 256}),
    # Triton makes an integer argument equal to 1 a constant: one move is common.
    "move_entries, one move": (kv._move_entries_kernel, {**MOVE, "num_moves": "constexpr"},
                               {"num_moves": 1, "TO_POOLS": True, "BLOCK_M": 16, "BLOCK_W": 256}),
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_for_sm90(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel, signature, constants = KERNELS[name]
    signature = {**signature, **{key: "constexpr" for key in constants}}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32))
    assert ".entry" in compiled.asm["ptx"]
