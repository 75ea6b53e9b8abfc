"""The one verifier: decide which draft tokens the target accepts, for every drafter.

Owns: lossless rejection sampling over a chain of drafts (`rejection_sample`, for any
drafter, with its probabilities q or with q = None for a deterministic drafter) and its
RNG-free special case for all-greedy batches (`greedy_verify`); the same two for draft
trees (`tree_rejection_sample`, `tree_greedy_verify`), which also return the accepted
path's node indices. All return, per row, the accepted draft tokens followed by one
recovered or bonus token. Also the one LOSSY opt-in, Medusa's typical acceptance of a
chain (`typical_verify`, and `TypicalAcceptance`, the rule a drafter hands the engine with
its draft), which the engine flags on every request it decides.
Does not own: turning logits into p and q (sampling.py), proposing drafts (drafters/),
tree shapes and masks (tree.py), or rolling back caches after a rejection (engine/).

Vocabulary as in vLLM: an *accepted* token is a draft token the target kept; a
*recovered* token replaces the first rejected draft; a *bonus* token follows when every
draft was accepted. Each row emits ``num_accepted + 1`` tokens per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specdecode.core.sampling import fill_per_row, sample
from specdecode.core.tree import TreeBatch

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
            or None. Row b consumes n_b uniforms and V exponentials per call: what it
            draws does not depend on how wide other rows' drafts made the batch.

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
    num_drafts = valid.sum(dim=1)  # [B] n_b
    u = torch.zeros(B, gamma, device=p.device)  # [B, γ]; row b draws its n_b, whatever the batch's width
    fill_per_row(u, generators, Tensor.uniform_, num_drafts.tolist())
    certain = (p_draft >= q_draft) & (p_draft > 0)  # [B, γ]
    accept = ((u * q_draft < p_draft) | certain) & valid  # [B, γ]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix

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


def tree_rejection_sample(
    p: Tensor,
    q: Tensor | None,
    trees: TreeBatch,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Verify a draft tree per row against the target, losslessly (multi-draft rejection sampling).

    Args:
        p: [B, N, V] target probabilities, already through temperature / top-k / top-p.
            ``p[b, n]`` is the target's distribution for the token after node n (given
            the path root..n), i.e. the target pass's output at node n.
        q: [B, N, V], indexed by the *child*: ``q[b, n]`` is the distribution node n's token
            was drawn from, under the same transforms (``q[:, 0]`` and padding are
            ignored); or ``None`` for deterministic children (one-hot q at each token).
        trees: the batch of trees (`specdecode.core.tree.TreeBatch`), N nodes, max depth D.
        generator: as `rejection_sample`. Row b consumes n uniforms, n its real nodes
            past the root (one per node, in node order, padding skipped; for a chain tree
            of n drafts the same as the chain), and V exponentials per call.

    Returns:
        output_tokens: [B, D+1] int64: the accepted path's draft tokens, then one recovered
            or bonus token, then -1.
        num_accepted: [B] int64, the number of accepted drafts k (the path's depth).
        accepted_nodes: [B, D+1] int64: the path's node indices, root first (``[0, n_1, ..,
            n_k]``), then -1; `specdecode.core.tree.commit_paths` compacts the cache with it.

    The rule (SpecInfer, Miao et al. 2024; Sequoia, Chen et al. 2024): start at the root
    with the residual r = p[root]. Try its children in node order: child c with token x
    is accepted with probability min(1, r(x) / q_c(x)); on rejection r <- norm(max(0, r -
    q_c)) (for a deterministic child: r(x) <- 0, renormalised) and the next child is
    tried. On acceptance move to c with r = p[c] and repeat. When every child of the
    current node is rejected, emit a *recovered* token from the residual r; at a leaf
    reached by acceptance, a *bonus* token from p[leaf]. A chain tree is exactly
    `rejection_sample` (same uniforms, same exponentials: identical tokens per seed).

    Why it is lossless: at a node with residual r, the probability that child 1 is
    accepted with token y is min(r, q_1)(y), and it is rejected with probability m_1 =
    sum(max(0, r - q_1)), after which the new residual r_1 = max(0, r - q_1) / m_1 does
    not depend on which token was rejected. By induction over the remaining siblings
    (none left: sample from r_1), whatever comes next emits y with probability r_1(y), so
    in total min(r, q_1)(y) + max(0, r - q_1)(y) = r(y). Below an accepted child the
    same argument runs with r = p[child], the target's conditional after that token. So
    each emitted token follows the target given the tokens before it, *exactly when*:

    - q = None (one-hot): exact *given the tree*, whatever its tokens and shape and however
      they were chosen (top-k, n-gram lookups, greedy EAGLE-2 expansion and pruning, even
      a sampling drafter that does not report q), as long as the tree is fixed before
      verification. Siblings need not be distinct: a sibling repeating a rejected token has
      r(x) = 0 and is simply rejected (the slot is wasted, nothing is biased).
    - q given: q[b, c] must be the law node c's token was actually drawn from, given the
      nodes the drafter produced before it (ancestors, earlier siblings, anything with a
      smaller index); the shape may depend on those too, never on later nodes or on the
      target. So siblings drawn i.i.d. from one q with replacement, each passing that q,
      are exact (SpecInfer), and so are siblings drawn *without* replacement if each passes
      its conditional q (earlier siblings' tokens zeroed, renormalised: Sequoia's rule).
      A drafter mixing both passes one-hot rows of q for its deterministic nodes.
    - Not exact: siblings drawn without replacement but passed the unconditioned q;
      sampled nodes kept or pruned by scores of later nodes (e.g. a global top-N rerank of
      *sampled* candidates); q under other temperature / top-k / top-p than the drafter
      used. Acceptance is best when likelier children come first; losslessness does not
      depend on the order.

    As `rejection_sample`: a token with p = 0 is never emitted (the residual's support
    stays within p's), and a residual with mass <= `RESIDUAL_EPS` is float noise, so the
    node's p is used from there on (in exact arithmetic that state has probability equal
    to the mass). Work: one [B, V] update per sibling slot and depth (sum of
    ``trees.fanout`` steps), no per-row Python.
    """
    B, N, V = p.shape
    if tuple(trees.tokens.shape) != (B, N):
        raise ValueError(f"trees must be [B, N] = [{B}, {N}] to match p, got {list(trees.tokens.shape)}")
    if q is not None and q.shape != (B, N, V):
        raise ValueError(f"q must be [B, N, V] = [{B}, {N}, {V}], got {list(q.shape)}")
    generators = _per_row(generator, B)
    rows = torch.arange(B, device=p.device)
    depth = trees.max_depth
    tokens = trees.tokens.clamp_min(0)  # [B, N] safe to gather with
    # one uniform per real node, in node order: a tree with gaps (a budget cut deeper nodes out of
    # a wider proposal) draws what the same tree without them draws, so a seeded row's numbers
    # do not depend on the padding other rows' depths left in its numbering
    rank = trees.valid.long().cumsum(dim=1) - 1  # [B, N] node c's place among the row's real nodes (root 0)
    u = torch.zeros(B, N - 1, device=p.device)  # [B, N-1]: real node c's at rank[c] - 1
    fill_per_row(u, generators, Tensor.uniform_, rank[:, -1].tolist())

    cur = torch.zeros(B, dtype=torch.long, device=p.device)  # [B] the node each row stands on
    residual = p[:, 0].float()  # [B, V] unnormalised; its true law is residual / mass
    mass = torch.ones(B, device=p.device)  # [B] exactly 1 at a freshly reached node
    searching = torch.ones(B, dtype=torch.bool, device=p.device)  # [B] still accepting children
    accepted_nodes = torch.full((B, depth + 1), -1, dtype=torch.long, device=p.device)
    accepted_nodes[:, 0] = 0
    for d in range(depth):
        p_here = p[rows, cur].float()  # [B, V] the fallback when a residual is float noise
        moved = torch.zeros_like(searching)
        nxt = cur
        for k in range(trees.fanout[d]):
            child = trees.children[rows, cur, k]  # [B], -1 where cur has fewer children
            trying = searching & ~moved & (child >= 0)
            c = child.clamp_min(0)
            x = tokens[rows, c]  # [B]
            r_x = residual.gather(1, x[:, None])[:, 0]  # [B] mass * r(x)
            if q is None:
                bound = mass  # mass * q_c(x), q_c one-hot at x
                rest = residual.scatter(1, x[:, None], 0.0)
            else:
                q_c = q[rows, c].float()  # [B, V]
                bound = q_c.gather(1, x[:, None])[:, 0] * mass
                rest = (residual - mass[:, None] * q_c).clamp_min_(0.0)
            # accept iff u < r(x) / q_c(x), division-free as in rejection_sample
            certain = (r_x >= bound) & (r_x > 0)
            accept = trying & ((u[rows, (rank[rows, c] - 1).clamp_min(0)] * bound < r_x) | certain)
            reject = trying & ~accept
            rest_mass = rest.sum(dim=1)  # [B]
            noise = rest_mass <= RESIDUAL_EPS
            rest = torch.where(noise[:, None], p_here, rest)
            rest_mass = torch.where(noise, 1.0, rest_mass)
            residual = torch.where(reject[:, None], rest, residual)
            mass = torch.where(reject, rest_mass, mass)
            moved = moved | accept
            nxt = torch.where(accept, child, nxt)
        cur = nxt
        residual = torch.where(moved[:, None], p[rows, cur].float(), residual)
        mass = torch.where(moved, 1.0, mass)
        accepted_nodes[:, d + 1] = torch.where(moved, cur, -1)
        searching = searching & moved
    num_accepted = (accepted_nodes >= 0).sum(dim=1) - 1  # [B]
    last = sample(residual, generators)  # [B] recovered from the residual, or bonus from p[leaf]
    return _assemble_path(tokens, accepted_nodes, num_accepted, last), num_accepted, accepted_nodes


def tree_greedy_verify(target_argmax: Tensor, trees: TreeBatch) -> tuple[Tensor, Tensor, Tensor]:
    """`tree_rejection_sample` for one-hot p, without RNG or [V]-sized work.

    target_argmax: [B, N] int64, the target's argmax at each node. A node matches iff its
    token is the argmax at its parent; the row accepts the longest root path whose nodes
    all match (ties: the path ending at the smallest node index) and then emits the
    argmax at that path's end. Every such path yields the greedy continuation, so the
    choice is lossless; with distinct sibling tokens there is at most one matching path
    and the result equals `tree_rejection_sample` with one-hot p (with a repeated sibling
    token this may accept a longer path than trying siblings in order would). A chain tree
    gives `greedy_verify`. Returns (output_tokens [B, D+1], num_accepted [B],
    accepted_nodes [B, D+1]) as `tree_rejection_sample`.
    """
    B, N = target_argmax.shape
    if tuple(trees.tokens.shape) != (B, N):
        raise ValueError(f"trees must be [B, N] = [{B}, {N}] to match target_argmax, got {list(trees.tokens.shape)}")
    device = target_argmax.device
    rows = torch.arange(B, device=device)
    node = torch.arange(N, device=device)
    depth = trees.max_depth
    argmax_at_parent = target_argmax.gather(1, trees.parents.clamp_min(0))  # [B, N]
    matches = ((trees.tokens == argmax_at_parent) & trees.valid) | (node == 0)[None, :]  # [B, N]
    reachable = ~(trees.mask & ~matches[:, None, :]).any(dim=2)  # [B, N]: the node and its ancestors match
    key = torch.where(reachable, trees.depth * N + (N - 1 - node)[None, :], -1)  # deepest, then first
    best = key.argmax(dim=1)  # [B]
    on_path = trees.mask[rows, best]  # [B, N] the ancestors of best, and best
    num_accepted = trees.depth[rows, best]  # [B]
    slot = torch.where(on_path, trees.depth, depth + 1)  # [B, N] the path position of each node
    accepted_nodes = torch.full((B, depth + 2), -1, dtype=torch.long, device=device)
    accepted_nodes.scatter_(1, slot, torch.where(on_path, node[None, :], -1).expand(B, N))
    accepted_nodes = accepted_nodes[:, : depth + 1]
    last = target_argmax[rows, best]  # [B]
    tokens = trees.tokens.clamp_min(0)
    return _assemble_path(tokens, accepted_nodes, num_accepted, last), num_accepted, accepted_nodes


def _assemble_path(tokens: Tensor, accepted_nodes: Tensor, num_accepted: Tensor, last: Tensor) -> Tensor:
    """[B, D+1]: the tokens of the accepted drafts (path minus root), then ``last``, then -1."""
    drafts = tokens.gather(1, accepted_nodes[:, 1:].clamp_min(0))  # [B, D]
    drafts = torch.where(accepted_nodes[:, 1:] >= 0, drafts, -1)
    positions = torch.arange(accepted_nodes.shape[1], device=tokens.device)  # [D+1]
    return _assemble(drafts, num_accepted, last, positions)


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


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance with its (ε, δ), as a draft carries it (`Draft.acceptance`):
    the engine calls it in place of rejection sampling. LOSSY: the engine flags the requests."""

    posterior_threshold: float  # ε
    posterior_alpha: float  # δ
    lossy = True

    def __call__(
        self, p: Tensor, draft_tokens: Tensor, generator: Sequence[torch.Generator | None] | None = None
    ) -> tuple[Tensor, Tensor]:
        return typical_verify(p, draft_tokens, self.posterior_threshold, self.posterior_alpha, generator)


def typical_verify(
    p: Tensor,
    draft_tokens: Tensor,
    threshold: float,
    alpha: float,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """Medusa's typical acceptance of a chain (Cai et al. 2024). LOSSY: opt-in only.

    p: [B, γ+1, V] target probabilities (after temperature / top-k / top-p);
    draft_tokens: [B, γ] int64, -1 padded. Draft d_k is accepted while
    ``p_k(d_k) > min(threshold, alpha · exp(-H(p_k)))`` (ε and δ in the paper); at the
    first rejected position, or after the last draft, one token is sampled from p there.
    Returns (output_tokens [B, γ+1] padded with -1, num_accepted [B]), as
    `rejection_sample`. Unlike it, the output does *not* follow the target's
    distribution (likely-enough drafts are kept more often than the target would emit
    them); for a one-hot (greedy) p it equals `greedy_verify`. Row b consumes V
    exponentials per call.
    """
    B, gamma_plus_1, _ = p.shape
    gamma = gamma_plus_1 - 1
    if draft_tokens.shape != (B, gamma):
        raise ValueError(f"draft_tokens must be [B, γ] = [{B}, {gamma}], got {list(draft_tokens.shape)}")
    generators = _per_row(generator, B)
    rows = torch.arange(B, device=p.device)
    p = p.float()
    valid = (draft_tokens >= 0).cumprod(dim=1).bool()  # [B, γ]
    p_draft = p[:, :gamma].gather(2, draft_tokens.clamp_min(0)[:, :, None])[:, :, 0]  # [B, γ] p_k(d_k)
    entropy = torch.special.entr(p[:, :gamma]).sum(dim=-1)  # [B, γ] H(p_k) in nats
    bound = torch.clamp(alpha * torch.exp(-entropy), max=threshold)  # [B, γ]
    accept = (p_draft > bound) & valid  # [B, γ]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    last = sample(p[rows, num_accepted], generators)  # [B] from the target at the stop position
    positions = torch.arange(gamma + 1, device=p.device)  # [γ+1]
    return _assemble(draft_tokens, num_accepted, last, positions), num_accepted
