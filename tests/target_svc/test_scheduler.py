"""The scheduler's step loop on a tiny random model: what one sequence does never breaks another."""
import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from specd.errors import InternalError
from specd.types import SamplingParams, SpeculativeConfig
from target_svc.drafting.drafters import Drafters
from target_svc.metrics import TargetMetrics
from target_svc.engine.runner import ModelRunner
from target_svc.scheduler import Scheduler
from target_svc.sequence import Sequence, SequenceStatus

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]
NO_SPECULATION = SpeculativeConfig(method="none")


@pytest.fixture
async def scheduler(tiny_model_dir):
    compute_thread = ThreadPoolExecutor(max_workers=1)
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=1024, block_size=4)
    scheduler = Scheduler(runner, compute_thread, Drafters([], runner.vocab_size), TargetMetrics())
    loop_task = asyncio.get_running_loop().create_task(scheduler.run())
    yield scheduler
    loop_task.cancel()
    await scheduler.close()


def sequence(name, prompt=PROMPT, max_tokens=12, **sampling) -> Sequence:
    return Sequence(name, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling), NO_SPECULATION,
                    max_tokens, eos_token_ids=frozenset())


async def run_to_end(scheduler: Scheduler, seq: Sequence) -> list[int]:
    """Submit and collect every token; raises what the scheduler put in the sequence's stream."""
    scheduler.submit(seq)
    tokens = []
    while True:
        out = await seq.outputs.get()
        if isinstance(out, Exception):
            raise out
        tokens.extend(out.token_ids)
        if out.finish_reason:
            return tokens


def kv_blocks_in_use(scheduler: Scheduler) -> int:
    allocator = scheduler._runner.allocator
    return allocator.num_blocks - allocator.num_free_blocks


async def test_a_repetition_penalty_decodes_beside_other_sequences_as_transformers_does(scheduler, tiny_model_dir):
    penalized, plain = await asyncio.gather(run_to_end(scheduler, sequence("penalized", repetition_penalty=1.5)),
                                            run_to_end(scheduler, sequence("plain")))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                           min_new_tokens=12)[0, len(PROMPT):].tolist()
    assert penalized == expected
    assert len(plain) == 12


async def test_a_sequence_whose_step_fails_fails_alone(scheduler):
    alone = await run_to_end(scheduler, sequence("alone"))
    # A token id outside the vocabulary makes the forward pass fail (the servicer never lets one in).
    broken = sequence("broken", prompt=[*PROMPT, 10 ** 6])
    results = await asyncio.gather(run_to_end(scheduler, sequence("good")), run_to_end(scheduler, broken),
                                   return_exceptions=True)
    assert results[0] == alone
    assert isinstance(results[1], InternalError)
    assert "internal error" in str(results[1])
    assert kv_blocks_in_use(scheduler) == 0
    assert await run_to_end(scheduler, sequence("after")) == alone  # the scheduler goes on


async def test_a_sequence_states_where_it_is_and_what_the_cache_holds(scheduler):
    seq = sequence("s", max_tokens=3)
    assert (seq.status, seq.num_computed, seq.in_prefill) == (SequenceStatus.WAITING, 0, True)
    scheduler.submit(seq)
    first = await seq.outputs.get()  # the prefill: the whole prompt is in the cache now
    assert seq.status == SequenceStatus.RUNNING
    assert seq.num_computed == len(PROMPT) and not seq.in_prefill and len(first.token_ids) == 1
    while not (await seq.outputs.get()).finish_reason:
        pass
    assert seq.status == SequenceStatus.FINISHED and seq.num_computed == len(seq.tokens) - 1
