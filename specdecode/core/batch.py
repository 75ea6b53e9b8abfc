"""Per-request state the engine keeps for one batch of sequences.

Owns: each row's committed tokens, sampling settings, RNG and statistics, and the
batched sampling tensors built from them. Does not own: the KV caches (kv_cache.py,
drafters) or the decoding loop (engine/step.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from specdecode.config import SamplingParams
from specdecode.core.sampling import Logprob, make_generator, sampling_tensors


@dataclass
class SpecStats:
    """Speculation counters for one request, named as vLLM's metrics."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_grammar_cut_tokens: int = 0  # deterministic draft tokens cut before verification: outside the grammar
    lossy: bool = False  # decoded with a lossy opt-in (typical acceptance): not the target's distribution
    # draft tokens verification decided on: a round stops at its first rejection, so the drafts
    # after it were never tried (α = accepted / reached; accepted / drafted understates it)
    num_reached_tokens: int = 0

    def snapshot(self) -> SpecStats:
        """A copy that later rounds do not change (an event's stats are those of its moment)."""
        lists = {f.name: list(v) for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), list)}
        return dataclasses.replace(self, **lists)

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_reached_tokens += min(num_accepted + 1, num_draft)
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position += [0] * (num_draft - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass
class Sequence:
    """One request: prompt + committed output tokens and how to extend them."""

    request_id: int | str
    token_ids: list[int]
    num_prompt: int
    params: SamplingParams
    generator: torch.Generator
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)  # params.bad_words tokenized
    logprobs: list[Logprob] = field(default_factory=list)  # one per output token, where params.logprobs asks
    grammar: Any = None  # a structured.Grammar, in step with the output, where params.structured asks
    prompt_logprobs: list[Logprob | None] = field(default_factory=list)  # None for the first token

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]


class Batch:
    """The rows being decoded together. Row order matches every cache's row order.

    ``capacity`` is the longest sequence (prompt + output) any row may reach; caches
    add room for one round of drafts on top.
    """

    def __init__(self, seqs: list[Sequence], capacity: int, device: torch.device) -> None:
        self.seqs = seqs
        self.capacity = capacity
        self.device = device
        # draws whose tokens are cut before verification; randomly seeded: no request's stream
        self._scratch = make_generator(None, device)
        self._refresh()

    def _refresh(self) -> None:
        params = [s.params for s in self.seqs]
        self.temperature, self.top_k, self.top_p, self.min_p = sampling_tensors(params, self.device)  # [B] each
        self.all_greedy = all(p.greedy for p in params)
        self.generators = [s.generator for s in self.seqs]
        # set by the engine before each proposal: row b verifies at most draft_limits[b] draft tokens
        # this step (None: no row is cut below the depth it is asked for)
        self.draft_limits: list[int] | None = None

    def draft_generators(self, k: int, drafting: torch.Tensor | None = None) -> list[torch.Generator | None]:
        """The generators to sample draft position ``k`` (0-based) from: a row's own where its
        draft can reach k (within ``draft_limits``, and ``drafting`` [B] bool where given), else
        a scratch stream. A row's own stream then advances by its own drafts only, not by the
        depth another row asked for, so a seeded request samples the same tokens whatever else
        is in the batch (under a fixed budget)."""
        own = [True] * len(self.seqs) if drafting is None else drafting.tolist()
        if self.draft_limits is not None:
            own = [ok and k < n for ok, n in zip(own, self.draft_limits)]
        return [g if ok else self._scratch for g, ok in zip(self.generators, own)]

    def __len__(self) -> int:
        return len(self.seqs)

    def select_rows(self, rows: list[int]) -> None:
        self.seqs = [self.seqs[r] for r in rows]
        self._refresh()

    def extend(self, seqs: list[Sequence]) -> list[int]:
        """Append joining sequences; returns their row indices."""
        first = len(self.seqs)
        self.seqs = self.seqs + list(seqs)
        self._refresh()
        return list(range(first, len(self.seqs)))

    def last_tokens(self) -> torch.Tensor:
        """[B, 1] the newest committed token of each row: it is not in the target cache yet."""
        return torch.tensor([[s.token_ids[-1]] for s in self.seqs], dtype=torch.long, device=self.device)

    @staticmethod
    def new_sequence(request_id: int, prompt: list[int], params: SamplingParams, device: torch.device) -> Sequence:
        return Sequence(request_id, list(prompt), len(prompt), params, make_generator(params.seed, device))


def pad_right(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists with 0. Returns tokens [B, T] and lengths [B]."""
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return tokens.to(device), lengths.to(device)
