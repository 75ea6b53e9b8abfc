"""`dflash`: a block drafter that proposes γ tokens in one forward pass of a small net
whose every layer reads the target's context through injected K/V (the net: dflash_net.py).

Owns: the drafter's per-row context cache and the engine contract. Invariant between
rounds: row b's cache holds the injected K/V of exactly the tokens whose target features
it has been handed, ``token_ids[:-1]`` (prefill hands the prompt's, each ``on_verified``
the round's root and accepted drafts), at slots = positions. It only ever holds
committed tokens, so a rejection needs no rollback; the block a round drafts with
writes its K/V past the row's length, as scratch the next write overwrites.
Does not own: the network, its training loss or its weights' folder (dflash_net.py,
learned.py).

A round: the block ``[root, MASK × (S-1)]`` runs once; its first γ positions give the
draft distributions q_1..q_γ, after the target's temperature / top-k / top-p. Draft
token d_k is sampled from q_k (greedy rows: argmax, q one-hot), so the verifier's
rejection sampling keeps the output exactly the target's. The draft tokens do not feed
back into the block (they are drawn in parallel), which q_k accounts for: q_k is the
distribution d_k was actually drawn from.

With ``prompt_lookup_max`` or ``datastore`` a row whose context occurred before drafts the copy
instead (lookup.py's wrapper); the block then drafts the other rows (``copies``), ``num_steps``
deep (default γ), and runs not at all in a round where every row copies. The cache needs nothing
from a round's drafts: what it is handed comes from the target's pass, whichever source drafted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.config import SpecConfig, SpecDecodeError
from specdecode.drafters.base import Draft, DrafterContext
from specdecode.drafters.dflash_net import DFlashNet
from specdecode.drafters.draft_cache import DraftKVCache
from specdecode.drafters.draft_vocab import check_confidence_threshold, stop_after_unsure
from specdecode.drafters.learned import load_net, resolve_weights
from specdecode.drafters.lookup import LookupKeys, drafting_rows
from specdecode.core.batch import Batch
from specdecode.core.logits_process import row_states


@dataclass(frozen=True)
class DFlashOptions(LookupKeys):
    # a folder written by `specdecode train --method dflash`; None = the weights shipped for the target
    model: str | None = None
    # cut each block after its first token whose draft probability is below this (as eagle's
    # chains stop): fewer positions to verify; 0 = verify the whole block
    confidence_threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise SpecDecodeError(
                f'dflash "model" must be a folder path (or omitted for the shipped weights), got {self.model!r}'
            )
        check_confidence_threshold(self.confidence_threshold)
        LookupKeys.__post_init__(self)


class DFlashDrafter:
    Options: ClassVar[type] = DFlashOptions
    Net: ClassVar[type] = DFlashNet
    default_num_speculative_tokens: ClassVar[int] = 16  # the default block size: all of it in one pass

    def __init__(self, spec: SpecConfig, ctx: DrafterContext) -> None:
        path = resolve_weights("dflash", spec.options.model, ctx.target)
        self.net: DFlashNet = load_net(DFlashNet, path, ctx.target.model, ctx.dtype, ctx.device, ctx.quantization)
        self.gamma = spec.num_speculative_tokens
        self.threshold: float = float(spec.options.confidence_threshold)
        self.report_confidence: bool = spec.budget.adaptive  # see eagle.py
        self.steps: int = spec.options.steps(self.gamma)  # the block's length (γ, or num_steps beside a lookup)
        if self.steps > self.net.block_size:
            what = "num_steps" if spec.options.num_steps else "num_speculative_tokens"
            default = "" if spec.options.num_steps else f" ({self.default_num_speculative_tokens} when not given)"
            hint = "" if spec.options.num_steps or not spec.options.lookup_on else " (or num_steps, beside a lookup)"
            raise SpecDecodeError(
                f"dflash drafts at most its block size of {self.net.block_size} tokens per pass; "
                f"{what} is {self.steps}{default}: set it to at most {self.net.block_size}{hint}"
            )
        self.hidden_layers: tuple[int, ...] = self.net.hidden_layers
        self.ctx = ctx
        self.cache = DraftKVCache(self.net.body)

    def max_draft_tokens(self, num_tokens: int) -> int:
        return min(num_tokens, self.net.block_size)

    def prefill(self, batch: Batch, rows: list[int], hidden: list[Tensor] | None = None) -> None:
        assert hidden is not None, "dflash reads target features: the engine hands them with hidden_layers"
        width = max(1, max(len(h) for h in hidden))
        features = torch.stack([F.pad(h, (0, 0, 0, width - len(h))) for h in hidden])  # [R, N, F]
        with self.cache.only(self.cache.join_rows(len(rows))):
            self._inject(self.cache, features, torch.tensor([len(h) for h in hidden], device=self.ctx.device))

    def _inject(self, cache: DraftKVCache, features: Tensor, counts: Tensor) -> None:
        """Write the injected K/V of row b's first ``counts[b]`` features [B, N, F] after its
        context, and commit them. Padding features write past the row's length (scratch)."""
        N = features.shape[1]
        slots = cache.lengths[:, None] + torch.arange(N, device=features.device)  # [B, N] = positions
        kv_len = cache.max_length() + N
        for layer, (k, v) in enumerate(self.net.context_kv(features, slots)):
            cache.append(layer, k, v, slots, kv_len)
        cache.commit(counts)

    def propose(self, batch: Batch, num_tokens: int, copies: list[list[int]] | None = None) -> Draft:
        """One block pass: every row's draft tokens (a copying row's are scratch, replaced by its copy)."""
        gamma = min(num_tokens, self.steps, self.net.block_size)
        roots = torch.tensor([s.token_ids[-1] for s in batch.seqs], dtype=torch.long, device=self.ctx.device)
        at = torch.arange(gamma, device=roots.device).expand(len(batch), -1)  # [B, γ]
        logits = self.net.block_logits(roots, self.cache, logits_at=at)  # [B, γ, Vd] over the draft vocabulary
        head = self.net.head
        q = None
        V = self.ctx.target.config.vocab_size
        states = row_states(batch.seqs, self.ctx.target.config.eos_token_ids)  # drafts processed as p is
        if batch.all_greedy:  # one-hot q: the verifier needs no distribution
            tokens = head.greedy(logits, V, states)
        else:  # a copying row draws from scratch: its own stream is for its own drafts
            drafting = drafting_rows(copies, batch, self.ctx.device)
            tokens, q = head.sample(logits, batch, V, 0, drafting, states)  # [B, γ], [B, γ, V]
        confidence = None
        if self.threshold > 0 or self.report_confidence:
            own = head.own_probability(logits, tokens, q, batch)  # [B, γ]
            confidence = own if self.report_confidence else None
            if self.threshold > 0:
                tokens = stop_after_unsure(tokens, own, self.threshold)
        return Draft(tokens=tokens, q=q, confidence=confidence)

    def on_verified(
        self, batch: Batch, num_accepted: Tensor, aux_logits: Tensor | None = None, hidden: Tensor | None = None
    ) -> None:
        assert hidden is not None
        self._inject(self.cache, hidden, num_accepted + 1)  # the root, then the accepted drafts

    def select_rows(self, rows: list[int]) -> None:
        self.cache.select_rows(torch.tensor(rows, dtype=torch.long))
