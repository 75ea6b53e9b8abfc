"""The records the serving engine keeps and reports: a request in its queues, what a step
added to one request, and the engine's counts.

Owns: data only; engine/serving.py moves requests between its queues and makes the events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdecode.core.batch import Sequence, SpecStats
from specdecode.sampling import Logprob


@dataclass
class RequestEvent:
    """What one step added to one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # None while running; "stop" | "length"
    stats: SpecStats
    num_prompt_tokens: int
    num_output_tokens: int
    # when the step made it (time.perf_counter): a request's first token comes out of the prefill,
    # before the same step's decode round, whose tokens come out with it
    at: float = field(default_factory=time.perf_counter)
    logprobs: list[Logprob] | None = None  # one per new token, where the request asks for logprobs
    prompt_logprobs: list[Logprob | None] | None = None  # on a request's first event, where it asks: one per prompt token


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int  # queued or preempted, not yet prefilling
    num_prefilling: int
    num_preempted_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, found cached


@dataclass(eq=False)  # a request is itself: queues find and remove it by identity
class Request:
    request_id: str
    seq: Sequence
    gamma: int  # the most draft tokens per round this request may verify
    arrival: int
    cached: int = 0  # tokens whose K/V are in the target cache (prefill progress)
    features: list[torch.Tensor] = field(default_factory=list)  # prefill chunks' features, for the drafter

    @property
    def resumed(self) -> bool:
        """Preempted after its first token: recompute all but the newest token, sample nothing."""
        return len(self.seq.token_ids) > self.seq.num_prompt

    @property
    def prefill_target(self) -> int:
        return len(self.seq.token_ids) - (1 if self.resumed else 0)
