"""The one verifier: decide which draft tokens the target accepts, for every drafter.

Owns: lossless rejection sampling over a chain of drafts (`rejection_sample`, for any
drafter, with its probabilities q or with q = None for a deterministic drafter) and its
RNG-free special case for all-greedy batches (`greedy_verify`). Both return the same
thing: per row, the accepted draft tokens followed by one recovered or bonus token.
Does not own: turning logits into p and q (sampling.py), proposing drafts (drafters/),
or rolling back caches after a rejection (engine/).

Vocabulary as in vLLM: an *accepted* token is a draft token the target kept; a
*recovered* token replaces the first rejected draft; a *bonus* token follows when every
draft was accepted. Each row emits ``num_accepted + 1`` tokens per step.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from specdecode.sampling import fill_per_row, sample

# A residual max(0, p - q) with less mass than this is float noise (p == q up to
# rounding); the recovered token is then sampled from p itself. In exact arithmetic a
# rejection happens with probability equal to this mass, so the choice is immaterial.
RESIDUAL_EPS = 1e-6


def rejection_sample(
    p: Tensor,
    q: Tensor | None,
    draft_tokens: Tensor,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """Verify a chain of draft tokens against the target's probabilities, losslessly.

    Args:
        p: [B, γ+1, V] target probabilities, already through temperature / top-k / top-p.
            ``p[:, k]`` is the target's distribution for the token after draft k.
        q: [B, γ, V] draft probabilities under the same transforms, or ``None`` for a
            deterministic drafter (q_k one-hot at d_k).
        draft_tokens: [B, γ] int64. ``-1`` marks "no draft here": a row may propose fewer
            than γ tokens, and everything after its first -1 is padding too. Row b has
            n_b real drafts.
        generator: one generator for all rows, one per row (None entries = default RNG),
            or None. Row b consumes γ uniforms and V exponentials per call.

    Returns:
        output_tokens: [B, γ+1] int64; row b's tokens are ``output_tokens[b, :num_accepted[b] + 1]``,
            the rest is -1.
        num_accepted: [B] int64, in [0, n_b].

    The rule (Leviathan et al. 2023; Chen et al. 2023): for k = 1..n_b accept d_k with
    probability min(1, p_k(d_k) / q_k(d_k)). At the first rejection emit a *recovered*
    token from norm(max(0, p_k - q_k)) and stop. If all n_b drafts are accepted emit a
    *bonus* token from p_{n_b+1}. Every emitted token is then distributed exactly as
    sampling the target alone would give. With q = None the residual is p_k with d_k
    zeroed; with a one-hot (greedy) p the rule is "accept iff d_k is the argmax, else
    emit the argmax". A zero-probability token under p is never emitted.

    Example (V = 3, γ = 2, q = None)::

        p = [[[0, 1, 0], [0, 0, 1], [1, 0, 0]],     # row 0: greedy target
             [[0, 1, 0], [1, 0, 0], [0, 0, 1]]]     # row 1
        draft_tokens = [[1, 0],                     # d_1 accepted, d_2 rejected -> recovered 2
                        [1, -1]]                    # one real draft, accepted -> bonus from p[1, 1]
        rejection_sample(p, None, draft_tokens)
        # -> output_tokens [[1, 2, -1], [1, 0, -1]], num_accepted [1, 1]
    """
    B, gamma_plus_1, V = p.shape
    gamma = gamma_plus_1 - 1
    if draft_tokens.shape != (B, gamma):
        raise ValueError(f"draft_tokens must be [B, γ] = [{B}, {gamma}], got {list(draft_tokens.shape)}")
    if q is not None and q.shape != (B, gamma, V):
        raise ValueError(f"q must be [B, γ, V] = [{B}, {gamma}, {V}], got {list(q.shape)}")
    generators = _per_row(generator, B)
    rows = torch.arange(B, device=p.device)

    valid = (draft_tokens >= 0).cumprod(dim=1).bool()  # [B, γ] real drafts, padding after the first -1
    drafts = draft_tokens.clamp_min(0)  # [B, γ] safe to gather with
    p_draft = p[:, :gamma].gather(2, drafts[:, :, None])[:, :, 0].float()  # [B, γ] p_k(d_k)
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(2, drafts[:, :, None])[:, :, 0].float()  # [B, γ]

    # Accept iff u < p/q, written without a division: q(d) = 0 accepts whenever p(d) > 0,
    # p(d) = 0 never accepts, and 0 < q(d) <= p(d) accepts whatever u is (so greedy rows
    # are exact even if u rounds to 1).
    u = fill_per_row(torch.empty(B, gamma, device=p.device), generators, Tensor.uniform_)  # [B, γ]
    certain = (p_draft >= q_draft) & (p_draft > 0)  # [B, γ]
    accept = ((u * q_draft < p_draft) | certain) & valid  # [B, γ]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix
    num_drafts = valid.sum(dim=1)  # [B] n_b

    # The last token comes from p at the stop position: its residual if a draft was
    # rejected there (recovered), p itself if the row ran out of drafts (bonus).
    p_stop = p[rows, num_accepted].float()  # [B, V]
    rejected = num_accepted < num_drafts  # [B]
    stop_in_drafts = num_accepted.clamp_max(max(gamma - 1, 0))  # [B] a valid index into q / drafts
    if gamma == 0:
        residual = p_stop
    elif q is None:
        d_stop = drafts[rows, stop_in_drafts]  # [B]
        residual = p_stop.scatter(1, d_stop[:, None], 0.0)
    else:
        residual = (p_stop - q[rows, stop_in_drafts].float()).clamp_min_(0.0)
    use_residual = rejected & (residual.sum(dim=1) > RESIDUAL_EPS)  # [B]
    last = sample(torch.where(use_residual[:, None], residual, p_stop), generators)  # [B]

    positions = torch.arange(gamma + 1, device=p.device)  # [γ+1]
    return _assemble(draft_tokens, num_accepted, last, positions), num_accepted


def greedy_verify(target_argmax: Tensor, draft_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """`rejection_sample` for one-hot p, without RNG or [V]-sized work.

    target_argmax: [B, γ+1] int64, the argmax of p at each position; draft_tokens: [B, γ]
    int64, -1 padded. A draft is accepted iff it equals the target's argmax; the first
    mismatch (or the end of the row's drafts) emits the argmax there. Returns
    (output_tokens [B, γ+1] padded with -1, num_accepted [B]), as `rejection_sample`.
    """
    B, gamma_plus_1 = target_argmax.shape
    gamma = gamma_plus_1 - 1
    if draft_tokens.shape != (B, gamma):
        raise ValueError(f"draft_tokens must be [B, γ] = [{B}, {gamma}], got {list(draft_tokens.shape)}")
    valid = (draft_tokens >= 0).cumprod(dim=1).bool()  # [B, γ]
    match = (draft_tokens == target_argmax[:, :gamma]) & valid  # [B, γ]
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [B]
    last = target_argmax.gather(1, num_accepted[:, None])[:, 0]  # [B]
    positions = torch.arange(gamma + 1, device=target_argmax.device)  # [γ+1]
    return _assemble(draft_tokens, num_accepted, last, positions), num_accepted


def _assemble(draft_tokens: Tensor, num_accepted: Tensor, last: Tensor, positions: Tensor) -> Tensor:
    """[B, γ+1]: the accepted drafts, then ``last`` at index num_accepted, then -1."""
    padded = torch.cat([draft_tokens, draft_tokens.new_full((draft_tokens.shape[0], 1), -1)], dim=1)  # [B, γ+1]
    out = torch.where(positions[None, :] < num_accepted[:, None], padded, -1)  # [B, γ+1]
    return out.scatter_(1, num_accepted[:, None], last[:, None].to(out.dtype))


def _per_row(generator: torch.Generator | Sequence[torch.Generator | None] | None, B: int) -> list:
    """One generator (or None) per row."""
    if generator is None or isinstance(generator, torch.Generator):
        return [generator] * B
    generators = list(generator)
    if len(generators) != B:
        raise ValueError(f"need one generator per row: {B} rows, {len(generators)} generators")
    return generators
