"""What `LLM` returns: a prompt's output, its samples, stream events and per-request metrics
(vLLM's names).

Owns: data only; entrypoints/llm.py fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.core.batch import SpecStats
from specdecode.core.sampling import Logprob


@dataclass
class RequestMetrics(SpecStats):
    """Speculation statistics for one request (vLLM's metric names), with its timing."""

    num_generated_tokens: int = 0
    wall_time_s: float = 0.0
    first_token_time_s: float = 0.0  # prefill: from the start of generate to the first token

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second after the first: the rate speculation changes."""
        decode_s = self.wall_time_s - self.first_token_time_s
        return (self.num_generated_tokens - 1) / decode_s if decode_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ = 1 + accepted / drafts: tokens emitted per verification round that drafted."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """α, the chance that a draft token verification reaches is accepted (1 − TV(p, q) for a
        sampled draft; Leviathan's α): accepted / reached draft tokens."""
        return self.num_accepted_tokens / self.num_reached_tokens if self.num_reached_tokens else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        """vLLM's draft acceptance rate: accepted / proposed draft tokens (below α where rounds
        stop at a rejection: the drafts after it count as proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_reached_tokens": self.num_reached_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "num_generated_tokens": self.num_generated_tokens,
            "wall_time_s": self.wall_time_s,
            "first_token_time_s": self.first_token_time_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "lossy": self.lossy,
        }


@dataclass
class StreamEvent:
    """New tokens for prompt ``index``'s sample ``sample`` (``finish_reason`` set on its last event)."""

    index: int
    new_token_ids: list[int]
    finish_reason: str | None
    time_s: float  # since the start of the call
    stats: SpecStats
    sample: int = 0  # which of the prompt's n samples
    logprobs: list[Logprob] | None = None  # one per new token, where SamplingParams.logprobs asks
    prompt_logprobs: list[Logprob | None] | None = None  # on the first event, where SamplingParams.prompt_logprobs asks


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's name): ``index`` among its n."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    logprobs: list[Logprob] | None = None


@dataclass
class RequestOutput:
    """A prompt's output: its first sample's fields, and every sample in ``outputs`` (n of them)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    logprobs: list[Logprob] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None  # one per prompt token (None for the first)
