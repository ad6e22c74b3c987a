"""A request as the target's scheduler sees it, its state explicit: where it is in its life
(`status`) and how many of its tokens the KV cache holds (`num_computed`)."""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field, replace

import torch

from engine.features import FeatureLog
from target_svc.drafting.auto import MethodChooser
from specd.latency import TokenClock
from specd.types import SamplingParams, SpeculativeConfig, TokenLogprobs, Usage
from specd.v1 import common_pb2


@dataclass
class StepOutput:
    """Tokens one verification step committed for one sequence."""
    token_ids: list[int]
    accepted_draft_tokens: int
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: Usage = field(default_factory=Usage)  # running totals of the request so far
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, if the request asked


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # submitted, not yet admitted, or preempted (no KV memory)
    RUNNING = "running"  # admitted: prefilling or decoding
    FINISHED = "finished"  # done, failed or aborted; its KV memory is freed


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    speculative: SpeculativeConfig
    max_tokens: int  # resolved: never past the context end
    eos_token_ids: frozenset[int]
    usage: Usage = field(default_factory=Usage)
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    clock: TokenClock = field(default_factory=TokenClock)  # started when the request arrived
    scheduled_at: float | None = None
    # Why to drop it at the next step boundary, or None: its finish reason, "aborted" (the client went away)
    # or "stuck" (the step watchdog failed it).
    dropped: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V the cache holds for good: the prompt's tokens prefilled so far (a long prompt
    # takes several steps), then all but the newest token (the next step feeds it in).
    num_computed: int = 0
    preemptions: int = 0  # times its KV cache was taken back for others
    # What an ask for its draft gained the batch, in tokens (a moving mean; None: never asked), over how
    # many asks, and steps since it was last asked: `DraftingGate` decides from them whether to ask.
    draft_gain: float | None = None
    draft_asks: int = 0
    unasked_steps: int = 0
    # The target's features of its tokens by position, kept when its drafter drafts from them (EAGLE).
    features: FeatureLog | None = None
    chooser: MethodChooser | None = None  # under `method: auto`: which drafter to ask, step by step

    def __post_init__(self):
        # Prompt + output in one list that only grows: the decode step reads it every step.
        self.tokens: list[int] = list(self.prompt)
        self.usage.prompt_tokens = len(self.prompt)
        self.generator = torch.Generator()
        self.generator.manual_seed(self.sampling.seed if self.sampling.seed is not None else torch.seed())

    @property
    def drafting_method(self) -> str:
        """The drafter its latest ask went to: its method's, or under `method: auto` the one chosen."""
        return self.chooser.current if self.chooser is not None else self.speculative.method

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def prefill_target(self) -> int:
        """Tokens whose K/V the cache must hold before the sequence decodes: its prompt; after a
        preemption freed its cache, every token but the newest (the next decoding step feeds that one in)."""
        return len(self.prompt) if self.num_output == 0 else len(self.tokens) - 1

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    def preempt(self) -> None:
        """Its KV cache was freed: back to waiting, to be recomputed from its tokens so far."""
        self.status, self.num_computed = SequenceStatus.WAITING, 0
        self.preemptions += 1

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.num_output

    def draft_budget(self) -> int:
        """The most drafts worth verifying this step: never past max_tokens (the step adds one more)."""
        if self.in_prefill or not self.speculative.speculates:
            return 0
        return max(0, min(self.speculative.num_speculative_tokens, self.remaining - 1))

    def commit(self, new_tokens: list[int], accepted: int, num_drafts: int,
               logprobs: tuple[TokenLogprobs, ...] = ()) -> StepOutput:
        """Append a step's tokens (and their logprobs, if asked for), cut at EOS or max_tokens; the output
        says if this finished the sequence."""
        verified = not self.in_prefill  # the prefill's one token verifies nothing
        reason = common_pb2.FINISH_REASON_UNSPECIFIED
        for i, token in enumerate(new_tokens):
            if token in self.eos_token_ids:
                new_tokens, reason = new_tokens[:i + 1], common_pb2.FINISH_REASON_STOP
                break
        if len(new_tokens) >= self.remaining and reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            new_tokens, reason = new_tokens[:self.remaining], common_pb2.FINISH_REASON_LENGTH
        accepted = min(accepted, len(new_tokens))
        self.tokens.extend(new_tokens)
        self.num_computed = len(self.tokens) - 1
        self.usage.completion_tokens = self.num_output
        self.usage.verification_steps += verified
        self.usage.draft_tokens += num_drafts
        self.usage.accepted_draft_tokens += accepted
        return StepOutput(new_tokens, accepted, reason, replace(self.usage), list(logprobs[:len(new_tokens)]))
