"""ModelRunner logits must match transformers' LlamaForCausalLM run on the whole sequence."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import EngineConfig
from engine.kv_cache import OutOfBlocks
from engine.runner import ModelRunner, SequenceInput

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(params=["fresh", "fragmented"])
def runner(request, tiny_model_dir):
    # Small blocks so every test crosses block boundaries.
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=512, block_size=4)
    if request.param == "fragmented":
        fragment(runner.allocator)
    return runner


def fragment(alloc) -> None:
    """Leave only every other block free, so every block table skips around the pool."""
    fillers = [f"filler{i}" for i in range(alloc.num_blocks)]
    for filler in fillers:
        alloc.reserve(filler, 1)
    for filler in fillers:
        if alloc.block_table(filler)[0] % 2 == 0:
            alloc.free(filler)
    assert alloc.num_free_blocks == alloc.num_blocks // 2


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `ids`, no cache: [len(ids), V]."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_metadata(runner):
    assert runner.vocab_size == 49152
    assert runner.max_context_length == 2048
    assert runner.eos_token_ids == [2]


def test_logits_are_meaningfully_large(runner):
    # Guards the comparisons below against passing on near-zero logits.
    logits = runner.forward([SequenceInput("a", tokens(8, 0), 0, 8)])
    assert logits.abs().max() > 1.0


def test_prefill_matches_transformers(runner, hf_model):
    ids = tokens(23, 1)
    logits = runner.forward([SequenceInput("a", ids, 0, len(ids))])
    assert logits.dtype == torch.float32
    assert_close(logits, reference(hf_model, ids))


def test_prefill_returns_only_the_last_num_logits(runner, hf_model):
    ids = tokens(10, 2)
    logits = runner.forward([SequenceInput("a", ids, 0, 3)])
    assert_close(logits, reference(hf_model, ids)[-3:])


def test_incremental_steps_match_transformers(runner, hf_model):
    ids = tokens(40, 3)
    expected = reference(hf_model, ids)
    runner.forward([SequenceInput("a", ids[:9], 0, 1)])
    done = 9
    for step in (1, 1, 5, 1, 8, 3, 1, 11):  # single tokens and multi-token verify steps
        logits = runner.forward([SequenceInput("a", ids[done:done + step], done, step)])
        assert_close(logits, expected[done:done + step])
        done += step


def test_mixed_batch_matches_transformers(runner, hf_model):
    seqs = {"a": tokens(30, 4), "b": tokens(17, 5), "c": tokens(25, 6)}
    expected = {s: reference(hf_model, ids) for s, ids in seqs.items()}
    runner.forward([SequenceInput("a", seqs["a"][:20], 0, 1), SequenceInput("b", seqs["b"][:6], 0, 1)])
    # "a" verifies 4 tokens, "b" decodes 1, "c" is a fresh prefill: three query lengths in one pass.
    batch = [SequenceInput("a", seqs["a"][20:24], 20, 4), SequenceInput("b", seqs["b"][6:7], 6, 1),
             SequenceInput("c", seqs["c"][:25], 0, 2)]
    logits = runner.forward(batch)
    assert_close(logits, torch.cat([expected["a"][20:24], expected["b"][6:7], expected["c"][23:25]]))


def test_lockstep_sequences_match_transformers(runner, hf_model):
    # Equal prompts, then equal steps: every pass is one call with no padding.
    seqs = {s: tokens(15, 20 + i) for i, s in enumerate("abc")}
    expected = torch.stack([reference(hf_model, ids) for ids in seqs.values()])  # [3, 15, V]
    done = 0
    for step in (10, 1, 3, 1):
        logits = runner.forward([SequenceInput(s, ids[done:done + step], done, step) for s, ids in seqs.items()])
        assert_close(logits, expected[:, done:done + step].flatten(0, 1))
        done += step


def test_long_prefill_between_short_steps(runner, hf_model):
    # "a" and "b" share one padded attention call across the batch; the 80-token prefill runs alone.
    seqs = {"a": tokens(12, 12), "b": tokens(20, 13), "c": tokens(80, 14)}
    expected = {s: reference(hf_model, ids) for s, ids in seqs.items()}
    runner.forward([SequenceInput("a", seqs["a"][:11], 0, 1), SequenceInput("b", seqs["b"][:17], 0, 1)])
    batch = [SequenceInput("a", seqs["a"][11:], 11, 1), SequenceInput("c", seqs["c"], 0, 80),
             SequenceInput("b", seqs["b"][17:], 17, 3)]
    logits = runner.forward(batch)
    assert_close(logits, torch.cat([expected["a"][11:], expected["c"], expected["b"][17:]]))


@pytest.mark.parametrize("num_new", [1, 3])
def test_equal_query_lengths_at_different_contexts(runner, hf_model, num_new):
    # Same number of new tokens per sequence: the padded one-call path, with ragged contexts.
    lengths = {"a": 5, "b": 14, "c": 9}
    seqs = {s: tokens(n + num_new, 10 + i) for i, (s, n) in enumerate(lengths.items())}
    runner.forward([SequenceInput(s, seqs[s][:n], 0, 1) for s, n in lengths.items()])
    logits = runner.forward([SequenceInput(s, seqs[s][n:], n, num_new) for s, n in lengths.items()])
    expected = torch.cat([reference(hf_model, seqs[s])[n:] for s, n in lengths.items()])
    assert_close(logits, expected)


def test_rollback_then_different_tokens(runner, hf_model):
    prompt, rejected, accepted = tokens(10, 7), tokens(6, 8), tokens(4, 9)
    runner.forward([SequenceInput("a", prompt, 0, 1)])
    runner.forward([SequenceInput("a", rejected, 10, 6)])
    # Keep one of the six drafts, then run other tokens over the rolled-back positions.
    runner.allocator.truncate("a", 11)
    assert runner.allocator.capacity("a") < 16
    ids = prompt + rejected[:1] + accepted
    logits = runner.forward([SequenceInput("a", accepted, 11, 4)])
    assert_close(logits, reference(hf_model, ids)[11:])


def test_out_of_blocks_touches_nothing(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=16, block_size=4)
    runner.forward([SequenceInput("a", tokens(6, 0), 0, 1)])
    free, table = runner.allocator.num_free_blocks, runner.allocator.block_table("a")
    with pytest.raises(OutOfBlocks):
        # "a" would fit on its own; together they do not.
        runner.forward([SequenceInput("a", tokens(2, 1), 6, 1), SequenceInput("b", tokens(9, 2), 0, 1)])
    assert runner.allocator.num_free_blocks == free
    assert runner.allocator.block_table("a") == table
    assert not runner.allocator.has("b")


@pytest.mark.parametrize("bad", [
    [SequenceInput("a", [], 0, 0)],
    [SequenceInput("a", [1, 2], 0, 3)],
    [SequenceInput("a", [1], 0, 1), SequenceInput("a", [2], 1, 1)],
    [SequenceInput("a", [1, 2], 2047, 1)],
    [SequenceInput("a", [1, 2], 0, 1, positions=[0])],
    [SequenceInput("a", [1, 2], 0, 1, positions=[0, 2048])],
    [SequenceInput("a", [1, 2], 0, 1, positions=[-1, 0])],
    [SequenceInput("a", [1, 2], 0, 1, parents=[-1])],
])
def test_rejects_bad_batches(runner, bad):
    with pytest.raises(ValueError):
        runner.forward(bad)


def test_a_chain_needs_no_positions_or_parents():
    chain = SequenceInput("a", [7, 8, 9], 5, 1)
    assert chain.positions == [5, 6, 7] and chain.parents is None


def test_explicit_chain_positions_and_parents_change_nothing(tiny_model_dir):
    prompt, new = tokens(10, 15), tokens(4, 16)
    # One runner for both: in fp32 each runner measures its own matmul plan, which may differ.
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=64, block_size=4)
    logits = []
    for seq_id, explicit in (("a", {}), ("b", {"positions": [10, 11, 12, 13], "parents": [-1, 0, 1, 2]})):
        runner.forward([SequenceInput(seq_id, prompt, 0, 1)])
        logits.append(runner.forward([SequenceInput(seq_id, new, 10, 4, **explicit)]))
    assert torch.equal(*logits)


def test_each_node_of_a_token_tree_gets_the_logits_of_its_path(runner, hf_model):
    prompt, (a, b, c, d) = tokens(10, 17), tokens(4, 18)
    runner.forward([SequenceInput("a", prompt, 0, 1)])
    # a, then b and c both after a, then d after c: paths a, a-b, a-c, a-c-d; positions are depths.
    tree = SequenceInput("a", [a, b, c, d], 10, 4, positions=[10, 11, 11, 12], parents=[-1, 0, 0, 2])
    logits = runner.forward([tree])
    for node, path in enumerate([[a], [a, b], [a, c], [a, c, d]]):
        assert_close(logits[node], reference(hf_model, prompt + path)[-1])


def test_bf16_engine_is_bf16_and_close_to_fp32(tiny_model_dir):
    ids = tokens(40, 19)
    runners = {dtype: ModelRunner(tiny_model_dir, kv_cache_tokens=64, block_size=4, engine=EngineConfig(dtype=dtype))
               for dtype in (torch.float32, torch.bfloat16)}
    logits = {}
    for dtype, runner in runners.items():
        prefill = runner.forward([SequenceInput("a", ids[:30], 0, 30)])
        decode = [runner.forward([SequenceInput("a", ids[i:i + 1], i, 1)]) for i in range(30, 40)]
        logits[dtype] = torch.cat([prefill, *decode])  # [40, V]
    fp32, bf16 = logits[torch.float32], logits[torch.bfloat16]

    bf16_runner = runners[torch.bfloat16]
    weights = [bf16_runner.model.embed, bf16_runner.model.lm_head, bf16_runner.model.norm,
               *(w for layer in bf16_runner.model.layers for w in vars(layer).values())]
    assert all(w.dtype == torch.bfloat16 for w in weights)
    assert all(kv.dtype == torch.bfloat16 for kv in bf16_runner.cache.keys + bf16_runner.cache.values)
    assert bf16.dtype == torch.float32  # the verifier's dtype, whatever the engine computes in
    torch.testing.assert_close(bf16, fp32, atol=0.25, rtol=0)  # logits reach ~4; bf16 keeps 8 bits
    assert (bf16.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.9


def test_llama3_rope_matches_transformers(make_tiny_model):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = make_tiny_model(num_hidden_layers=1, rope_parameters=rope)
    runner = ModelRunner(model_dir, kv_cache_tokens=256, block_size=8)
    ids = tokens(90, 11)
    runner.forward([SequenceInput("a", ids[:80], 0, 1)])
    logits = runner.forward([SequenceInput("a", ids[80:], 80, 10)])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_close(logits, reference(hf, ids)[80:])


@pytest.mark.e2e
def test_greedy_generation_matches_transformers_on_the_default_model():
    from specd.model_store import resolve_model

    model_dir = resolve_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()

    runner = ModelRunner(model_dir, kv_cache_tokens=1024)
    generated, new = [], ids[0].tolist()
    while len(generated) < 20 and not (generated and generated[-1] in runner.eos_token_ids):
        start = ids.shape[1] + len(generated) - len(new)
        generated.append(int(runner.forward([SequenceInput("s", new, start, 1)]).argmax(-1)))
        new = generated[-1:]
    assert len(expected) > 5
    assert generated == expected


def test_in_bf16_a_token_gets_the_same_logits_alone_or_verified_among_drafts_beside_others(tiny_model_dir):
    """Batch invariance: what makes greedy speculation in bf16 token-for-token the output without it."""
    prompt, other, drafts = tokens(37, 20), tokens(90, 21), tokens(6, 22)
    bf16 = EngineConfig(dtype=torch.bfloat16)
    alone = ModelRunner(tiny_model_dir, kv_cache_tokens=512, block_size=4, engine=bf16)
    alone.forward([SequenceInput("s", prompt, 0, 1)])
    decoded = [alone.forward([SequenceInput("s", [t], 37 + i, 1)])[0] for i, t in enumerate(drafts)]
    crowded = ModelRunner(tiny_model_dir, kv_cache_tokens=512, block_size=4, engine=bf16)
    fragment(crowded.allocator)
    crowded.forward([SequenceInput("s", prompt, 0, 1), SequenceInput("o", other, 0, 1)])  # prefilled beside another
    verified = crowded.forward([SequenceInput("o", tokens(3, 23), 90, 3), SequenceInput("s", drafts, 37, 6)])[3:]
    assert all(torch.equal(d, v) for d, v in zip(decoded, verified, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [4, 16])
def test_each_tree_node_gets_the_bits_its_path_gets_as_a_chain(tiny_model_dir, block_size, dtype):
    """What greedy tree verification needs: a node's logits are those its path gets once accepted, moved into
    place and decoded on, however many branches share the tree (past 64 cached tokens the branches read the
    prefix's chunks together, and the sub-chunks of the chunk holding the new tokens that lie before them)."""
    prompt, (a, b, c, d, e) = tokens(150, 26), tokens(5, 27)
    engine = EngineConfig(dtype=dtype)

    def prefilled() -> ModelRunner:
        runner = ModelRunner(tiny_model_dir, kv_cache_tokens=512, block_size=block_size, engine=engine)
        runner.forward([SequenceInput("s", prompt, 0, 1)])
        return runner

    # a; b and c after a; d after c; e after b: paths a, a-b, a-c, a-c-d, a-b-e.
    tree = SequenceInput("s", [a, b, c, d, e], 150, 5, positions=[150, 151, 151, 152, 152], parents=[-1, 0, 0, 2, 1])
    runner = prefilled()
    if not runner.batch_invariant:  # fp32 without AVX512F: a matmul row's bits depend on the call's row count
        pytest.skip("the runner's logits are not batch invariant on this CPU")
    logits = runner.forward([tree])
    for node, path in enumerate([[a], [a, b], [a, c], [a, c, d], [a, b, e]]):
        chain = prefilled().forward([SequenceInput("s", path, 150, len(path))])
        assert torch.equal(logits[node], chain[-1])


def test_in_bf16_a_prompt_prefilled_in_pieces_gets_the_logits_it_gets_in_one_forward(tiny_model_dir):
    """What chunked prefill needs: a prompt's bits do not depend on how its tokens are split across forwards."""
    prompt = tokens(50, 24)
    bf16 = EngineConfig(dtype=torch.bfloat16)
    whole = ModelRunner(tiny_model_dir, kv_cache_tokens=256, block_size=4, engine=bf16)
    expected = whole.forward([SequenceInput("s", prompt, 0, 50)])
    pieces = ModelRunner(tiny_model_dir, kv_cache_tokens=256, block_size=4, engine=bf16)
    first = pieces.forward([SequenceInput("s", prompt[:17], 0, 17)])
    rest = pieces.forward([SequenceInput("s", prompt[17:], 17, 33), SequenceInput("o", tokens(9, 25), 0, 1)])[:33]
    got = torch.cat([first, rest])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_forward_of_prompt_chunks_with_more_to_come_returns_no_logits(tiny_model_dir, dtype):
    """A long prompt arriving while nothing decodes: its first pieces want no logits."""
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=256, block_size=4, engine=EngineConfig(dtype=dtype))
    logits = runner.forward([SequenceInput("s", tokens(40, 26), 0, 0)])
    assert logits.shape == (0, runner.vocab_size)


def test_the_runner_says_whether_its_logits_are_batch_invariant(tiny_model_dir, monkeypatch):
    bf16 = ModelRunner(tiny_model_dir, kv_cache_tokens=64, block_size=4, engine=EngineConfig(dtype=torch.bfloat16))
    assert bf16.batch_invariant  # the packed bf16 matmul (or oneDNN's) keeps rows independent, the kernel too
    monkeypatch.setenv("SPECD_KERNELS", "torch")  # the reference attention promises nothing
    assert not bf16.batch_invariant


def test_an_early_exit_runs_the_first_layers_then_the_final_norm_and_lm_head(tiny_model_dir):
    """num_layers=1 is the model transformers loads with one layer from the same files (LayerSkip's draft)."""
    early = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, num_hidden_layers=1).eval()
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=64, block_size=4, num_layers=1)
    ids = tokens(9, seed=5)
    logits = runner.forward([SequenceInput("s", ids, start_position=0, num_logits=len(ids))])
    assert_close(logits, reference(early, ids))
    with pytest.raises(ValueError, match="num_layers"):
        ModelRunner(tiny_model_dir, kv_cache_tokens=64, num_layers=3)


def test_the_features_are_the_final_normed_hidden_states_transformers_gives(runner, hf_model):
    ids = tokens(7, seed=6)
    logits, features = runner.forward_with_features([SequenceInput("s", ids, 0, num_logits=1)], [0, 3, 6])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]  # after the norm
    assert_close(features, expected[[0, 3, 6]])
    assert_close(logits, reference(hf_model, ids)[-1:])


def test_the_features_of_named_layers_are_the_residual_stream_entering_them_as_transformers_has_it(tiny_model_dir):
    """EAGLE-3's features: the hidden states entering layers 0 and 1, concatenated in the order asked, are
    transformers' hidden_states[1] and [0] of the same tokens."""
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=64)
    tokens = [5, 900, 42, 7, 3000, 11]
    _, features = runner.forward_with_features([SequenceInput("s", tokens, 0, 1)], [1, 4, 5], feature_layers=(1, 0))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[1][0, [1, 4, 5]], states[0][0, [1, 4, 5]]], dim=-1)
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)


def test_features_of_a_layer_the_model_lacks_are_refused(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=64)
    with pytest.raises(ValueError, match="layers are 0..1"):
        runner.forward_with_features([SequenceInput("s", [5, 6], 0, 1)], [0], feature_layers=(2,))
