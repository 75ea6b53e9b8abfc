"""The records the serving engine keeps and reports: a request in its queues, what a step
added to one request, and the engine's counts; and the check a prompt passes to be queued.

Owns: data, and `check_prompt` / `parse_override`; engine/serving.py moves requests between its queues and
makes the events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdecode.config import SamplingParams, SpecDecodeError, is_int
from specdecode.core.batch import Sequence, SpecStats
from specdecode.core.sampling import Logprob


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
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first prefilled


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
    num_cached_tokens: int | None = None  # prompt tokens its first prefill found in the prefix cache
    matched: bool = False  # looked up in the prefix cache since it was (re)admitted

    @property
    def resumed(self) -> bool:
        """Preempted after its first token: recompute all but the newest token, sample nothing."""
        return len(self.seq.token_ids) > self.seq.num_prompt

    @property
    def prefill_target(self) -> int:
        return len(self.seq.token_ids) - (1 if self.resumed else 0)


def check_prompt(prompt_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int) -> None:
    """Raise `SpecDecodeError` (one line) for a prompt the engine cannot take."""
    if not prompt_ids:
        raise SpecDecodeError("prompt is empty")
    if any(not is_int(t) or not 0 <= t < vocab for t in prompt_ids):
        raise SpecDecodeError(f"prompt token ids must be integers in [0, {vocab})")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise SpecDecodeError(f"prompt has {len(prompt_ids)} tokens but the context is {max_model_len}; shorten the prompt")
    if params.max_tokens > room:
        raise SpecDecodeError(
            f"max_tokens={params.max_tokens} is beyond the context: the prompt has {len(prompt_ids)} of "
            f"{max_model_len} tokens, so at most {room} can be generated"
        )


def parse_override(override: dict | None, gamma: int) -> int:
    """The γ a request asks for, within the engine's ``gamma``."""
    if override is None:
        return gamma
    if not isinstance(override, dict) or set(override) - {"num_speculative_tokens"}:
        raise SpecDecodeError(
            f"a per-request speculative override takes only num_speculative_tokens, got {override!r}"
        )
    k = override.get("num_speculative_tokens", gamma)
    if not is_int(k) or not 0 <= k <= gamma:
        raise SpecDecodeError(f"num_speculative_tokens override must be an integer in [0, {gamma}], got {k!r}")
    return k
