"""`eagle`: feature-level autoregressive drafting (EAGLE-1, EAGLE-2 trees).

Owns: drafting rounds with a `FeatureNet` (eagle_net.py): its KV cache, the target
features it is owed, chains and dynamic trees. `eagle3` and `mtp` (eagle3.py, mtp.py)
are this drafter with another net.

Invariant between rounds: the net's cache holds one entry per target feature received
(entry t = feature of token t + embedding of token t+1, see eagle_net.py); features
arrive with ``prefill`` and ``on_verified`` and are fed at the next ``propose`` in which the
net drafts for some row (a round where every row copies its draft leaves them pending). A round's
draft entries are scratch: ``on_verified`` truncates them, and the accepted tokens are
re-fed with the target's true features, as EAGLE does.

Chains (``topk = 1``) sample d_k from q_k (the net's distribution over its draft
vocabulary, after the target's temperature / top-k / top-p; 0 outside the vocabulary),
which the verifier uses. Trees (``topk > 1``) grow EAGLE-2 style (draft_tree.grow_tree):
each node's entry takes its parent's output feature; children are the top-k tokens, so
q is one-hot and the tree verifier's multi-draft rule keeps it lossless. With
``confidence_threshold`` a chain row drafts no further after a token its net gave less than
that probability: the stop reads only the drafts, so the output stays the target's.
Under an adaptive budget a chain also reports each token's confidence: the net's confidence
head where it has one, else that same draft probability.

With ``prompt_lookup_max`` rows whose recent tokens occurred before draft the copy instead
(lookup.py's wrapper): the net drafts the others (``copies``), ``num_steps`` deep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specdecode.config import SpecConfig, SpecDecodeError, is_int
from specdecode.drafters.base import Draft, DrafterContext
from specdecode.drafters.draft_cache import DraftKVCache
from specdecode.drafters.draft_tree import grow_tree
from specdecode.drafters.draft_vocab import check_confidence_threshold
from specdecode.drafters.eagle_net import FeatureNet
from specdecode.drafters.learned import PendingFeatures, load_net, resolve_weights
from specdecode.drafters.lookup import LookupKeys, drafting_rows, tree_limits
from specdecode.core.batch import Batch, Sequence, pad_right
from specdecode.core.logits_process import row_states
from specdecode.core.tree import check_node_budget


@dataclass(frozen=True)
class EagleOptions(LookupKeys):
    model: str | None = None  # folder from `specdecode train`; None = the weights shipped for this target
    topk: int = 1  # children per expanded node; 1 = a chain
    num_draft_tokens: int | None = None  # tree node budget; None = γ · topk
    # chains: draft no further after a token whose draft probability is below this (Hugging Face's
    # assistant_confidence_threshold: that token is still proposed); 0 = always draft γ
    confidence_threshold: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()  # the prompt-lookup keys (lookup.py)
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise SpecDecodeError(f"model must be a folder path, got {self.model!r}")
        if not is_int(self.topk) or not 1 <= self.topk <= 16:
            raise SpecDecodeError(f"topk must be an integer in [1, 16], got {self.topk!r}")
        check_node_budget(self.num_draft_tokens)
        check_confidence_threshold(self.confidence_threshold)
        if self.confidence_threshold > 0 and self.topk > 1:
            raise SpecDecodeError("confidence_threshold applies to chains (topk = 1); trees rank by confidence already")


class EagleDrafter:
    Options: ClassVar[type] = EagleOptions
    Net: ClassVar[type[FeatureNet]] = FeatureNet
    # with the shipped nets a second draft token pays less than its draft step and verified position
    # cost (`specdecode bench --methods` with two num_speculative_tokens compares them); a stronger
    # drafter may go deeper, with confidence_threshold
    default_num_speculative_tokens: ClassVar[int] = 1

    def __init__(self, spec: SpecConfig, ctx: DrafterContext) -> None:
        path = resolve_weights(self.Net.method, spec.options.model, ctx.target)
        self.net: FeatureNet = load_net(self.Net, path, ctx.target.model, ctx.dtype, ctx.device, ctx.quantization)
        self.hidden_layers: tuple[int, ...] = self.net.hidden_layers
        self.vocab_size = ctx.target.config.vocab_size
        self.eos_ids = ctx.target.config.eos_token_ids
        self.device = ctx.device
        self.gamma = spec.num_speculative_tokens
        self.topk: int = spec.options.topk
        self.steps: int = spec.options.steps(self.gamma)  # the net's depth (beside a lookup, γ is the lookup's)
        self.budget: int = spec.options.num_draft_tokens or self.steps * self.topk
        self.threshold: float = float(spec.options.confidence_threshold)
        # an adaptive budget plans on per-token confidences: a trained head's, else the draft's own
        # probability of its token (benchmarks/bench_confidence.py measures its calibration)
        self.report_confidence: bool = spec.budget.adaptive
        self.pending = PendingFeatures()
        self.cache = DraftKVCache(self.net.body)

    def max_draft_tokens(self, num_tokens: int) -> int:
        return num_tokens if self.topk == 1 else self.budget

    def prefill(self, batch: Batch, rows: list[int], hidden: list[torch.Tensor] | None = None) -> None:
        assert hidden is not None, "eagle reads the target's features"
        ids = self.cache.join_rows(len(rows))
        self.pending.add_rows(hidden)
        # Feed the prompt's entries now (the engine has sampled the first token, each entry's
        # next token is known), all but each row's last, whose output gives the first proposal's
        # logits: the first proposal then costs what later ones do. Fed there, a prompt would
        # make it cost about a plain step, and an adaptive budget, which prices drafting from
        # what proposals cost, could find drafting too dear to pay for a whole request.
        early = [i for i in range(len(rows)) if len(hidden[i]) > 1]
        if early:
            features, starts = self.pending.take([rows[i] for i in early], leave=1)
            with self.cache.only([ids[i] for i in early]):
                self._feed([batch.seqs[rows[i]] for i in early], features, starts)

    def _feed_pending(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row's owed (feature, next token) entries and commit them; returns the
        draft-vocabulary logits [B, Vd] and output feature [B, H] at each row's last entry."""
        features, starts = self.pending.take()
        if min(len(f) for f in features) < 1:
            raise RuntimeError("eagle: propose called twice without on_verified")
        return self._feed(batch.seqs, features, starts)

    def _feed(
        self, seqs: list[Sequence], features: list[torch.Tensor], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the cache's rows their entries (features [n_b, F] from feature index starts[b],
        each with the token after it), commit them; the logits and output feature at each
        row's last entry."""
        lengths = [len(f) for f in features]
        net = self.net
        states = net.fuse(torch.nn.utils.rnn.pad_sequence(features, batch_first=True))  # [B, n, H]
        tokens, _ = pad_right(
            [s.token_ids[start + 1 : start + 1 + n] for s, start, n in zip(seqs, starts, lengths)], self.device
        )
        positions = self.cache.lengths[:, None] + torch.arange(tokens.shape[1], device=self.device)
        at = torch.tensor(lengths, device=self.device)[:, None] - 1
        logits, out = net(states.to(net.body.norm.weight.dtype), tokens, positions, self.cache, logits_at=at)
        self.cache.commit(at[:, 0] + 1)
        return logits[:, 0], out[:, 0]

    def propose(self, batch: Batch, num_tokens: int, copies: list[list[int]] | None = None) -> Draft:
        # Every row's owed features, copying rows' too: the cache stays whole. In rounds where every
        # row copies (propose is not called) they wait, and are fed here in one pass: each entry's
        # output is the same, the fused block computes every token alone.
        logits, out = self._feed_pending(batch)
        depth = min(num_tokens, self.steps)
        if self.topk > 1:
            roots = [s.token_ids[-1] for s in batch.seqs]
            return grow_tree(self._score_block, logits, roots, depth, self.topk, self.budget, root_states=out,
                             vocab_ids=self.net.head.vocab_ids, limits=tree_limits(copies, batch, depth))  # fmt: skip
        return self._chain(batch, logits, out, depth, drafting_rows(copies, batch, self.device))

    def _chain(
        self, batch: Batch, logits: torch.Tensor, out: torch.Tensor, depth: int, alive: torch.Tensor | None
    ) -> Draft:
        """The net's chains, ``depth`` long, for the rows ``alive`` [B] (the others' are -1; None:
        every row)."""
        drafts, qs, confs = [], [], []
        states = row_states(batch.seqs, self.eos_ids)  # q processed as p is (penalties, masks, grammar)
        head_confidence = self.report_confidence and self.net.confidence is not None
        own_confidence = self.report_confidence and self.net.confidence is None  # the draft probability instead
        stoppable = self.threshold > 0 or alive is not None  # else every row drafts on: no device syncs
        if alive is None:
            alive = torch.ones(len(batch), dtype=torch.bool, device=self.device)
        for k in range(depth):
            if head_confidence:  # from the feature that gives d_k's logits
                confs.append(torch.sigmoid(self.net.confidence(out).float())[:, 0])
            q = None
            prior = [[t for t in row if t >= 0] for row in torch.stack(drafts, 1).tolist()] if drafts and states else None
            if batch.all_greedy:  # one-hot q: the verifier needs no distribution
                token = self.net.head.greedy(logits[:, None], self.vocab_size, states, prior)[:, 0]
            else:  # a stopped (or lookup) row's draws are scratch: its own stream is for its own drafts
                drafting = alive if stoppable else None
                token, q = self.net.head.sample(logits[:, None], batch, self.vocab_size, k, drafting, states, prior)
                token, q = token[:, 0], q[:, 0]  # [B], [B, V]
                qs.append(q)
            token = torch.where(alive, token, -1)
            drafts.append(token)
            if own_confidence or self.threshold > 0:
                q_k = None if q is None else q[:, None]  # [B, 1, V]
                own = self.net.head.own_probability(logits[:, None], token[:, None], q_k, batch)[:, 0]  # [B]
                if own_confidence:
                    confs.append(own)
                if self.threshold > 0:  # d_k stays; a row unsure of it drafts nothing after it
                    alive = alive & (own >= self.threshold)
            if k + 1 == depth or (stoppable and not bool(alive.any())):
                break
            # entry (own output, d_k): its output predicts d_{k+1}; a stopped row's entry is scratch too
            positions = self.cache.lengths[:, None]
            step_logits, step_out = self.net(out[:, None], token.clamp(min=0)[:, None], positions, self.cache)
            self.cache.commit(torch.ones_like(self.cache.lengths))
            logits, out = step_logits[:, 0], step_out[:, 0]
        q_all = torch.stack(qs, dim=1) if qs else None  # [B, k, V], k <= γ when every row stopped early
        confidence = torch.stack(confs, dim=1) if confs else None  # [B, k]
        return Draft(tokens=torch.stack(drafts, dim=1), q=q_all, confidence=confidence)

    def _score_block(
        self, tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor, at: torch.Tensor,
        parent_states: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A block of tree nodes, each fed its parent's output feature (not committed); logits
        over the draft vocabulary."""
        assert parent_states is not None
        positions = self.cache.lengths[:, None] + depths - 1  # depth-1 nodes take the next free slot
        return self.net(parent_states, tokens, positions, self.cache, block_mask=mask, logits_at=at)

    def on_verified(
        self, batch: Batch, num_accepted: torch.Tensor, aux_logits: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        assert hidden is not None
        # drop this round's draft entries: only entries with the target's features stay
        self.cache.truncate(torch.tensor(self.pending.consumed, device=self.cache.lengths.device))
        self.pending.add_verified(hidden, num_accepted)

    def select_rows(self, rows: list[int]) -> None:
        self.cache.select_rows(torch.tensor(rows, dtype=torch.long))
        self.pending.select_rows(rows)
