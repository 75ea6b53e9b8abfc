"""Verification budgets: how many draft tokens each running request may verify this step.

Owns: the budget policy protocol, the fixed policy (every request its γ, as vLLM), and
cutting a proposal down to per-row budgets, and the chains a step's shadow rounds compare. The adaptive policy, which shrinks budgets
smoothly with load, is engine/adaptive.py's; the budget options of ``speculative_config``
are config.py's. Does not own: proposing (drafters/) or who runs at all (engine/serving.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from specdecode.core.batch import Batch
from specdecode.drafters.base import Draft
from specdecode.engine.acceptance import NOT_SHADOWED
from specdecode.core.tree import TreeBatch



class BudgetPolicy(Protocol):
    # whether planning on a proposal never gives a row more than the planning before it did (the
    # engine then samples a row's drafts past that plan from a scratch stream: Batch.draft_generators)
    plan_caps_proposal: bool

    def budgets(
        self, reqs: list[Any], limits: torch.Tensor, proposal: Draft | None = None
    ) -> torch.Tensor:
        """[B] draft tokens per running row this step, each in [0, limits[b]] (limits: what the
        drafter proposed, capped by each request's γ). ``proposal``: what the drafter proposed,
        when planning after it (its ``confidence``, a head's own estimates that each token is
        accepted given the earlier ones were, and its ``evidence``, where it has them); None
        when planning whether to propose at all."""
        ...

    def observe(
        self, reqs: list[Any], num_accepted: torch.Tensor, num_draft: torch.Tensor, seconds: float, draft_seconds: float,
        draft_depth: int = 1, proposal: torch.Tensor | None = None, positions: int | None = None,
    ) -> None:  # fmt: skip
        """What the step's verification accepted, per row, how long its target pass took, and how
        long proposing ``draft_depth`` tokens deep took (0 seconds when the step did not draft).
        ``proposal`` [B, w]: the chains proposed before budgets cut them, -1 padded, with rows of
        NOT_SHADOWED where matching the generated tokens is not acceptance (a sampled row's
        non-one-hot q); None when nothing was proposed or the proposal was a tree. ``positions``:
        what the pass verified where that is not the rows plus ``num_draft`` (a tree's nodes)."""
        ...

    def observe_prefill(self, seconds: float) -> None:
        """How long the step's prefill chunk took (0 when no prompt was being prefilled)."""
        ...

    def forget(self, request_id: str) -> None:
        """A request of this id is new (ids may be reused once a request has ended): drop what
        was learned about an earlier one."""
        ...

    def propose_first(self) -> bool:
        """Whether this step proposes before planning: for shadow rounds (a step where no row
        may verify drafts still proposes), or because planning on proposals has paid for them.
        Asked once at the start of each step; the policy keeps the answer until `observe`."""
        ...

    def lookahead(self) -> int:
        """Draft tokens to propose past the deepest budget: where a row accepts all its drafts,
        the bonus token shows whether the next proposed one would have survived."""
        ...


class FixedBudget:
    """Every request verifies its own γ each step, whatever the load."""

    plan_caps_proposal = True

    def __init__(self, max_verify_tokens: int | None = None) -> None:
        self.max_verify_tokens = max_verify_tokens

    def budgets(
        self, reqs: list[Any], limits: torch.Tensor, proposal: Draft | None = None
    ) -> torch.Tensor:
        if self.max_verify_tokens is None:
            return limits
        # an even cut, as a static per-step cap would do: each row gets the same share
        share = max(0, (self.max_verify_tokens - len(reqs)) // max(1, len(reqs)))
        return limits.clamp(max=share)

    def observe(
        self, reqs: list[Any], num_accepted: torch.Tensor, num_draft: torch.Tensor, seconds: float, draft_seconds: float,
        draft_depth: int = 1, proposal: torch.Tensor | None = None, positions: int | None = None,
    ) -> None:  # fmt: skip
        pass

    def observe_prefill(self, seconds: float) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def propose_first(self) -> bool:
        return False

    def lookahead(self) -> int:
        return 0


def apply_budgets(draft: Draft, budgets: torch.Tensor) -> Draft:
    """Cut each row's proposal to at most ``budgets[b]`` draft tokens along any path: a chain
    is truncated; a tree loses its nodes deeper than the budget. q and aux nodes are kept."""
    if draft.tree is None:
        keep = torch.arange(draft.tokens.shape[1], device=draft.tokens.device)[None, :] < budgets[:, None]
        return dataclasses.replace(draft, tokens=torch.where(keep, draft.tokens, -1))  # q, acceptance kept
    tree = draft.tree
    if bool((tree.depth <= budgets[:, None]).all()):
        return draft
    parents = torch.where(tree.depth <= budgets[:, None], tree.parents, -1)
    return Draft.from_tree(TreeBatch.from_parents(tree.tokens.clamp(min=0), parents), q=draft.q, aux=draft.aux)


def shadow_chains(proposed: Draft, batch: Batch) -> torch.Tensor | None:
    """[B, w] the proposed chains (before budgets), -1 padded, for the budget's shadow rounds;
    rows of NOT_SHADOWED where the generated tokens matching a draft is not its acceptance:
    a sampled row's draft whose q is not one-hot. None for trees and a drafter's own acceptance rule."""
    if proposed.tree is not None or proposed.acceptance is not None:
        return None
    if proposed.q is None:
        return proposed.tokens
    greedy = (batch.temperature == 0)[:, None]
    return torch.where(greedy, proposed.tokens, NOT_SHADOWED)
