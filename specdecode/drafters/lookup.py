"""Lookup beside a model drafter (`eagle`, `eagle3`, `mtp`, `medusa`, `dflash`, `draft_model`, `layer_skip`): copies
from the row's own text (prompt lookup) and from a datastore of the target's answers (REST).

Owns: the keys (`LookupKeys`, a base of those drafters' options), `LookupDrafter` (the wrapper
the registry puts around such a drafter when its keys ask for a lookup), which rows copy this
round (`Lookup`, `look_up`) and putting their copies into the drafter's draft (`splice_chains`,
`chains_in_trees`; `copies_only` where no row needs the drafter), and what a wrapped drafter
reads of the copies (`drafting_rows`, `tree_limits`).
Does not own: the lookups themselves (ngram.py, datastore.py) or the model's drafting.

With ``prompt_lookup_max`` a row whose last n tokens occurred earlier (``prompt_lookup_min`` <=
n <= ``prompt_lookup_max``, `ngram`'s keys) drafts what followed them, up to γ tokens, in place
of the model's draft. With ``datastore`` (a folder from ``python -m specdecode.train.datastore``,
or ``true`` for the one shipped for this target) a row that found no such copy looks up the
longest suffix of its context (at least ``prompt_lookup_min`` tokens) among the target's earlier
answers, and drafts their most frequent continuation (`Datastore.draft`: at most n tokens for n
matched, where at least ``datastore_min_prob`` of the occurrences go on with its first token). The other
rows draft with the model, ``num_steps`` deep (Arctic Inference pairs suffix decoding with its
speculator the same way). Copies are long and cheap; the model covers the rest. A lookup draft is
a deterministic function of the history and the store (one-hot q), so a round stays lossless
whichever source each row took.

The contract with the wrapped drafter (`Drafter.propose`'s ``copies``): in a round where some row
copies, it is asked to draft with ``copies`` (row b's copy, [] where it drafts): it runs on every
row (its cache stays whole) and its tokens for the copying rows are scratch, drawn from scratch
streams (`Batch.draft_generators`), so a seeded row's samples do not depend on its neighbours. In
a round where every row copies, its ``propose`` is not called at all; its ``on_verified`` always is,
and what it is owed waits for the next round it drafts in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.config import SpecDecodeError, is_int
from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.datastore import DEFAULT_MIN_PROB, Datastore, check_datastore_keys, fill_rows, open_datastore
from specdecode.drafters.ngram import NgramOptions, lookup_rows
from specdecode.core.batch import Batch
from specdecode.core.tree import TreeBatch

if TYPE_CHECKING:
    from specdecode.model.loader import LoadedModel


@dataclass(frozen=True)
class LookupKeys:
    """prompt_lookup_max: None = no prompt lookup. datastore: a folder, true = the one shipped for
    the target, None = none. num_steps: the model's draft depth (chain length or tree depth) when
    γ is the lookup's; None = γ."""

    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_steps: int | None = None
    datastore: str | bool | None = None
    datastore_min_prob: float = DEFAULT_MIN_PROB

    def __post_init__(self) -> None:
        if not self.lookup_on:
            if self.prompt_lookup_min is not None or self.num_steps is not None:
                raise SpecDecodeError("prompt_lookup_min and num_steps need prompt_lookup_max (prompt lookup) "
                                      "or a datastore")  # fmt: skip
            check_datastore_keys(self.datastore, self.datastore_min_prob, 1)
            return
        # validated as ngram's keys are (a datastore alone takes prompt_lookup_min as its shortest match)
        lookup = NgramOptions(self.prompt_lookup_min, self.prompt_lookup_max)
        object.__setattr__(self, "prompt_lookup_min", lookup.prompt_lookup_min)
        check_datastore_keys(self.datastore, self.datastore_min_prob, lookup.prompt_lookup_min)
        if self.num_steps is not None and (not is_int(self.num_steps) or self.num_steps < 1):
            raise SpecDecodeError(f"num_steps must be an integer >= 1, got {self.num_steps!r}")

    @property
    def lookup_on(self) -> bool:
        """Whether these keys ask for a lookup (prompt lookup or a datastore)."""
        return self.prompt_lookup_max is not None or bool(self.datastore)

    def lookup(self, target: LoadedModel) -> Lookup | None:
        """The lookup these keys ask for (its datastore loaded for ``target``), or None when off."""
        if not self.lookup_on:
            return None
        ngram = None if self.prompt_lookup_max is None else (self.prompt_lookup_min, self.prompt_lookup_max)
        store = open_datastore(self.datastore, target) if self.datastore else None
        return Lookup(ngram, store, self.prompt_lookup_min, self.datastore_min_prob)

    def steps(self, gamma: int) -> int:
        """The model's draft depth for γ, checked against it."""
        steps = self.num_steps or gamma
        if steps > gamma:
            raise SpecDecodeError(f"num_steps ({steps}) must be at most num_speculative_tokens ({gamma})")
        return steps


@dataclass(frozen=True)
class Lookup:
    """Where a row's draft may come from instead of the model: its own text (``ngram`` = (min n,
    max n), or None), then ``store`` (or None), matched on at least ``min_n`` tokens."""

    ngram: tuple[int, int] | None
    store: Datastore | None
    min_n: int
    min_prob: float

    def rows(self, batch: Batch, depths: list[int]) -> tuple[list[list[int]], list[int]]:
        """Each row's copied draft (up to ``depths[b]`` tokens; [] where the model drafts) and its
        evidence (0 where it drafts nothing)."""
        if self.ngram is not None:
            found, evidence = lookup_rows(batch.seqs, *self.ngram, depths)
        else:
            found, evidence = [[] for _ in batch.seqs], [0] * len(batch)
        if self.store is None:
            return found, evidence
        fill_rows(self.store, [seq.token_ids for seq in batch.seqs], found, evidence, depths, self.min_n, self.min_prob)
        return found, evidence


def look_up(batch: Batch, lookup: Lookup | None, gamma: int) -> tuple[list[list[int]], list[int]]:
    """Each row's lookup draft (up to its draft limit, else ``gamma``; [] where the model drafts)
    and its evidence (0 where it drafts nothing); all [] and 0 when ``lookup`` is None.

    Not cut to the depth the engine asked of the model: a copy costs next to nothing at any
    depth, and an adaptive budget asks for the depth it planned before it saw the copies'
    evidence (with a learned drafter, too dear to propose before planning); it plans again on
    the proposal. Cut to that depth, a copied row verified one token a round at batch 1
    (`eagle_datastore`: tau 1.64 on code against 2.22 under the fixed budget)."""
    if lookup is None:
        return [[] for _ in batch.seqs], [0] * len(batch)
    return lookup.rows(batch, batch.draft_limits or [gamma] * len(batch))


def drafting_rows(copies: list[list[int]] | None, batch: Batch, device: torch.device) -> torch.Tensor | None:
    """[B] bool: the rows a wrapped drafter drafts for (those without a copy); None where no row
    copies (every row drafts: no host-to-device copy on the hot path)."""
    if copies is None or not any(copies):
        return None
    return torch.tensor([not c for c in copies], dtype=torch.bool, device=device)


def tree_limits(copies: list[list[int]] | None, batch: Batch, depth: int) -> list[int] | None:
    """Per-row depth limits for a wrapped drafter's trees: 0 for a copying row (its tree is
    replaced by its chain), the row's draft limit for the others; None where neither limits."""
    if copies is None or not any(copies):
        return batch.draft_limits
    limits = batch.draft_limits or [depth] * len(batch)
    return [0 if c else n for c, n in zip(copies, limits)]


def splice_chains(draft: Draft, found: list[list[int]], matched: list[int]) -> Draft:
    """The model's chains with the lookup rows' chains in their place: one-hot q, no confidence
    (NaN: an adaptive budget plans those rows on its own estimates), ``matched`` as evidence
    (0: the model's draft)."""
    if not any(found):  # no row copies: the model's draft as it is (no copy of q on the hot path)
        return dataclasses.replace(draft, evidence=matched)
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


def chains_in_trees(draft: Draft, found: list[list[int]]) -> Draft:
    """The model's trees with each lookup row's tree replaced by its chain."""
    assert draft.tree is not None
    if not any(found):
        return draft
    tokens, parents = draft.tree.tokens.tolist(), draft.tree.parents.tolist()
    for b, chain in enumerate(found):
        if chain:
            tokens[b], parents[b] = [tokens[b][0], *chain], list(range(-1, len(chain)))
    N = max(map(len, tokens))
    device = draft.tokens.device
    padded = (torch.tensor([r + [-1] * (N - len(r)) for r in rows], device=device) for rows in (tokens, parents))
    return Draft.from_tree(TreeBatch.from_parents(*padded))


def nothing_to_draft(batch: Batch, found: list[list[int]]) -> bool:
    """Whether no row needs the model this round: some row copies, and each other may draft
    nothing (a draft limit of 0: a request's own γ of 0)."""
    limits = batch.draft_limits or [1] * len(found)
    return any(found) and all(f or n == 0 for f, n in zip(found, limits))


def copies_only(found: list[list[int]], matched: list[int], device: torch.device) -> Draft:
    """The draft of a round in which no row needs the model (`nothing_to_draft`), with no model
    pass: the copies as chains, for a tree drafter too (a tree of one branch is verified as a
    chain anyway, and building it costs host time every round). The model's pending input waits for
    the next round it drafts in, fed then in one pass."""
    return splice_chains(Draft(torch.empty(len(found), 0, dtype=torch.long, device=device)), found, matched)


class LookupDrafter:
    """A drafter whose rows copy where the lookup finds a copy: ``inner`` drafts the others
    (the contract: the module's docstring). γ is the lookup's; the inner drafter's own depth
    is its ``num_steps``."""

    def __init__(self, inner: Drafter, lookup: Lookup, gamma: int, device: torch.device) -> None:
        self.inner, self.lookup, self.gamma, self.device = inner, lookup, gamma, device
        self.hidden_layers: tuple[int, ...] = inner.hidden_layers
        self.learns_from_other_requests: bool = getattr(inner, "learns_from_other_requests", False)

    def max_draft_tokens(self, num_tokens: int) -> int:
        return max(self.inner.max_draft_tokens(num_tokens), num_tokens)  # a lookup row's chain: γ nodes

    def prefill(self, batch: Batch, rows: list[int], hidden: list[torch.Tensor] | None = None) -> None:
        self.inner.prefill(batch, rows, hidden)

    def propose(self, batch: Batch, num_tokens: int) -> Draft:
        found, matched = look_up(batch, self.lookup, self.gamma)  # found[b] = [] where the inner drafter drafts
        if nothing_to_draft(batch, found):  # a run of copied rounds costs no model pass
            return copies_only(found, matched, self.device)
        draft = self.inner.propose(batch, num_tokens, copies=found)
        return chains_in_trees(draft, found) if draft.tree is not None else splice_chains(draft, found, matched)

    def on_verified(
        self, batch: Batch, num_accepted: torch.Tensor, aux_logits: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        self.inner.on_verified(batch, num_accepted, aux_logits, hidden)

    def select_rows(self, rows: list[int]) -> None:
        self.inner.select_rows(rows)
