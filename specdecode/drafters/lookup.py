"""Prompt lookup beside a model drafter (`eagle`, `eagle3`, `mtp`, `draft_model`, `layer_skip`).

Owns: the keys (`LookupKeys`, a base of those drafters' options), which rows copy this round
(`look_up`, `model_rows`) and splicing their copies into the model's draft (`splice_chains`,
`trees_with_lookup`).
Does not own: the lookup itself (ngram.py) or the model's drafting.

With ``prompt_lookup_max`` a row whose last n tokens occurred earlier (``prompt_lookup_min`` <=
n <= ``prompt_lookup_max``, `ngram`'s keys) drafts what followed them, up to γ tokens, in place
of the model's draft; the other rows draft with the model, ``num_steps`` deep (Arctic Inference
pairs suffix decoding with its speculator the same way). Copies (code that repeats its names,
summaries that quote) are long and cheap; the model covers the rest. A lookup draft is a
deterministic function of the history (one-hot q), so a round stays lossless whichever source
each row took. The model still runs on every row (its cache stays whole); its draws for a lookup
row come from a scratch stream (`Batch.draft_generators`), so a seeded row's samples do not depend
on its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.config import SpecDecodeError, is_int
from specdecode.drafters.base import Draft
from specdecode.drafters.ngram import NgramOptions, lookup_rows
from specdecode.engine.batch import Batch
from specdecode.tree import TreeBatch


@dataclass(frozen=True)
class LookupKeys:
    """prompt_lookup_max: None = off. num_steps: the model's draft depth (chain length or tree
    depth) when γ is the lookup's; None = γ."""

    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_steps: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_lookup_max is None:
            if self.prompt_lookup_min is not None or self.num_steps is not None:
                raise SpecDecodeError("prompt_lookup_min and num_steps need prompt_lookup_max (prompt lookup)")
            return
        lookup = NgramOptions(self.prompt_lookup_min, self.prompt_lookup_max)  # validated as ngram's keys are
        object.__setattr__(self, "prompt_lookup_min", lookup.prompt_lookup_min)
        if self.num_steps is not None and (not is_int(self.num_steps) or self.num_steps < 1):
            raise SpecDecodeError(f"num_steps must be an integer >= 1, got {self.num_steps!r}")

    def lookup(self) -> tuple[int, int] | None:
        """(min n, max n), or None when lookup is off."""
        return None if self.prompt_lookup_max is None else (self.prompt_lookup_min, self.prompt_lookup_max)

    def steps(self, gamma: int) -> int:
        """The model's draft depth for γ, checked against it."""
        steps = self.num_steps or gamma
        if steps > gamma:
            raise SpecDecodeError(f"num_steps ({steps}) must be at most num_speculative_tokens ({gamma})")
        return steps


def look_up(batch: Batch, lookup: tuple[int, int] | None, num_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Each row's lookup draft (within its draft limit; [] where the model drafts) and matched n
    (0 where it drafts nothing); all [] and 0 when ``lookup`` is None."""
    if lookup is None:
        return [[] for _ in batch.seqs], [0] * len(batch)
    limits = batch.draft_limits or [num_tokens] * len(batch)
    return lookup_rows(batch.seqs, *lookup, [min(num_tokens, n) for n in limits])


def model_rows(found: list[list[int]], device: torch.device) -> torch.Tensor:
    """[B] bool: the rows that draft with the model this round (every row where none copies, made
    on the device: no host-to-device copy on the hot path when lookup is off or finds nothing)."""
    if not any(found):
        return torch.ones(len(found), dtype=torch.bool, device=device)
    return torch.tensor([not f for f in found], dtype=torch.bool, device=device)


def splice_chains(draft: Draft, found: list[list[int]], matched: list[int]) -> Draft:
    """The model's chains with the lookup rows' chains in their place: one-hot q, no confidence
    (NaN: an adaptive budget plans those rows on its own estimates), the matched n as evidence
    (0: the model's draft)."""
    B, w = draft.tokens.shape
    device = draft.tokens.device
    rows = [b for b, f in enumerate(found) if f]
    W = max([w, *map(len, found)])
    tokens = torch.full((B, W), -1, dtype=torch.long, device=device)
    tokens[:, :w] = draft.tokens
    for b in rows:
        tokens[b] = -1
        tokens[b, : len(found[b])] = torch.tensor(found[b], device=device)
    q = confidence = None
    if draft.q is not None:
        q = draft.q.new_zeros(B, W, draft.q.shape[-1])  # [B, W, V]
        q[:, :w] = draft.q
        for b in rows:
            q[b] = 0.0
            q[b, torch.arange(len(found[b])), tokens[b, : len(found[b])]] = 1.0
    if draft.confidence is not None:
        confidence = draft.confidence.new_full((B, W), float("nan"))
        confidence[:, :w] = draft.confidence
        confidence[rows] = float("nan")
    return Draft(tokens=tokens, q=q, confidence=confidence, evidence=matched)


def trees_with_lookup(
    grow: Callable[[list[int] | None], Draft], batch: Batch, roots: list[int], depth: int, found: list[list[int]],
    device: torch.device,
) -> Draft:  # fmt: skip
    """The model's trees, ``grow(limits)`` (per-row depth limits or None), with each lookup row's
    tree replaced by its chain; the model grows none where every row copies."""
    if not any(found):
        return grow(batch.draft_limits)
    tokens, parents = [[r] for r in roots], [[-1] for _ in roots]
    if not all(found):
        limits = batch.draft_limits or [depth] * len(roots)
        tree = grow([0 if f else n for f, n in zip(found, limits)]).tree  # a lookup row grows nothing
        assert tree is not None
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    for b, chain in enumerate(found):
        if chain:
            tokens[b], parents[b] = [roots[b], *chain], list(range(-1, len(chain)))
    N = max(map(len, tokens))
    padded = (torch.tensor([r + [-1] * (N - len(r)) for r in rows], device=device) for rows in (tokens, parents))
    return Draft.from_tree(TreeBatch.from_parents(*padded))
