"""A stand-in with `ServingEngine`'s interface, used until specdecode/engine/serving.py lands.

Each running request emits 1..γ+1 tokens per step (cycling through its prompt), counts
drafts like a speculative engine, and holds ceil(length / block_size) KV blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.engine.batch import SpecStats


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass
class RequestEvent:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    gamma: int
    out: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)


class FakeEngine:
    def __init__(self, max_model_len: int = 256, max_num_seqs: int = 4, gamma: int = 3, num_blocks: int = 64,
                 block_size: int = 16, eos_id: int = 2) -> None:  # fmt: skip
        self.max_model_len, self.max_num_seqs, self.gamma = max_model_len, max_num_seqs, gamma
        self.num_blocks, self.block_size, self.eos_id = num_blocks, block_size, eos_id
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []

    def add_request(self, request_id, prompt_ids, params, spec_override=None) -> None:
        if not prompt_ids:
            raise SpecDecodeError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise SpecDecodeError(f"prompt has {len(prompt_ids)} tokens but the context is {self.max_model_len}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise SpecDecodeError(f"max_tokens {params.max_tokens} goes past the context of {self.max_model_len}")
        if any(r.rid == request_id for r in self.waiting + self.running):
            raise SpecDecodeError(f"duplicate request id {request_id}")
        gamma = self.gamma
        if spec_override is not None:
            if set(spec_override) - {"num_speculative_tokens"}:
                raise SpecDecodeError(f"unknown speculative_config key(s) {sorted(set(spec_override) - {'num_speculative_tokens'})}")
            k = spec_override.get("num_speculative_tokens", gamma)
            if not isinstance(k, int) or not 0 <= k <= self.gamma:
                raise SpecDecodeError(f"num_speculative_tokens must be in [0, {self.gamma}], got {k!r}")
            gamma = k
        self.waiting.append(_Req(request_id, list(prompt_ids), params, gamma))

    def abort(self, request_id: str) -> None:
        self.waiting = [r for r in self.waiting if r.rid != request_id]
        self.running = [r for r in self.running if r.rid != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestEvent]:
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        events = []
        for r in list(self.running):
            n = 1 + (len(r.out) % (r.gamma + 1)) if r.gamma else 1
            new = []
            for _ in range(n):
                if len(r.out) + len(new) >= r.params.max_tokens:
                    break
                new.append(r.prompt[(len(r.out) + len(new)) % len(r.prompt)])
            if r.gamma:
                r.stats.record(r.gamma, max(len(new) - 1, 0))
            r.out += new
            finish = None
            if len(r.out) >= r.params.max_tokens:
                finish = "length"
            elif self.eos_id in new and not r.params.ignore_eos:
                finish = "stop"
            if finish:
                self.running.remove(r)
            events.append(RequestEvent(r.rid, new, finish, r.stats, len(r.prompt), len(r.out)))
        return events

    def stats(self) -> EngineStats:
        used = sum(math.ceil((len(r.prompt) + len(r.out)) / self.block_size) for r in self.running)
        return EngineStats(len(self.running), len(self.waiting), 0, used, self.num_blocks)
