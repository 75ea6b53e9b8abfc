"""`ngram`: prompt lookup decoding (model-free, deterministic: q is one-hot).

Finds the most recent earlier occurrence of the sequence's last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, longest first) in prompt + output,
and proposes the tokens that followed it (past the end of the sequence, on a loop, the
match's period repeated), with n as the proposal's evidence (an adaptive
budget counts acceptance by it). Costs a few vectorised numpy comparisons
per row and round. With ``max_matches > 1`` it merges the continuations of several
matches (longest n first, then most recent) into one tree of at most
``num_draft_tokens`` nodes; siblings are distinct, as one-hot tree verification needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from specdecode.config import SpecConfig, SpecDecodeError, is_int
from specdecode.drafters.base import Draft, DrafterContext
from specdecode.drafters.datastore import DEFAULT_MIN_PROB, Datastore, check_datastore_keys, fill_rows, open_datastore
from specdecode.core.batch import Batch, Sequence
from specdecode.core.tree import TreeBatch, check_node_budget


@dataclass(frozen=True)
class NgramOptions:
    # 2 and 5 when neither is given; one given alone moves the other's default to meet it where they
    # would cross (vLLM sets the missing one equal to the given one)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    max_matches: int = 1  # continuations merged into one tree; 1 = a chain
    num_draft_tokens: int | None = None  # tree node budget (SGLang's name); None = γ · max_matches
    # a row that finds no copy in its own text looks in a datastore of the target's answers (datastore.py;
    # a folder, or true = the one shipped for the target), matched on >= prompt_lookup_min tokens
    datastore: str | bool | None = None
    datastore_min_prob: float = DEFAULT_MIN_PROB

    def __post_init__(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not is_int(v) or v < 1):
                raise SpecDecodeError(f"{name} must be an integer >= 1, got {v!r}")
        if lo is None:
            lo = 2 if hi is None else min(2, hi)
        if hi is None:
            hi = max(5, lo)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if lo > hi:  # each is an integer >= 1 by now
            raise SpecDecodeError(
                f"ngram needs integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
        matches = self.max_matches
        if not is_int(matches) or not 1 <= matches <= 16:
            raise SpecDecodeError(f"max_matches must be an integer in [1, 16], got {self.max_matches!r}")
        budget = self.num_draft_tokens
        check_node_budget(budget)
        if budget is not None and matches == 1:  # a chain drafts γ tokens: the budget would be ignored
            raise SpecDecodeError("num_draft_tokens is the tree node budget: it needs max_matches > 1 "
                                  "(a chain drafts γ)")
        check_datastore_keys(self.datastore, self.datastore_min_prob, lo)
        if self.datastore and matches > 1:
            raise SpecDecodeError("datastore drafts chains: it needs max_matches 1")


def match_levels(tokens: np.ndarray, max_n: int) -> list[np.ndarray]:
    """``levels[n - 1]``: where the earlier matches of the last n tokens end (ascending), for n
    up to ``max_n`` and the longest that matches at all.

    Grows the match backwards from the earlier occurrences of the newest token, so each
    round compares only the candidates still matching: one pass over the sequence in all
    (a window comparison per n rescans the sequence once per n, which long prompts and a
    large ``prompt_lookup_max`` make dear)."""
    size = len(tokens)
    levels: list[np.ndarray] = []
    ends = np.flatnonzero(tokens[: size - 1] == tokens[-1]) if size >= 2 else np.empty(0, dtype=np.int64)
    while ends.size:
        levels.append(ends)
        n = len(levels)
        if n == max_n:
            break
        ends = ends[ends >= n]  # room for one more token before the match
        ends = ends[tokens[ends - n] == tokens[size - 1 - n]]
    return levels


def longest_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """(n, where its continuation starts) for the most recent earlier match of the longest
    suffix n-gram, n at most ``max_n``; (0, len) if no match reaches ``min_n``."""
    levels = match_levels(tokens, max_n)
    n = len(levels)
    return (n, int(levels[-1][-1]) + 1) if n >= min_n else (0, len(tokens))


def continuation(tokens: np.ndarray, start: int, k: int, n: int) -> np.ndarray:
    """The ``k`` tokens after a match of the last ``n`` tokens whose continuation starts at
    ``start``. Where they run into the end of the sequence and the match overlaps or adjoins the
    suffix it matched (its period, size - start, is at most n: the text already repeated for n + period
    tokens), the text is taken to go on repeating, as an LZ77 copy does: on a loop the draft runs
    all k tokens, not one period (vLLM's ngram stops at the end). A match further back is cut at
    the end as found: extending those drafted positions that were rarely accepted."""
    size = len(tokens)
    if start + k <= size or not 0 < size - start <= n:
        return tokens[start : start + k]
    return np.resize(tokens[start:], k)  # repeats cyclically


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram."""
    n, start = longest_match(tokens, min_n, max_n)
    return continuation(tokens, start, k, n)


def lookup_rows(seqs: list[Sequence], min_n: int, max_n: int, depths: list[int]) -> tuple[list[list[int]], list[int]]:
    """Per row of ``seqs``: up to ``depths[b]`` tokens that followed the most recent earlier match
    of its longest suffix n-gram ([] where none reaches ``min_n``, or its depth is 0), and that n
    (0 where it drafts nothing)."""
    chains, matched = [], []
    for seq, depth in zip(seqs, depths):
        tokens = np.asarray(seq.token_ids, dtype=np.int64)
        n, start = longest_match(tokens, min_n, max_n)
        chains.append(continuation(tokens, start, depth, n).tolist() if n and depth > 0 else [])
        matched.append(n if chains[-1] else 0)
    return chains, matched


def lookup_all(tokens: np.ndarray, min_n: int, max_n: int, k: int, max_matches: int) -> list[np.ndarray]:
    """Up to ``max_matches`` distinct continuations: longest suffix n-gram first, then most recent."""
    levels = match_levels(tokens, max_n)
    found: list[np.ndarray] = []
    seen: set[bytes] = set()
    for n in range(len(levels), min_n - 1, -1):
        for end in levels[n - 1][::-1]:
            cont = continuation(tokens, int(end) + 1, k, n)
            if cont.size and cont.tobytes() not in seen:
                seen.add(cont.tobytes())
                found.append(cont)
                if len(found) == max_matches:
                    return found
    return found


def merge_into_tree(chains: list[np.ndarray], budget: int) -> tuple[list[int], list[int]]:
    """A trie over ``chains`` (priority order) with at most ``budget`` draft nodes.

    Returns (tokens, parents) of the draft nodes, numbered from 1 (node 0 is the root).
    Parents come before children and earlier chains' branches before later ones.
    """
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for chain in chains:
        node = 0
        for t in chain.tolist():
            child = children.get((node, t))
            if child is None:
                if len(tokens) == budget:
                    break
                tokens.append(t)
                parents.append(node)
                child = children[(node, t)] = len(tokens)
            node = child
    return tokens, parents


class NgramDrafter:
    Options: ClassVar[type] = NgramOptions
    default_num_speculative_tokens: ClassVar[int] = 4
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, spec: SpecConfig, ctx: DrafterContext) -> None:
        self.options: NgramOptions = spec.options
        self.device = ctx.device
        store = spec.options.datastore
        self.store: Datastore | None = open_datastore(store, ctx.target) if store else None

    def max_draft_tokens(self, num_tokens: int) -> int:
        o = self.options
        return num_tokens if o.max_matches == 1 else o.num_draft_tokens or num_tokens * o.max_matches

    def prefill(self, batch: Batch, rows: list[int], hidden: list[torch.Tensor] | None = None) -> None:
        pass  # stateless: every proposal is computed from the rows' tokens

    def propose(self, batch: Batch, num_tokens: int) -> Draft:
        lo, hi = self.options.prompt_lookup_min, self.options.prompt_lookup_max
        if self.options.max_matches > 1:
            return self._propose_tree([np.asarray(seq.token_ids, dtype=np.int64) for seq in batch.seqs], num_tokens)
        # each row's n is its evidence: a longer match is likelier a copy (see Draft.evidence)
        chains, matched = lookup_rows(batch.seqs, lo, hi, [num_tokens] * len(batch))
        if self.store is not None:  # rows without a copy of their own text: the datastore's
            contexts, depths = [seq.token_ids for seq in batch.seqs], [num_tokens] * len(batch)
            fill_rows(self.store, contexts, chains, matched, depths, lo, self.options.datastore_min_prob)
        out = np.full((len(batch), num_tokens), -1, dtype=np.int64)
        for row, found in enumerate(chains):
            out[row, : len(found)] = found
        return Draft(tokens=torch.from_numpy(out).to(self.device), q=None, evidence=matched)

    def _propose_tree(self, rows: list[np.ndarray], depth: int) -> Draft:
        o = self.options
        budget = self.max_draft_tokens(depth)
        node_tokens = np.full((len(rows), budget + 1), -1, dtype=np.int64)  # [B, N], node 0 = root
        node_parents = np.full((len(rows), budget + 1), -1, dtype=np.int64)
        for row, tokens in enumerate(rows):
            chains = lookup_all(tokens, o.prompt_lookup_min, o.prompt_lookup_max, depth, o.max_matches)
            nodes, parents = merge_into_tree(chains, budget)
            node_tokens[row, : len(nodes) + 1] = [int(tokens[-1]), *nodes]
            node_parents[row, 1 : len(nodes) + 1] = parents
        width = int((node_parents >= 0).sum(axis=1).max()) + 1  # no row pays for another's budget
        tree = TreeBatch.from_parents(
            torch.from_numpy(node_tokens[:, :width]).to(self.device), torch.from_numpy(node_parents[:, :width]).to(self.device)
        )
        return Draft.from_tree(tree)

    def on_verified(
        self, batch: Batch, num_accepted: torch.Tensor, aux_logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None
    ) -> None:
        pass

    def select_rows(self, rows: list[int]) -> None:
        pass
