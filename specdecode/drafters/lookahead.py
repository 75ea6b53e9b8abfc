"""`lookahead`: Lookahead decoding (Fu et al. 2024): the target drafts for itself by Jacobi iteration.

Owns: the per-row 2-D lookahead window, the per-row n-gram pool, and turning pool hits
into a one-hot draft tree. Does not own: the target pass (engine/step.py runs the window
as an `AuxBranch` in the same forward pass that verifies the tree) or acceptance.

The paper's knobs, as ``speculative_config`` keys: W = ``lookahead_window`` (columns),
N = ``lookahead_ngram`` (n-gram size; the window has N-1 levels), G = ``lookahead_guess``
(the most pool n-grams verified per round).

Window. Level j (0..N-2), column i (0..W-1) sits at position root+1+i+j, where the root
is the row's newest committed token. Aux node (j, i) sees the root, level-0 columns
0..i and levels 1..j of column i: the contiguous positions root .. root+1+i+j, so it
reads as one Jacobi guess of a plain sequence. Levels are the last N-1 Jacobi iterates
of the window's last level, each shifted one position right per round (the paper's
"trajectory"). After the pass, O(j, i) = argmax of the target's logits at (j, i) (argmax
also under sampling, so drafts stay deterministic functions of the history and
verification stays lossless). For every column i the n-gram (level0[i], ...,
level_{N-2}[i], O(N-2, i)) goes into the pool, keyed by its first token. Then the
window shifts: levels 1..N-2 become levels 0..N-3 and O(N-2, ·) becomes level N-2. The
first N-2 rounds only fill the window: n-grams are collected once levels 1..N-2 hold
outputs (level 0, the key, may still be a seed token, as in LADE). A round that
accepts k guessed tokens moves the root k+1 positions; the window is kept as it is (its
guesses then sit k positions early), since a fresh one would cost N-2 filling rounds.

Seeding. The window starts as tokens drawn from the row's prompt by a generator seeded
with 0 (LADE's choice; deterministic, and no row sees another's prompt). With
``pool_from_prompt`` the pool starts with the prompt's n-grams; with
``pool_from_output`` every committed n-gram is added as it completes.

Pool: per key, at most G distinct (N-1)-token continuations, the most recently seen
kept (a repeat moves to the front). Proposal: the row's root's continuations, newest
first, cut to depth min(γ, N-1), merged into one trie of at most G·depth nodes
(siblings distinct, q = None). One round verifies 1 + G·depth tree nodes plus W·(N-1)
window nodes. Host cost: O(W·N) dict and list operations per row and round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from specdecode.config import MAX_SPECULATIVE_TOKENS, SpecConfig, SpecDecodeError, is_int
from specdecode.drafters.base import AuxBranch, Draft, DrafterContext
from specdecode.drafters.ngram import merge_into_tree
from specdecode.core.batch import Batch
from specdecode.core.sampling import argmax
from specdecode.core.tree import MAX_TREE_NODES, TreeBatch

WINDOW_SEED = 0  # the seed of the generator that draws each row's first window from its prompt


@dataclass(frozen=True)
class LookaheadOptions:
    """W, N, G as the paper names them, and where the n-gram pool is seeded from."""

    # Defaults for a target where each verified position costs (a CPU, a small batch): a narrow
    # window and a few long guesses; with verification near free, a wider W and more G may pay.
    lookahead_window: int = 2  # W: columns of the window
    lookahead_ngram: int = 5  # N: n-gram size; the window has N-1 levels
    lookahead_guess: int = 4  # G: pool n-grams verified per round (and kept per key)
    pool_from_prompt: bool = True  # start each row's pool with its prompt's n-grams
    pool_from_output: bool = True  # add each committed n-gram of the output to the pool

    def __post_init__(self) -> None:
        W, N, G = self.lookahead_window, self.lookahead_ngram, self.lookahead_guess
        for name, value, lo, hi in (("lookahead_window", W, 1, 64), ("lookahead_ngram", N, 2, 16),
                                    ("lookahead_guess", G, 1, 64)):  # fmt: skip
            if not is_int(value) or not lo <= value <= hi:
                raise SpecDecodeError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if (W + G) * (N - 1) > MAX_TREE_NODES:
            raise SpecDecodeError(
                f"lookahead verifies (lookahead_window + lookahead_guess) * (lookahead_ngram - 1) = "
                f"{(W + G) * (N - 1)} nodes per round, more than {MAX_TREE_NODES}"
            )
        for name in ("pool_from_prompt", "pool_from_output"):
            if not isinstance(getattr(self, name), bool):
                raise SpecDecodeError(f"{name} must be true or false, got {getattr(self, name)!r}")


def window_layout(W: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux node k = j·W + i is level j, column i. Returns offsets [A] (root = 0) and the
    aux-to-aux mask [A, A]: (j, i) sees level-0 columns 0..i and levels 1..j of column i."""
    level = torch.arange(N - 1).repeat_interleave(W)  # [A]
    col = torch.arange(W).repeat(N - 1)  # [A]
    offsets = 1 + level + col
    sees_level0 = (level[None, :] == 0) & (col[None, :] <= col[:, None])
    sees_own_column = (level[None, :] >= 1) & (level[None, :] <= level[:, None]) & (col[None, :] == col[:, None])
    return offsets, sees_level0 | sees_own_column


class NgramPool:
    """n-grams keyed by their first token: per key at most ``cap`` distinct continuations, newest last."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.entries: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        conts = self.entries.setdefault(key, [])
        if continuation in conts:
            conts.remove(continuation)
        conts.append(continuation)
        if len(conts) > self.cap:
            del conts[0]

    def add_sequence(self, tokens: list[int], n: int, start: int) -> int:
        """Add every n-gram of ``tokens`` starting at ``start`` or later; returns the next start."""
        for p in range(start, len(tokens) - n + 1):
            self.add(tokens[p], tuple(tokens[p + 1 : p + n]))
        return max(start, len(tokens) - n + 1)

    def guesses(self, key: int) -> list[tuple[int, ...]]:
        """The continuations of ``key``, newest first."""
        return self.entries.get(key, [])[::-1]

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())


@dataclass
class LookaheadStats:
    """Rounds by whether the pool had a guess for the root (summed over rows), and n-grams collected."""

    guessed: int = 0
    no_guess: int = 0
    collected: int = 0


class _Row:
    __slots__ = ("window", "pool", "rounds", "next_ngram")

    def __init__(self, prompt: list[int], options: LookaheadOptions) -> None:
        W, N = options.lookahead_window, options.lookahead_ngram
        rng = np.random.default_rng(WINDOW_SEED)
        self.window = rng.choice(np.asarray(prompt, dtype=np.int64), size=(N - 1, W))  # [N-1, W]
        self.pool = NgramPool(options.lookahead_guess)
        self.rounds = 0  # Jacobi steps taken
        start = max(0, len(prompt) - N + 1)  # the first n-gram that holds an output token
        self.next_ngram = self.pool.add_sequence(prompt, N, 0) if options.pool_from_prompt else start

    def step(self, last_level_out: np.ndarray, stats: LookaheadStats) -> None:
        """One Jacobi step: collect each column's n-gram ending in its new output, then shift the levels."""
        N = self.window.shape[0] + 1
        if self.rounds >= N - 2:
            for i, first in enumerate(self.window[0].tolist()):
                self.pool.add(first, (*self.window[1:, i].tolist(), int(last_level_out[i])))
            stats.collected += self.window.shape[1]
        self.window = np.concatenate([self.window[1:], last_level_out[None, :]])
        self.rounds += 1


class LookaheadDrafter:
    Options: ClassVar[type] = LookaheadOptions
    # γ caps the guesses' depth at min(γ, N-1); by default N alone decides.
    default_num_speculative_tokens: ClassVar[int] = MAX_SPECULATIVE_TOKENS
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, spec: SpecConfig, ctx: DrafterContext) -> None:
        self.options: LookaheadOptions = spec.options
        self.device = ctx.device
        o = self.options
        self.W, self.N, self.G = o.lookahead_window, o.lookahead_ngram, o.lookahead_guess
        offsets, mask = window_layout(self.W, self.N)
        self._offsets, self._aux_mask = offsets.to(self.device), mask.to(self.device)
        self.stats = LookaheadStats()
        self._rows: list[_Row] = []

    @property
    def num_aux(self) -> int:
        return self.W * (self.N - 1)

    def max_draft_tokens(self, num_tokens: int) -> int:
        return self.G * min(num_tokens, self.N - 1) + self.num_aux  # guesses + window nodes

    def prefill(self, batch: Batch, rows: list[int] | None = None, hidden: list[torch.Tensor] | None = None) -> None:
        """Start a window and a pool for ``rows``, the rows that just joined (the last ones);
        ``None``: every row of a new batch."""
        if rows is None:
            self._rows, rows = [], list(range(len(batch)))
        for r in rows:
            seq = batch.seqs[r]
            row = _Row(seq.token_ids[: seq.num_prompt], self.options)
            if self.options.pool_from_output:
                row.next_ngram = row.pool.add_sequence(seq.token_ids, self.N, row.next_ngram)
            self._rows.append(row)

    def propose(self, batch: Batch, num_tokens: int) -> Draft:
        depth = min(num_tokens, self.N - 1)
        budget = self.G * depth
        B = len(batch)
        node_tokens = np.full((B, budget + 1), -1, dtype=np.int64)  # [B, 1 + budget], node 0 = root
        node_parents = np.full((B, budget + 1), -1, dtype=np.int64)
        for b, (row, seq) in enumerate(zip(self._rows, batch.seqs)):
            root = seq.token_ids[-1]
            chains = [np.asarray(g[:depth], dtype=np.int64) for g in row.pool.guesses(root)[: self.G]]
            nodes, parents = merge_into_tree(chains, budget)
            node_tokens[b, : len(nodes) + 1] = [root, *nodes]
            node_parents[b, 1 : len(nodes) + 1] = parents
            if nodes:
                self.stats.guessed += 1
            else:
                self.stats.no_guess += 1
        width = int((node_parents >= 0).sum(axis=1).max()) + 1  # no row pays for another's guesses
        tree = TreeBatch.from_parents(
            torch.from_numpy(node_tokens[:, :width]).to(self.device),
            torch.from_numpy(node_parents[:, :width]).to(self.device),
        )
        return Draft.from_tree(tree, aux=self._aux_branch(width))

    def _aux_branch(self, num_nodes: int) -> AuxBranch:
        """The window as aux nodes behind a tree of ``num_nodes`` nodes: each sees the root (tree node 0)."""
        B, A = len(self._rows), self.num_aux
        windows = np.stack([row.window.reshape(-1) for row in self._rows])  # [B, A], level-major
        sees_tree = torch.zeros(A, num_nodes, dtype=torch.bool, device=self.device)
        sees_tree[:, 0] = True
        mask = torch.cat([sees_tree, self._aux_mask], dim=1)  # [A, num_nodes + A]
        return AuxBranch(
            tokens=torch.from_numpy(windows).to(self.device),
            offsets=self._offsets.expand(B, A),
            mask=mask.expand(B, A, num_nodes + A),
        )

    def on_verified(
        self, batch: Batch, num_accepted: torch.Tensor, aux_logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None
    ) -> None:
        if aux_logits is None:  # the engine ran without our window (not expected); keep it as it is
            return
        last_level = argmax(aux_logits[:, (self.N - 2) * self.W :]).cpu().numpy()  # [B, W]
        for row, out in zip(self._rows, last_level):
            row.step(out, self.stats)
        if self.options.pool_from_output:
            self._add_committed(batch)

    def _add_committed(self, batch: Batch) -> None:
        for row, seq in zip(self._rows, batch.seqs):
            row.next_ngram = row.pool.add_sequence(seq.token_ids, self.N, row.next_ngram)

    def select_rows(self, rows: list[int]) -> None:
        self._rows = [self._rows[r] for r in rows]
