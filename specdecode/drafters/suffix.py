"""`suffix`: SuffixDecoding (Arctic Inference's model-free drafter; vLLM's ``method: suffix``).

Each row keeps a suffix tree over its own prompt + output, built at `prefill` and
extended in `on_verified` with the committed tokens. One *global* tree, shared by every
`generate` call of the drafter's lifetime, holds the outputs of earlier finished
requests (at most ``suffix_decoding_max_cached_requests``; roughly least recently used
evicted, see `GlobalCache`; vLLM evicts first in, first out).
Each round, per row and per tree: find the longest suffix of the context that occurred
before with a continuation, grow a proposal tree below it by estimated path probability
(`suffix_tree.speculate`), with a node budget ``min(γ, max_spec_factor × match length)``
(the draft grows as the match does) and nodes kept while their probability is >=
``min_token_prob``; propose the better-scoring of the two trees. Deterministic (q is
one-hot). Trees come out as a `TreeBatch`, or as plain chains when every row's tree is one.

Costs per row and round: a few dozen dict look-ups to match, at most three expansions
of <= γ nodes per tree, and ``max_tree_depth`` look-ups per committed token (small against
a target step). Inserting a prompt costs ``max_tree_depth`` look-ups per token too, so a
long prompt at a large depth takes a noticeable time to insert. Memory: the tries are
uncompressed Python objects, kilobytes per cached token of novel text at depth 24, and the
cap counts requests, not tokens: at the default 10000, long outputs can reach tens of GB.
Lower the cap where memory matters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from specdecode.config import SpecConfig, SpecDecodeError, is_int, is_real
from specdecode.drafters.base import Draft, DrafterContext
from specdecode.drafters.suffix_tree import GlobalCache, Node, Speculation, SuffixTree, best_speculation, state_match_nodes
from specdecode.core.batch import Batch
from specdecode.core.tree import TreeBatch


@dataclass(frozen=True)
class SuffixOptions:
    """vLLM's keys. The tree depth bounds match length + draft depth together."""

    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000  # 0 disables the global tree
    suffix_decoding_max_spec_factor: float = 1.0  # draft tokens per matched token
    suffix_decoding_min_token_prob: float = 0.1  # keep a node if its estimated path probability is >= this

    def __post_init__(self) -> None:
        depth, cached = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not is_int(depth) or not 2 <= depth <= 1024:
            raise SpecDecodeError(f"suffix_decoding_max_tree_depth must be an integer in [2, 1024], got {depth!r}")
        if not is_int(cached) or cached < 0:
            raise SpecDecodeError(f"suffix_decoding_max_cached_requests must be an integer >= 0, got {cached!r}")
        if not is_real(factor) or not math.isfinite(factor) or factor <= 0:
            raise SpecDecodeError(f"suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        if not is_real(prob) or not math.isfinite(prob) or not 0 <= prob <= 1:
            raise SpecDecodeError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}")


@dataclass
class SuffixStats:
    """Rounds by where each row's proposal came from (summed over rows)."""

    local: int = 0  # the row's own prompt + output
    global_: int = 0  # earlier requests' outputs
    none: int = 0  # no match: the row proposed only its root


class _Row:
    __slots__ = ("tree", "state", "seen", "cached")

    def __init__(self, tokens: list[int], max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.state: list[Node] = self.tree.extend([], tokens)
        self.seen = len(tokens)  # tokens already in the tree
        self.cached = False  # output already given to the global cache


class SuffixDrafter:
    Options: ClassVar[type] = SuffixOptions
    # The node budget per round. At the default depth 24 and factor 1 a chain is at most
    # 12 deep (12 matched + 12 drafted); the extra room lets longer matches draft bushier
    # trees, at the price of a wider verify pass where verification is not free (a CPU target).
    default_num_speculative_tokens: ClassVar[int] = 24
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, spec: SpecConfig, ctx: DrafterContext) -> None:
        self.options: SuffixOptions = spec.options
        self.device = ctx.device
        self.max_depth = self.options.suffix_decoding_max_tree_depth
        self.cache = GlobalCache(self.max_depth, self.options.suffix_decoding_max_cached_requests)
        self.learns_from_other_requests = self.options.suffix_decoding_max_cached_requests > 0
        self.stats = SuffixStats()
        self._rows: list[_Row] = []

    def max_draft_tokens(self, num_tokens: int) -> int:
        return num_tokens  # the node budget never exceeds γ

    def prefill(self, batch: Batch, rows: list[int], hidden: list[torch.Tensor] | None = None) -> None:
        self._rows += [_Row(batch.seqs[r].token_ids, self.max_depth) for r in rows]

    def propose(self, batch: Batch, num_tokens: int) -> Draft:
        specs = [self._speculate(row, seq.token_ids, num_tokens) for row, seq in zip(self._rows, batch.seqs)]
        roots = [seq.token_ids[-1] for seq in batch.seqs]
        if all(s.is_chain for s in specs):
            width = max(len(s.tokens) for s in specs)
            chains = np.full((len(specs), width), -1, dtype=np.int64)
            for b, s in enumerate(specs):
                chains[b, : len(s.tokens)] = s.tokens
            return Draft(tokens=torch.from_numpy(chains).to(self.device))
        width = 1 + max(len(s.tokens) for s in specs)
        tokens = np.full((len(specs), width), -1, dtype=np.int64)
        parents = np.full((len(specs), width), -1, dtype=np.int64)
        for b, (s, root) in enumerate(zip(specs, roots)):
            tokens[b, : len(s.tokens) + 1] = [root, *s.tokens]
            parents[b, 1 : len(s.parents) + 1] = s.parents
        tree = TreeBatch.from_parents(torch.from_numpy(tokens).to(self.device), torch.from_numpy(parents).to(self.device))
        return Draft.from_tree(tree)

    def _speculate(self, row: _Row, context: list[int], cap: int) -> Speculation:
        o = self.options
        args = (self.max_depth, cap, o.suffix_decoding_max_spec_factor, o.suffix_decoding_min_token_prob)
        local = best_speculation(state_match_nodes(row.state, self.max_depth), *args)
        if len(self.cache):
            glob = best_speculation(self.cache.tree.match_nodes(context[-self.max_depth :]), *args)
            if glob.score > local.score:
                self.stats.global_ += 1
                self.cache.touch(glob.node.owner)
                return glob
        if local.tokens:
            self.stats.local += 1
        else:
            self.stats.none += 1
        return local

    def on_verified(
        self, batch: Batch, num_accepted: torch.Tensor, aux_logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None
    ) -> None:
        for b, seq in enumerate(batch.seqs):
            row = self._rows[b]
            if len(seq.token_ids) < row.seen:  # committed tokens only grow today; rebuild if not
                row = self._rows[b] = _Row(seq.token_ids, self.max_depth)
            row.state = row.tree.extend(row.state, seq.token_ids[row.seen :])
            row.seen = len(seq.token_ids)
            if seq.finish_reason is not None and not row.cached:
                self.cache.add(seq.output_ids)
                row.cached = True

    def select_rows(self, rows: list[int]) -> None:
        self._rows = [self._rows[r] for r in rows]
