"""The whole system as separate processes on loopback, on the real default model."""
import urllib.request

import pytest

from specd_cli.stack import DEFAULT_DRAFTERS, START_TIMEOUT_S, Stack, StackPorts


# Where the CPU computes bf16 slowly (AVX2 alone), a bf16 stack's target times its steps (the start-up profile)
# and its model drafters load for minutes; the tests that may start one allow for it (pytest.mark.timeout).
BF16_START_TIMEOUT_S = 900.0


def _running(stack: Stack, timeout_s: float = START_TIMEOUT_S):
    try:
        stack.up(timeout_s)
        yield stack
    finally:
        stack.down()


def target_is_batch_invariant(stack: Stack) -> bool:
    """What the target found at start: whether its logits are the same bits whatever shares a step."""
    with urllib.request.urlopen(stack.metrics_url("target"), timeout=5) as response:
        return 'batch_invariant="true"' in response.read().decode()


def batch_invariant_stack(stack: Stack, timeout_s: float = START_TIMEOUT_S):
    """A running stack whose tests need batch-invariant logits; they are skipped on a CPU where the
    target found its matmuls or attention not row independent (it says so in its log)."""
    for running in _running(stack, timeout_s):
        if not target_is_batch_invariant(running):
            pytest.skip("the target's logits are not batch invariant on this CPU")
        yield running


@pytest.fixture(scope="package")
def stack():
    yield from _running(Stack(ports=StackPorts.free(), threads=2))


@pytest.fixture(scope="package")
def bf16_stack():
    """In bf16, where the engine's logits are batch invariant: a sequence's output does not depend on
    what shares its steps, how its prompt was split, or whether it was preempted and recomputed. With
    every CPU drafter and lookahead, the shipped EAGLE head, and a draft_model drafter: the target's own first 8 layers
    (LayerSkip's early exit)."""
    # A deadline of 1 s for the drafters' answers, not 50 ms: these tests are about what drafts come back,
    # and in bf16 built for AVX2 (kernels and ATen; a Zen 4 EPYC) the EAGLE test got no draft in 384 tokens
    # with 50 ms, 10 with 1 s.
    yield from batch_invariant_stack(Stack(
        ports=StackPorts.free(), threads=2, extra_target_args=["--dtype", "bfloat16", "--drafter-timeout-ms", "1000"],
        drafters=(*DEFAULT_DRAFTERS, "draft_model", "eagle"),
        model_drafter_args=["--draft-layers", "8", "--dtype", "bfloat16"]), BF16_START_TIMEOUT_S)


@pytest.fixture(scope="module")
def small_kv_stack():
    """bf16 with a KV cache of 512 tokens: a chat request of 96 tokens fits, eight at once do not."""
    yield from batch_invariant_stack(Stack(ports=StackPorts.free(), threads=2,
                                           extra_target_args=["--dtype", "bfloat16", "--kv-cache-tokens", "512"]),
                                     BF16_START_TIMEOUT_S)
