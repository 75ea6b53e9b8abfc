"""The drafter protocol: what every drafting method implements, and what it is given.

Owns: `Drafter` (propose / on_verified / select_rows), `Draft` (what a proposal is)
and `DrafterContext` (what a drafter may use from the engine). The engine calls only
these methods, so adding a method never touches engine code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from specdecode.config import SpecConfig
    from specdecode.core.batch import Batch
    from specdecode.model.loader import LoadedModel
    from specdecode.core.tree import TreeBatch


@dataclass
class Draft:
    """One round's proposal for every row of the batch: chains, or trees.

    Chains: ``tokens`` [B, γ] int64 holds each row's chain, padded with -1 past the
    row's own draft length (a row may propose nothing). ``q`` [B, γ, V] holds the draft
    distributions the tokens were sampled from, after the same temperature / top-k /
    top-p as the target; ``None`` means a deterministic drafter (one-hot q).

    Trees: ``tree`` is a `TreeBatch` whose node 0 in each row is the row's newest
    committed token (``batch.seqs[b].token_ids[-1]``); ``tokens`` is then
    ``tree.tokens[:, 1:]`` and ``q``, if given, is [B, N, V] indexed by node (the
    distribution node n's token was drawn from). Siblings are tried in node order.

    ``confidence`` [B, γ] (chains, optional): the drafter's estimate that draft token k is
    accepted given tokens 1..k-1 were (a trained head's, or the draft's own probability of
    the token); an adaptive verification budget calibrates and uses it in place of its
    online estimates for greedy rows (a sampled row's follows the tokens it drew); NaN where
    the drafter has none (eagle's prompt-lookup rows).

    ``evidence`` (chains, optional): per row, a small integer saying how the drafter found its
    proposal, by which an adaptive verification budget counts acceptance apart (ngram: the
    length of the matched n-gram; on the serving benchmark's input-reuse prompts a round after
    a rejection accepted 1.4 of 8 tokens after a 2-gram match and 6.4 after a 5-gram one).

    ``acceptance`` (chains, optional) is a drafter's own acceptance rule, called in place of
    rejection sampling with the target's p [B, γ+1, V], the draft tokens and the rows'
    generators; a rule whose ``lossy`` is true (Medusa's typical acceptance,
    `specdecode.core.verify.TypicalAcceptance`) no longer gives the target's distribution,
    and the engine flags the requests it decides ``lossy``.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    tree: "TreeBatch | None" = None
    aux: "AuxBranch | None" = None  # extra nodes that ride along in the verify pass (needs a tree)
    acceptance: "Acceptance | None" = None  # a chain's own acceptance rule (LOSSY opt-in: typical acceptance)
    confidence: torch.Tensor | None = None  # [B, γ] in (0, 1): the drafter's acceptance estimates (chains)
    evidence: list[int] | None = None  # [B]: how each row's proposal was found (chains)

    @staticmethod
    def from_tree(tree: "TreeBatch", q: torch.Tensor | None = None, aux: "AuxBranch | None" = None) -> "Draft":
        return Draft(tokens=tree.tokens[:, 1:], q=q, tree=tree, aux=aux)

    @property
    def num_tokens(self) -> torch.Tensor:
        """[B] draft tokens per row along one path: the chain's length, or the tree's depth."""
        if self.tree is not None:
            return (self.tree.depth * self.tree.valid).amax(dim=1)
        return (self.tokens >= 0).cumprod(dim=1).sum(dim=1)


class Acceptance(Protocol):
    """A drafter's own acceptance rule for its chains (see `Draft.acceptance`). On a one-hot p
    (a greedy row in a mixed batch) it must decide as greedy verification does, as typical
    acceptance does: the engine flags only sampled rows ``lossy``."""

    lossy: bool

    def __call__(
        self, p: torch.Tensor, draft_tokens: torch.Tensor, generator: "list[torch.Generator | None]"
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class AuxBranch:
    """Nodes a drafter adds to the target's verify pass only to read their logits back
    (lookahead decoding's Jacobi window). Nothing is accepted from them and their K/V are
    dropped with the rejected nodes, so they cannot change the output, only its speed.

    tokens [B, A] int64; offsets [B, A] their positions relative to the root's (root = 0);
    mask [B, A, N + A] bool: which of the tree's N nodes and of the A aux nodes each aux
    node sees (besides the cached prefix; it always sees itself). Tree nodes never see aux
    nodes. The logits come back [B, A, V] as ``on_verified``'s ``aux_logits``.
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class DrafterContext:
    """What the engine lends a drafter: the target (its config, tokenizer, weights) and limits."""

    target: "LoadedModel"
    dtype: torch.dtype
    device: torch.device
    quantization: str | None = None  # weight format for a drafter's own network, as the target's


class Drafter(Protocol):
    """A drafting method. Rows of ``batch`` hold every committed token (prompt + output).

    Lifecycle: ``prefill`` for rows as they join (all of them at once in a static batch;
    one by one under continuous batching, always appended at the end), then each round
    ``propose`` → (target verifies) → ``on_verified`` after the accepted tokens are
    appended to the rows. ``select_rows`` drops finished, cancelled or preempted rows. A drafter with a KV cache rolls it back in
    ``on_verified``; the engine never looks inside.
    """

    Options: ClassVar[type]  # frozen dataclass of this method's speculative_config keys
    default_num_speculative_tokens: ClassVar[int]
    # Target layers whose residual stream this drafter reads (EAGLE, Medusa, ...; -1 = the
    # final normed hidden); () for drafters that need only tokens. The engine then hands
    # their features, concatenated over the layers in this order, to prefill / on_verified.
    hidden_layers: tuple[int, ...]
    # Optional (absent = False): True where a row's drafts depend on other requests' tokens
    # (suffix's global tree of finished outputs). Its output distribution stays the target's,
    # but a seeded sampled request then draws other random numbers under other traffic.
    learns_from_other_requests: bool

    def __init__(self, spec: "SpecConfig", ctx: DrafterContext) -> None: ...

    def max_draft_tokens(self, num_tokens: int) -> int:
        """The most draft tokens (chain length or tree nodes, root excluded) one round may
        propose when asked for ``num_tokens``: caches keep that much room past each row."""
        ...

    def prefill(self, batch: "Batch", rows: list[int], hidden: list[torch.Tensor] | None = None) -> None:
        """Set up state for ``rows``, the rows of ``batch`` that just joined (the last ones).
        ``hidden`` (when ``hidden_layers``): per joined row, the target's features [n, F] of
        its tokens but the newest (``token_ids[:-1]``), whose K/V the target cache holds."""
        ...

    def propose(self, batch: "Batch", num_tokens: int) -> Draft:
        """The round's draft, ``num_tokens`` deep (a tree: its depth). A drafter whose ``Options``
        take `LookupKeys` (lookup.py) also takes ``copies``: row b's copied draft ([] where this
        drafter drafts), for the wrapper that copies beside it."""
        ...

    def on_verified(
        self,
        batch: "Batch",
        num_accepted: torch.Tensor,
        aux_logits: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """After the round's tokens are appended. ``aux_logits`` [B, A, V]: the target's logits
        at the proposal's `AuxBranch` nodes, or None if it had none. ``hidden`` [B, W, F]
        (when ``hidden_layers``): the target's features at the tokens this round added to
        its cache, in order: the round's root, then the accepted drafts (row b's first
        ``num_accepted[b] + 1``; the emitted bonus token is the next round's root). With
        the features from ``prefill``, a drafter thus sees features for ``token_ids[:-1]``."""
        ...

    def select_rows(self, rows: list[int]) -> None: ...
