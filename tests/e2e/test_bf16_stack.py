"""End to end in bf16: greedy speculation (n-gram chains; suffix, trie, lookahead and fused trees; draft-model
chains, EAGLE trees) is token for token the output without it, while the other requests share the batch (the
engine's logits are batch invariant)."""
import asyncio

import pytest

from specd.client import SpecdClient, build_request
from specd.types import SamplingParams
from specd.v1 import common_pb2

pytestmark = pytest.mark.e2e

# Prompts written for this test; the first two repeat themselves, so n-gram drafts get accepted.
PROMPTS = [
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "List the days of the week twice, separated by commas.",
    "Explain in two sentences why the sky looks blue.",
]
MAX_TOKENS = 48


async def _complete(client: SpecdClient, prompt: str, method: str, max_tokens: int = MAX_TOKENS):
    request = build_request(messages=[{"role": "user", "content": prompt}],
                            sampling=SamplingParams(max_tokens=max_tokens),
                            speculative=common_pb2.SpeculativeConfig(method=method))
    return await client.complete(request, timeout=300)


async def _tokens(client: SpecdClient, prompt: str, method: str) -> list[int]:
    _, token_ids, _ = await _complete(client, prompt, method)
    return token_ids


@pytest.mark.timeout(1800)  # it may start the bf16 stacks (conftest.BF16_START_TIMEOUT_S)
async def test_bf16_greedy_speculation_in_a_crowd_equals_none_alone(bf16_stack):
    methods = ("ngram", "suffix", "trie", "lookahead", "fused", "draft_model", "eagle", "auto", "none")
    async with SpecdClient(bf16_stack.address("gateway")) as client:
        alone = [await _tokens(client, prompt, "none") for prompt in PROMPTS]
        crowded = await asyncio.gather(*(_tokens(client, prompt, method) for prompt in PROMPTS for method in methods))
    for i, method in enumerate(methods):  # each beside eight other requests
        assert crowded[i::len(methods)] == alone, method


@pytest.mark.timeout(1800)  # it may start the bf16 stacks (conftest.BF16_START_TIMEOUT_S)
async def test_the_shipped_eagle_heads_drafts_reach_the_target_through_the_stack(bf16_stack):
    """The target's features reach the eagle drafter and its drafts come back to be verified. How many the
    target accepts is the head's quality, measured without the drafting gate in
    tests/drafter_svc/models/test_heads.py: here the gate verifies only the few drafts it expects to pay."""
    async with SpecdClient(bf16_stack.address("gateway")) as client:
        finals = [(await _complete(client, prompt, "eagle", max_tokens=128))[2] for prompt in PROMPTS]
    drafted = sum(final.usage.draft_tokens for final in finals)
    print(f"eagle: {sum(final.usage.accepted_draft_tokens for final in finals)} of {drafted} draft tokens accepted")
    assert drafted > 0
