"""End to end, the scheduler under pressure: a KV cache too small for the load, streams that ask for
the whole context, and a prompt as long as the context arriving while others decode. Real model,
real services; the outputs are compared with an unconstrained run and the memory checked afterwards."""
import asyncio
import urllib.request

import pytest
from transformers import AutoTokenizer

from specd.client import SpecdClient, build_request
from specd.model_store import resolve_model
from specd.types import SamplingParams
from specd.v1 import common_pb2

pytestmark = pytest.mark.e2e

# Prompts written for this test, not taken from any benchmark in the repo.
PROMPTS = [
    "Name five rivers in Europe and one city on each.",
    "Write the numbers from one to twenty in words, separated by commas.",
    "Explain what a hash table is to a ten year old.",
    "Give three tips for keeping houseplants alive in winter.",
    "Repeat this line twice: red sky at night, sailor's delight.",
    "List the planets of the solar system in order from the sun.",
    "What is the difference between weather and climate?",
    "Write a short limerick about a cat who learns to code.",
]
MAX_TOKENS = 96
INT32_MAX = 2**31 - 1


def _request(method, max_tokens=MAX_TOKENS, prompt=None, messages=None):
    return build_request(prompt=prompt, messages=messages, sampling=SamplingParams(max_tokens=max_tokens),
                         speculative=common_pb2.SpeculativeConfig(method=method))


def _chat(prompt, method, max_tokens=MAX_TOKENS):
    return _request(method, max_tokens, messages=[{"role": "user", "content": prompt}])


async def _all_at_once(stack, method) -> list[list[int]]:
    async with SpecdClient(stack.address("gateway")) as client:
        replies = await asyncio.gather(*(client.complete(_chat(p, method), timeout=600) for p in PROMPTS))
    return [token_ids for _, token_ids, _ in replies]


def _metric(stack, name: str) -> float:
    with urllib.request.urlopen(stack.metrics_url("target"), timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


async def _memory_is_idle(stack, timeout_s: float = 30.0) -> bool:
    """Whether, within timeout_s, no KV block is in use and nothing runs or waits."""
    names = ("specd_kv_cache_blocks_used", "specd_requests_running", "specd_requests_waiting")
    for _ in range(int(timeout_s / 0.2)):
        if not any([await asyncio.to_thread(_metric, stack, name) for name in names]):
            return True
        await asyncio.sleep(0.2)
    return False


class Streams:
    """Streams running in the background; each keeps its chunks' token counts until cancelled."""

    def __init__(self, client: SpecdClient, requests):
        self.tokens = [0] * len(requests)
        self._tasks = [asyncio.create_task(self._read(client, i, r)) for i, r in enumerate(requests)]

    async def _read(self, client, index, request):
        async for chunk in client.generate(request, timeout=600):
            self.tokens[index] += len(chunk.token_ids)

    async def all_decoding(self):
        while not all(self.tokens):
            assert not any(task.done() for task in self._tasks), "a background stream ended early"
            await asyncio.sleep(0.05)

    async def cancel(self):
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.mark.timeout(1800)  # it may start the bf16 stacks (conftest.BF16_START_TIMEOUT_S)
async def test_a_kv_cache_too_small_for_the_load_preempts_and_every_output_equals_the_unconstrained_run(
        small_kv_stack, bf16_stack):
    unconstrained = await _all_at_once(bf16_stack, "none")
    preempted_before = _metric(small_kv_stack, "specd_preemptions_total")

    constrained = await _all_at_once(small_kv_stack, "ngram")

    assert _metric(small_kv_stack, "specd_preemptions_total") > preempted_before
    assert constrained == unconstrained
    assert await _memory_is_idle(small_kv_stack)


async def test_streams_asking_for_the_whole_context_do_not_lock_out_a_short_request(stack):
    """The lockout of issue 12: four streams with max_tokens 2^31-1 (each clipped to the context, so
    together the whole cache if reserved up front) and then a short request with a 30 s deadline."""
    async with SpecdClient(stack.address("gateway")) as client:
        greedy = Streams(client, [_chat(p, "ngram", max_tokens=INT32_MAX) for p in PROMPTS[:4]])
        try:
            await greedy.all_decoding()
            _, token_ids, last = await client.complete(_chat(PROMPTS[4], "ngram", max_tokens=8), timeout=30)
        finally:
            await greedy.cancel()
    assert len(token_ids) == 8 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert await _memory_is_idle(stack)


async def test_a_prompt_as_long_as_the_context_is_prefilled_in_chunks_while_the_other_streams_decode(stack):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model())
    sentence = "The lighthouse keeper counted the ships that passed in the night, one by one. "
    per_sentence = len(tokenizer(sentence * 100)["input_ids"]) / 100
    long_prompt = sentence * int(7950 / per_sentence)
    assert 7900 < len(tokenizer(long_prompt)["input_ids"]) <= 8000
    async with SpecdClient(stack.address("gateway")) as client:
        others = Streams(client, [_chat(p, "ngram", max_tokens=INT32_MAX) for p in PROMPTS[:3]])
        try:
            await others.all_decoding()
            before = list(others.tokens)
            async for _ in client.generate(_request("ngram", max_tokens=1, prompt=long_prompt), timeout=300):
                break  # the first token: the prompt is in
            during = [now - then for now, then in zip(others.tokens, before)]
        finally:
            await others.cancel()
    # 8000 prompt tokens take at least four steps of the default 2048 (fewer with decodes beside), and
    # every step decodes each running stream first: whole, the prompt would have taken one step.
    assert min(during) >= 3, during
    assert await _memory_is_idle(stack)
