"""`draft_model`: a smaller checkpoint with the target's tokenizer drafts autoregressively.

Owns the draft model's own KV cache. Invariant between rounds: the draft cache holds a
prefix of each row's committed tokens; after verification it is rolled back to at most
``len(tokens) - 1`` (everything it holds up to there is known to match), and the next
``propose`` first feeds the committed tokens it has not seen (1 or 2 per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specdecode.config import SpecConfig, SpecDecodeError
from specdecode.drafters.base import Draft, DrafterContext
from specdecode.engine.batch import Batch, pad_right
from specdecode.kv_cache import KVCache
from specdecode.model.loader import load_model
from specdecode.sampling import logits_to_probs, sample


@dataclass(frozen=True)
class DraftModelOptions:
    model: str | None = None  # path or alias of the draft checkpoint

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SpecDecodeError('draft_model needs "model": the path of a checkpoint with the target\'s tokenizer')


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

    def __init__(self, spec: SpecConfig, ctx: DrafterContext) -> None:
        path = spec.options.model
        loaded = load_model(path, dtype=ctx.dtype, device=ctx.device)
        check_same_vocab(ctx.target, loaded, path)
        self.model = loaded.model
        self.ctx = ctx
        self.gamma = spec.num_speculative_tokens
        self.cache: KVCache | None = None

    def max_draft_tokens(self, num_tokens: int) -> int:
        return num_tokens

    def _feed(self, rows: list[list[int]]) -> torch.Tensor:
        """Run the draft on each row's pending tokens; commit them; return logits [B, V] at each row's last."""
        assert self.cache is not None
        tokens, lengths = pad_right(rows, self.ctx.device)
        positions = self.cache.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        logits = self.model(tokens, positions, self.cache, logits_at=(lengths - 1)[:, None])  # [B, 1, V]
        self.cache.commit(lengths)
        return logits[:, 0]

    def prefill(self, batch: Batch) -> None:
        # Everything but the newest token, which the first propose feeds.
        self.cache = self.model.new_cache(len(batch), batch.capacity + self.gamma + 2)
        self._feed([s.token_ids[:-1] for s in batch.seqs])

    def propose(self, batch: Batch, num_tokens: int) -> Draft:
        assert self.cache is not None
        seen = self.cache.lengths.tolist()
        logits = self._feed([s.token_ids[n:] for s, n in zip(batch.seqs, seen)])
        drafts, qs = [], []
        for k in range(num_tokens):
            if batch.all_greedy:  # one-hot q: the verifier needs no distribution
                token = logits.argmax(dim=-1)
            else:
                q = logits_to_probs(logits[:, None], batch.temperature, batch.top_k, batch.top_p)[:, 0]  # [B, V]
                token = sample(q, batch.generators)
                qs.append(q)
            drafts.append(token)
            if k + 1 < num_tokens:  # the last draft token is fed next round, if accepted
                logits = self._feed_one(token)
        q_all = torch.stack(qs, dim=1) if qs else None  # [B, γ, V]
        return Draft(tokens=torch.stack(drafts, dim=1), q=q_all)

    def _feed_one(self, token: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None
        positions = self.cache.lengths[:, None]
        logits = self.model(token[:, None], positions, self.cache)  # [B, 1, V]
        self.cache.commit(torch.ones_like(self.cache.lengths))
        return logits[:, 0]

    def on_verified(self, batch: Batch, num_accepted: torch.Tensor) -> None:
        assert self.cache is not None
        committed = torch.tensor([len(s.token_ids) - 1 for s in batch.seqs], device=self.cache.lengths.device)
        self.cache.truncate(committed)

    def select_rows(self, rows: list[int]) -> None:
        assert self.cache is not None
        self.cache.select_rows(torch.tensor(rows, dtype=torch.long))
