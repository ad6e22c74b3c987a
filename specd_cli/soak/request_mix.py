"""What the soak's clients send: Spec-Bench prompts as chat or as plain text, every method the target
serves, greedy or sampled, of varied lengths, so that a long run goes through every path a real load does."""
from __future__ import annotations

import random
from dataclasses import dataclass

from specd.client import build_request
from specd.types import SamplingParams
from specd.v1 import common_pb2, generation_pb2
from specd_cli.bench.prompts import Prompt

SAMPLED_TEMPERATURE = 0.8


@dataclass(frozen=True)
class RequestMix:
    prompts: list[Prompt]
    methods: list[str]
    max_tokens: int  # a request asks for between a quarter of this and this many tokens

    def draw(self, rng: random.Random, max_tokens: int | None = None) -> generation_pb2.GenerateRequest:
        prompt = rng.choice(self.prompts)
        sampled = rng.random() < 0.5
        sampling = SamplingParams(temperature=SAMPLED_TEMPERATURE if sampled else 0.0,
                                  seed=rng.getrandbits(32) if sampled else None,
                                  max_tokens=max_tokens or rng.randint(max(1, self.max_tokens // 4), self.max_tokens))
        speculative = common_pb2.SpeculativeConfig(method=rng.choice(self.methods))
        if rng.random() < 0.5:
            return build_request(messages=prompt.messages, sampling=sampling, speculative=speculative)
        return build_request(prompt=prompt.text, sampling=sampling, speculative=speculative)
