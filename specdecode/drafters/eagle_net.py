"""The feature-level draft network shared by `eagle`, `eagle3` and `mtp`, and its training loss.

Owns: `FeatureNet` (fc over [token embedding; feature] → a few decoder layers → norm →
the target's LM head restricted to a draft vocabulary) and its `FeatureConfig`.
Does not own: drafting rounds (eagle.py), the training loop (specdecode/train/).

Autoregression in feature space (EAGLE). Entry ``t`` of a sequence pairs the feature
``g_t`` of token t with the embedding of token t+1; its output ``o_t`` is a prediction of
the target's feature at t+1, so ``head(norm(o_t))`` predicts token t+2. On committed
tokens ``g_t`` is the target's own feature (EAGLE: the last layer's residual stream;
EAGLE-3: three layers fused by a Linear; MTP: the last layer's, both inputs RMS-normed as
DeepSeek-V3 does). Past the committed tokens the net feeds on its own outputs.

Training-time test (EAGLE-3): with ``train_steps = K`` the loss unrolls K draft steps.
Step k's entry at t takes the previous step's output and token t+k and predicts token
t+k+1; it sees step 1's entries at positions ≤ t and its own earlier steps at t, exactly
the keys a k-th draft step sees at inference.

Draft vocabulary (EAGLE-3): the LM head keeps only the ``draft_vocab`` most frequent
tokens of the training corpus (`prepare`), which makes a draft step several times
cheaper; q is 0 outside it, so verification stays exact. The head's rows are the
target's, rebuilt at load (not saved), so the saved file holds only the net's own layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.config import SpecDecodeError, is_int
from specdecode.drafters.draft_vocab import Borrowed, DraftVocabHead
from specdecode.drafters.learned import TrainBatch, label_rows
from specdecode.cache.kv_cache import KVCache, NoCache
from specdecode.model.transformer import RMSNorm, Transformer
from specdecode.core.sampling import argmax

_UNSAVED = ("body.lm_head.linear.weight", "body.embed.weight")  # rebuilt from the target / unused


@dataclass(frozen=True)
class FeatureConfig:
    feature_layers: tuple[int, ...] | None = None  # target layers fused (None: the method's default)
    num_layers: int = 1  # decoder layers of the target's shape
    draft_vocab: int = 8192  # LM head rows kept (0, or more than the target has = the whole vocabulary)
    norm_inputs: bool = False  # RMS-norm the feature and the embedding before fc (MTP)
    feature_loss: float = 0.1  # weight of smooth-L1 from o_t to the target's feature at t+1 (EAGLE-1)
    train_steps: int = 1  # training-time test: draft steps unrolled in the loss
    confidence_head: bool = False  # also learn each draft token's acceptance chance (adaptive budgets)

    def __post_init__(self) -> None:
        if isinstance(self.feature_layers, list):
            object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        layers = self.feature_layers
        if layers is not None and (not layers or not all(isinstance(i, int) for i in layers)):
            raise SpecDecodeError(f"feature_layers must be a non-empty list of layer indices, got {layers!r}")
        for name, lo in (("num_layers", 1), ("draft_vocab", 0), ("train_steps", 1)):
            v = getattr(self, name)
            if not is_int(v) or v < lo:
                raise SpecDecodeError(f"{name} must be an integer >= {lo}, got {v!r}")
        if not isinstance(self.feature_loss, (int, float)) or self.feature_loss < 0:
            raise SpecDecodeError(f"feature_loss must be >= 0, got {self.feature_loss!r}")


class FeatureNet(nn.Module):
    """EAGLE's draft network (the `DraftNet` of eagle / eagle3 / mtp)."""

    Config: ClassVar[type] = FeatureConfig
    method: ClassVar[str] = "eagle"

    @staticmethod
    def default_layers(num_layers: int) -> tuple[int, ...]:
        return (num_layers - 1,)  # the last layer's residual stream (before the final norm)

    @classmethod
    def from_target(cls, config: FeatureConfig, target: Transformer) -> "FeatureNet":
        return cls(config, target)

    def __init__(self, config: FeatureConfig, target: Transformer) -> None:
        super().__init__()
        tc = target.config
        layers = config.feature_layers or self.default_layers(tc.num_layers)
        if not all(-1 <= i < tc.num_layers for i in layers):
            raise SpecDecodeError(f"feature_layers {layers} outside the target's {tc.num_layers} layers")
        self.hidden_layers: tuple[int, ...] = tuple(layers)
        self.borrowed = Borrowed(target)
        H = tc.hidden_size
        # [..., len(layers) * H] target features -> [..., H] entry states (EAGLE-3 fuses three layers)
        self.fuse = nn.Linear(len(layers) * H, H, bias=False) if len(layers) > 1 else nn.Identity()
        self.fc = nn.Linear(2 * H, H, bias=False)
        norm = lambda: RMSNorm(H, tc.rms_norm_eps, tc.norm_offset) if config.norm_inputs else nn.Identity()  # noqa: E731
        self.embed_norm, self.feature_norm = norm(), norm()
        body = replace(tc, vocab_size=1, num_layers=config.num_layers, layer_types=(), sliding_window=None,
                       local_rope=None, tie_embeddings=False)  # fmt: skip
        self.body = Transformer(body).to(target.norm.weight.device)
        self.body.embed.requires_grad_(False)  # unused: the body is fed embeddings
        self.body.lm_head = DraftVocabHead(target, config.draft_vocab)
        # o_t -> logit of the chance that the token drafted from o_t is accepted: trained on
        # sum(min(p, q)), the acceptance probability of rejection sampling, on detached features
        self.confidence = nn.Linear(H, 1) if config.confidence_head else None
        self.config = replace(config, feature_layers=tuple(layers), draft_vocab=self.head.size)
        self._init_from_target(target)

    @property
    def head(self) -> DraftVocabHead:
        return self.body.lm_head

    @torch.no_grad()
    def _init_from_target(self, target: Transformer) -> None:
        """Warm start: the decoder layers copy the target's last ones (a net deeper than the target
        keeps its first extra layers random), the norm its final norm."""
        for i, layer in enumerate(self.body.layers):
            at = len(target.layers) - len(self.body.layers) + i
            if at < 0:
                continue
            src = target.layers[at]
            try:
                layer.load_state_dict(src.state_dict())
            except RuntimeError:  # a quantized target: keep the random init
                pass
        self.body.norm.load_state_dict(target.norm.state_dict())
        H = target.config.hidden_size
        eye = torch.eye(H, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
        self.fc.weight.copy_(torch.cat([0.5 * eye, 0.5 * eye], dim=1))  # start as the mean of the inputs

    def prepare(self, token_counts: Tensor) -> None:
        """Keep the ``draft_vocab`` most frequent tokens of the training corpus (counts [V])."""
        self.head.prepare(token_counts)

    def saved_state(self) -> dict[str, Tensor]:
        return {k: v for k, v in self.state_dict().items() if k not in _UNSAVED}

    def forward(
        self,
        states: Tensor,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        block_mask: Tensor | None = None,
        logits_at: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Entries (state, token) [B, T, H], [B, T] -> draft-vocabulary logits [B, T or K, Vd]
        and outputs [B, T or K, H] (each entry's predicted next feature)."""
        last = len(self.body.layers) - 1
        logits, (out,) = self.body(
            None, positions, cache, block_mask=block_mask, logits_at=logits_at, hidden_layers=(last,),
            embeds=self._entries(states, tokens),
        )  # fmt: skip
        if logits_at is not None:
            out = out.gather(1, logits_at[:, :, None].expand(-1, -1, out.shape[-1]))
        return logits, out

    def _entries(self, states: Tensor, tokens: Tensor) -> Tensor:
        """fc([embedding of token; state]): the decoder's inputs [B, T, H]."""
        target = self.borrowed.target
        emb = target.embed(tokens)
        if target.config.embed_scale != 1.0:
            emb = emb * emb.new_tensor(target.config.embed_scale)
        return self.fc(torch.cat([self.embed_norm(emb.to(states.dtype)), self.feature_norm(states)], dim=-1))

    # ---- training --------------------------------------------------------------------

    def training_loss(self, batch: TrainBatch) -> tuple[Tensor, dict[str, float]]:
        tokens, mask = batch.tokens, batch.mask
        T = tokens.shape[1]
        K = min(self.config.train_steps, T - 1)
        n = T - K  # entries t = 0 .. n-1 have a label at every step
        g = self.fuse(batch.hidden[:, :n].to(self.fc.weight.dtype))  # [B, n, H]
        losses, metrics = [], {}
        states, steps_tokens, out = [], [], None
        valid = mask[:, :n]  # [B, n]: entries on a label, then every step's too (no draft across a user turn)
        greedy = batch.argmax()  # [B, T]
        for k in range(1, K + 1):
            states.append(g if k == 1 else out)
            steps_tokens.append(tokens[:, k : k + n])
            out = self._unrolled(states, steps_tokens, n)[:, -n:]  # [B, n, H]: step k's entries
            valid = valid & mask[:, k : k + n]
            label = F.pad(valid, (k, K - k))  # [B, T]: entry t's label is the target's at t + k
            N = valid.sum().clamp(min=1)
            # the head, the loss and the metrics only where a label is: in chat windows most
            # positions are prompt (context), and [B, n, Vd] logits would cost ~4x the work
            p = batch.probs_at(self.head.vocab_ids, label)  # [N, Vd]: the target's for token t+k+1
            out_at = out.flatten(0, 1)[label_rows(valid)]  # [N rounded up, H]
            out_lab = out_at[: len(p)]  # [N, H]: out[valid]
            q_logits = self.body.head_logits(self.body.norm(out_at))[: len(p)]  # [N, Vd]
            logq = q_logits.float().log_softmax(dim=-1)
            loss = -(p * logq).sum() / N
            if k == 1 and self.config.feature_loss > 0 and isinstance(self.fuse, nn.Identity):
                f_next = batch.hidden[:, 1 : 1 + n][valid].to(out.dtype)  # EAGLE-1: regress the next feature
                reg = F.smooth_l1_loss(out_lab, f_next, reduction="none").mean(-1)  # [N]
                loss = loss + self.config.feature_loss * reg.sum() / N
            losses.append(loss * 0.8 ** (k - 1))
            if k == 1 or self.confidence is not None:  # only where read
                overlap = torch.minimum(p, logq.exp()).sum(-1).detach()  # [N]: P(accept) at T = 1
            if self.confidence is not None:
                c = self.confidence(out_at.detach()).float()[: len(p), 0]  # the head does not steer the drafts
                losses.append(F.binary_cross_entropy_with_logits(c, overlap, reduction="sum") / N)
                metrics[f"conf_err@{k}"] = float((c.detach().sigmoid() - overlap).abs().sum() / N)
            with torch.no_grad():
                hit = self.head.vocab_ids[argmax(q_logits)] == greedy[label]
                metrics[f"acc@{k}"] = float(hit.sum() / N)
                if k == 1:
                    metrics["alpha@1"] = float(overlap.sum() / N)
        total = torch.stack(losses).sum()
        metrics["loss"] = float(total.detach())
        return total, metrics

    def _unrolled(self, states: list[Tensor], tokens: list[Tensor], n: int) -> Tensor:
        """One differentiable pass over steps 1..k's entries, laid out step after step: their
        outputs [B, k·n, H] (before the final norm; no head)."""
        k = len(states)
        device = tokens[0].device
        t = torch.arange(n, device=device)
        positions = torch.cat([t + j for j in range(k)])  # step j+1's entry at t sits at t + j
        step = torch.arange(k, device=device).repeat_interleave(n)
        col = t.repeat(k)
        # step-1 entries causally; a later step's entry at t also sees its own earlier steps at t
        sees_first = (step[None, :] == 0) & (col[None, :] <= col[:, None])
        sees_own = (col[None, :] == col[:, None]) & (step[None, :] <= step[:, None])
        B = tokens[0].shape[0]
        mask = (sees_first | sees_own)[None].expand(B, -1, -1)
        last = len(self.body.layers) - 1
        _, (out,) = self.body(
            None, positions[None].expand(B, -1), NoCache(B, device), block_mask=mask,
            logits_at=torch.zeros(B, 0, dtype=torch.long, device=device), hidden_layers=(last,),
            embeds=self._entries(torch.cat(states, dim=1), torch.cat(tokens, dim=1)),
        )  # fmt: skip
        return out
