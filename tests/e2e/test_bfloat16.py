"""The whole system in bf16 (weights, KV cache, activations; logits and verification in fp32): greedy
output with speculation is token for token the output without it, whatever shares the batch."""
import asyncio

import pytest

from specd.client import SpecdClient, build_request, speculative_config
from specd.types import SamplingParams
from specd_cli.stack import Stack, StackPorts

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Copy this list exactly, then say which item is a fruit: hammer, banana, bicycle, teapot.",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the squares of the numbers 1 to 5.",
]


@pytest.fixture(scope="module")
def bf16_stack():
    stack = Stack(ports=StackPorts.free(), threads=2, extra_target_args=["--dtype", "bfloat16"])
    try:
        stack.up()
        yield stack
    finally:
        stack.down()


async def greedy(stack, prompt: str, method: str) -> list[int]:
    request = build_request(messages=[{"role": "user", "content": prompt}], sampling=SamplingParams(max_tokens=48),
                            speculative=speculative_config(method))
    async with SpecdClient(stack.address("gateway")) as client:
        return (await client.complete(request, timeout=300))[1]


async def test_greedy_ngram_equals_none_alone_and_batched_in_bf16(bf16_stack):
    alone = [await greedy(bf16_stack, prompt, "none") for prompt in PROMPTS]
    speculative = [await greedy(bf16_stack, prompt, "ngram") for prompt in PROMPTS]
    batched = await asyncio.gather(*(greedy(bf16_stack, p, m) for p in PROMPTS for m in ("ngram", "none")))
    assert speculative == alone
    assert batched == [tokens for tokens in alone for _ in range(2)]
