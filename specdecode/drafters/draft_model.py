"""`draft_model`: a smaller checkpoint with the target's tokenizer drafts autoregressively.

Owns the draft model's own KV cache. Invariant between rounds: the draft cache holds a
prefix of each row's committed tokens; after verification it is rolled back to at most
``len(tokens) - 1`` (everything it holds up to there is known to match), and the next
``propose`` first feeds the committed tokens it has not seen (beside a lookup, a round where
every row copies its draft calls no ``propose``: lookup.py).

Chains (``topk = 1``) sample each draft token from q, which the verifier then uses.
Trees (``topk > 1``) grow EAGLE-2 style: each level expands the ``topk`` frontier nodes
with the highest cumulative draft log-probability by their ``topk`` likeliest tokens,
then the ``num_draft_tokens`` best nodes overall form the tree. Children are chosen
deterministically (distinct top-k tokens), so q is one-hot and the tree verifier's
multi-draft rule keeps it lossless. Tree nodes are never committed to the draft cache:
each level re-runs the frontier's ancestor paths as one masked block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specdecode.config import SpecConfig, SpecDecodeError, is_int
from specdecode.drafters.base import Draft, DrafterContext
from specdecode.drafters.draft_cache import DraftKVCache
from specdecode.drafters.draft_tree import fill_static_tree, grow_tree
from specdecode.drafters.lookup import LookupKeys, drafting_rows, tree_limits
from specdecode.core.batch import Batch, pad_right
from specdecode.cache.kv_cache import KVCache
from specdecode.model.loader import keeps_gguf_blocks, load_model
from specdecode.model.transformer import Transformer
from specdecode.core.logits_process import process_logits, row_states
from specdecode.core.sampling import argmax, logits_to_probs, sample
from specdecode.drafters.distill_net import DistillNet
from specdecode.core.tree import MAX_TREE_NODES, TreeShape, check_node_budget, parse_token_tree


@dataclass(frozen=True)
class DraftModelOptions(LookupKeys):
    model: str | None = None  # path or alias of the draft checkpoint
    topk: int = 1  # children per expanded node (SGLang's speculative_eagle_topk); 1 = a chain
    num_draft_tokens: int | None = None  # tree node budget (SGLang's name); None = γ · topk
    speculative_token_tree: str | list | None = None  # a static tree, as vLLM writes it: [(0,), (0, 0), (1,)]

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SpecDecodeError('draft_model needs "model": the path of a checkpoint with the target\'s tokenizer')
        self.check_shape()

    def check_shape(self) -> None:
        """The chain / tree and prompt-lookup options (shared with layer_skip, which drafts the same way)."""
        LookupKeys.__post_init__(self)
        if not is_int(self.topk) or not 1 <= self.topk <= 16:
            raise SpecDecodeError(f"topk must be an integer in [1, 16], got {self.topk!r}")
        budget = self.num_draft_tokens
        check_node_budget(budget)
        if self.speculative_token_tree is not None:
            if self.topk != 1 or budget is not None or self.num_steps is not None:  # its shape sets them
                raise SpecDecodeError("speculative_token_tree (a static tree) excludes topk, num_draft_tokens and "
                                      "num_steps")  # fmt: skip
            if parse_token_tree(self.speculative_token_tree).num_nodes - 1 > MAX_TREE_NODES:
                raise SpecDecodeError(f"speculative_token_tree has more than {MAX_TREE_NODES} nodes")


def check_same_vocab(target, draft, draft_path: str) -> None:
    """Refuse a draft whose vocabulary differs from the target's: its token ids would mean other things."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpecDecodeError(
            f"draft model {draft_path} has vocabulary size {draft.config.vocab_size}, "
            f"the target has {target.config.vocab_size}; they must share a tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise SpecDecodeError(f"draft model {draft_path} uses a different tokenizer vocabulary from the target")


class DraftModelDrafter:
    Options: ClassVar[type] = DraftModelOptions
    default_num_speculative_tokens: ClassVar[int] = 4
    hidden_layers: tuple[int, ...] = ()
    Net: ClassVar[type] = DistillNet  # the network `specdecode train --method draft_model` distils

    def __init__(self, spec: SpecConfig, ctx: DrafterContext) -> None:
        self.model = self.draft_network(spec, ctx)
        self.ctx = ctx
        self.gamma = spec.num_speculative_tokens
        self.topk: int = spec.options.topk
        self.steps: int = spec.options.steps(self.gamma)  # the model's depth (beside a lookup, γ is the lookup's)
        self.budget: int = spec.options.num_draft_tokens or self.steps * self.topk
        tree = spec.options.speculative_token_tree
        vocab = ctx.target.config.vocab_size  # the draft's too (check_same_vocab)
        self.static_tree: TreeShape | None = parse_token_tree(tree, vocab, self.gamma) if tree is not None else None
        self.cache = DraftKVCache(self.model)

    def draft_network(self, spec: SpecConfig, ctx: DrafterContext) -> Transformer:
        """The network that drafts: the checkpoint at ``model`` (layer_skip: the target's first layers)."""
        path = spec.options.model
        # a GGUF target's draft keeps its own GGUF blocks if it has them (and the target's
        # activations: "gguf-a8"), else runs dense
        quantization = ctx.quantization
        if quantization in ("gguf", "gguf-a8") and not keeps_gguf_blocks(path, ctx.device):
            quantization = None
        loaded = load_model(path, dtype=ctx.dtype, device=ctx.device, quantization=quantization)
        check_same_vocab(ctx.target, loaded, path)
        return loaded.model

    def max_draft_tokens(self, num_tokens: int) -> int:
        if self.topk == 1 and self.static_tree is None:
            return num_tokens
        return self.static_tree.num_nodes - 1 if self.static_tree is not None else self.budget

    def _feed(self, rows: list[list[int]], cache: KVCache) -> torch.Tensor:
        """Run the draft on each row's pending tokens and commit them in ``cache``; return logits
        [B, V] at each row's last. An empty row feeds a placeholder that it does not keep."""
        tokens, _ = pad_right([r or [0] for r in rows], self.ctx.device)
        lengths = torch.tensor([len(r) for r in rows], device=self.ctx.device)
        positions = cache.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        logits = self.model(tokens, positions, cache, logits_at=(lengths - 1).clamp(min=0)[:, None])  # [B, 1, V]
        cache.commit(lengths)
        return logits[:, 0]

    def prefill(self, batch: Batch, rows: list[int], hidden: list[torch.Tensor] | None = None) -> None:
        # Everything but the newest token, which the first propose feeds.
        with self.cache.only(self.cache.join_rows(len(rows))):
            self._feed([batch.seqs[r].token_ids[:-1] for r in rows], self.cache)

    def propose(self, batch: Batch, num_tokens: int, copies: list[list[int]] | None = None) -> Draft:
        roots = [s.token_ids[-1] for s in batch.seqs]
        depth = min(num_tokens, self.steps)
        seen = self.cache.lengths.tolist()
        logits = self._feed([s.token_ids[n:] for s, n in zip(batch.seqs, seen)], self.cache)
        if self.static_tree is not None:  # its own shape (a copying row's is replaced by its chain)
            return fill_static_tree(self._score_block, logits, roots, self.static_tree)
        if self.topk > 1:
            limits = tree_limits(copies, batch, depth)
            return grow_tree(self._score_block, logits, roots, depth, self.topk, self.budget, limits=limits)
        drafts, qs = [], []
        drafting = drafting_rows(copies, batch, self.ctx.device)  # None: every row
        alive = torch.ones(len(batch), dtype=torch.bool, device=self.ctx.device) if drafting is None else drafting
        # q as plain decoding would process p (penalties, bias, masks, grammar), each draft position
        # seeing the drafts before it: likelier drafts; exactness does not depend on it
        states = row_states(batch.seqs, self.ctx.target.config.eos_token_ids)
        # a copying row's draft cache takes its copy, not the model's scratch tokens: what it
        # accepts is kept as entries for the next round (the model's tokens there were stale)
        copied_ids = copied = None
        if drafting is not None and copies is not None:
            copied_ids, copied = pad_right([c[: depth - 1] for c in copies], self.ctx.device)
        for k in range(depth):
            if states is not None:
                so_far = torch.stack(drafts, dim=1).tolist() if drafts else [[]] * len(batch)
                logits = process_logits(logits, range(len(batch)), [[t for t in r if t >= 0] for r in so_far], states)
            if batch.all_greedy:  # one-hot q: the verifier needs no distribution
                token = argmax(logits)
            else:  # a lookup row's draws are scratch: its own stream is for its own drafts
                q = logits_to_probs(logits[:, None], batch.temperature, batch.top_k, batch.top_p, batch.min_p)
                q = q[:, 0]  # [B, V]
                token = sample(q, batch.draft_generators(k, drafting))
                qs.append(q)
            drafts.append(torch.where(alive, token, -1))
            if k + 1 == depth:
                break
            fed = token
            if copied_ids is not None and k < copied_ids.shape[1]:  # [B, <= depth - 1], [B]
                fed = torch.where(copied > k, copied_ids[:, k], token)
            logits = self._feed_one(fed)  # the last draft token is fed next round, if accepted
        q_all = torch.stack(qs, dim=1) if qs else None  # [B, γ, V]
        return Draft(tokens=torch.stack(drafts, dim=1), q=q_all)

    def _score_block(
        self, tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor, at: torch.Tensor, _states: None
    ) -> tuple[torch.Tensor, None]:
        """Logits [B, K, V] at ``at`` for a block of tree nodes (not committed: the next level re-runs them)."""
        positions = self.cache.lengths[:, None] + depths - 1  # the root sits at lengths - 1
        return self.model(tokens, positions, self.cache, block_mask=mask, logits_at=at), None

    def _feed_one(self, token: torch.Tensor) -> torch.Tensor:
        positions = self.cache.lengths[:, None]
        logits = self.model(token[:, None], positions, self.cache)  # [B, 1, V]
        self.cache.commit(torch.ones_like(self.cache.lengths))
        return logits[:, 0]

    def on_verified(
        self, batch: Batch, num_accepted: torch.Tensor, aux_logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None
    ) -> None:
        committed = torch.tensor([len(s.token_ids) - 1 for s in batch.seqs], device=self.cache.lengths.device)
        self.cache.truncate(committed)

    def select_rows(self, rows: list[int]) -> None:
        self.cache.select_rows(torch.tensor(rows, dtype=torch.long))
