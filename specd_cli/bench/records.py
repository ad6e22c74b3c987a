"""What one timed request produced: the unit every statistic is computed from."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

# transformers' generate (greedy or sampled) and its prompt-lookup mode; every other system is a specd method.
BASELINE_SYSTEMS = ("hf", "hf-lookup")


@dataclass
class RequestRecord:
    system: str  # a specd method ("none", "ngram", ...) or a baseline ("hf", "hf-lookup")
    prompt_id: str
    category: str
    temperature: float
    seed: int | None
    max_tokens: int
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # (seconds since the request was sent, tokens in that chunk) for every chunk that carried tokens
    chunks: list[tuple[float, int]] = field(default_factory=list)
    e2e_s: float = 0.0  # request sent -> last chunk received
    verification_steps: int = 0  # decoding steps after the prefill (as the server's Usage counts them)
    draft_tokens: int | None = None  # None: the system does not report drafts
    accepted_draft_tokens: int | None = None
    finish_reason: str = ""
    error: str | None = None
    concurrency: int | None = None  # serving load only
    sent_at_s: float = 0.0  # serving load only: seconds since its round started
    load_round: int = 0  # serving load only: which of its level's rounds (each method's share of the prompts) it ran in

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        return asdict(self)
