"""The distilled `draft_model`: a few layers of the target's width with its tokenizer.

Owns: `DistillNet` (a `DraftNet`: a small `Transformer` initialised from the target's
embeddings, final norm, LM head and first layers, trained on the target's distributions
by KL divergence), `distill_loss` (KL plus the acc@1 / alpha@1 metrics), and writing
the trained model as an HF checkpoint folder (transformers names, the target's config
with fewer layers, the target's tokenizer) that `load_model` and so the `draft_model`
drafter read. Does not own: the training loop (trainer.py) or drafting with the model
(drafters/draft_model.py).

Unlike the feature-level nets, a draft model is a whole model: its saved state holds
its own embedding and head, so the folder is a few tens of MB, not a few.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.config import SpecDecodeError
from specdecode.drafters.learned import CONFIG_FILE, TrainBatch, target_fingerprint, write_folder
from specdecode.cache.kv_cache import NoCache
from specdecode.model.transformer import ModelConfig, Transformer

if TYPE_CHECKING:
    from specdecode.model.loader import LoadedModel


@dataclass(frozen=True)
class DistillConfig:
    num_layers: int = 2  # decoder layers, each of the target's width
    init_from_target: bool = True  # copy the target's first layers (else fresh random layers)
    train_embeddings: bool = False  # also train the (tied) embedding / LM head borrowed at init

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise SpecDecodeError(f"draft_model num_layers must be an integer >= 1, got {self.num_layers!r}")


def distill_loss(logits: Tensor, target_logits: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Mean KL(p ‖ q) over the real positions of ``logits`` [B, T, V] (the draft's q) against
    ``target_logits`` (the target's p), with acc@1 (same top-1) and alpha@1 (Σ min(p, q))."""
    m = mask.to(logits.dtype)
    n = m.sum().clamp(min=1.0)
    logq = F.log_softmax(logits.float(), dim=-1)
    with torch.no_grad():
        logp = F.log_softmax(target_logits.float(), dim=-1)
        p = logp.exp()
    # xlogy-style: tokens the target gives probability 0 (a top-k cache) contribute 0, not 0 · -inf
    kl = (p * torch.where(p > 0, logp - logq, 0.0)).sum(dim=-1)  # [B, T]
    loss = (kl * m).sum() / n
    with torch.no_grad():
        acc = ((logq.argmax(dim=-1) == logp.argmax(dim=-1)).to(m) * m).sum() / n
        alpha = (torch.minimum(p, logq.exp()).sum(dim=-1) * m).sum() / n
    return loss, {"kl": float(loss.detach()), "acc@1": float(acc), "alpha@1": float(alpha)}


class DistillNet(nn.Module):
    """A `DraftNet` for ``draft_model``: the target's architecture with ``num_layers`` layers."""

    Config: ClassVar[type] = DistillConfig
    method: ClassVar[str] = "draft_model"
    hidden_layers: tuple[int, ...] = ()  # tokens only: it reads no target features

    def __init__(self, config: DistillConfig, target_config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        n = config.num_layers
        if n > target_config.num_layers and config.init_from_target:
            raise SpecDecodeError(
                f"draft_model num_layers {n} exceeds the target's {target_config.num_layers} layers to copy"
            )
        types = (target_config.layer_types * n)[:n]
        self.model = Transformer(replace(target_config, num_layers=n, layer_types=types))

    @classmethod
    def from_target(cls, config: DistillConfig, target: Transformer) -> DistillNet:
        net = cls(config, target.config).to(device=target.embed.weight.device, dtype=torch.float32)
        own = net.model.state_dict()
        with torch.no_grad():
            for name, value in target.state_dict().items():
                layer = name.split(".")[1] if name.startswith("layers.") else None
                copy = layer is None or (config.init_from_target and int(layer) < config.num_layers)
                if copy and name in own:
                    own[name].copy_(value.float())
        net.model.embed.weight.requires_grad_(config.train_embeddings)
        net.model.lm_head.weight.requires_grad_(config.train_embeddings)
        return net

    def prepare(self, token_counts: Tensor) -> None:
        """Nothing to prepare: the draft keeps the target's whole vocabulary."""

    def training_loss(self, batch: TrainBatch) -> tuple[Tensor, dict[str, float]]:
        B, T = batch.tokens.shape
        positions = torch.arange(T, device=batch.tokens.device).expand(B, T)
        logits = self.model(batch.tokens, positions, NoCache(B, batch.tokens.device))
        return distill_loss(logits, batch.full_logits(), batch.mask)

    def saved_state(self) -> dict[str, Tensor]:
        """The whole model under transformers' names (a draft model borrows nothing at run time)."""
        return to_hf_names(self.model.config, self.model.state_dict())

    def save_pretrained(self, out_dir: str | Path, target: LoadedModel, extra: dict | None = None) -> Path:
        """An HF folder `load_model` reads: the target's config.json with this net's layer count
        (plus the specdecode keys `read_net_config` knows), safetensors, the target's tokenizer."""
        out = Path(out_dir)
        source = Path(target.path) / CONFIG_FILE
        if not source.is_file():
            raise SpecDecodeError(f"target folder {target.path} has no {CONFIG_FILE} to derive the draft's from")
        hf = json.loads(source.read_text())
        n = self.config.num_layers
        hf["num_hidden_layers"] = n
        if isinstance(hf.get("layer_types"), list):
            hf["layer_types"] = (hf["layer_types"] * n)[:n]
        hf["dtype"] = "bfloat16"  # as save_net: a draft's rounding cannot change the (verified) output
        hf.pop("torch_dtype", None)
        hf.update(specdecode_method=self.method, net=asdict(self.config), target=target_fingerprint(target.model))
        hf.update(extra or {})
        if target.tokenizer is None:
            raise SpecDecodeError(f"target {target.name} has no tokenizer to ship with the draft model")
        state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in self.saved_state().items()}
        return write_folder(out, hf, state, more=lambda folder: target.tokenizer.save_pretrained(str(folder)))


def to_hf_names(cfg: ModelConfig, ours: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our state dict -> transformers' names, splitting q/k/v and gate/up (loader.to_our_names inverted)."""
    hf = {"model.embed_tokens.weight": ours["embed.weight"], "model.norm.weight": ours["norm.weight"]}
    if not cfg.tie_embeddings:
        hf["lm_head.weight"] = ours["lm_head.weight"]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    norms = {"mlp_norm": "post_attention_layernorm"}
    if cfg.sandwich_norm:
        norms = {"attn_out_norm": "post_attention_layernorm", "mlp_norm": "pre_feedforward_layernorm",
                 "mlp_out_norm": "post_feedforward_layernorm"}  # fmt: skip
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
        for kind in kinds:
            for name, part in zip("qkv", ours[f"{src}attn.qkv.{kind}"].split((q, kv, kv))):
                hf[f"{dst}self_attn.{name}_proj.{kind}"] = part
        for kind in ("weight", "bias") if cfg.attention_out_bias else ("weight",):
            hf[f"{dst}self_attn.o_proj.{kind}"] = ours[f"{src}attn.o.{kind}"]
        if cfg.qk_norm:
            hf[f"{dst}self_attn.q_norm.weight"] = ours[f"{src}attn.q_norm.weight"]
            hf[f"{dst}self_attn.k_norm.weight"] = ours[f"{src}attn.k_norm.weight"]
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            gate, up = ours[f"{src}mlp.gate_up.{kind}"].chunk(2)
            hf[f"{dst}mlp.gate_proj.{kind}"], hf[f"{dst}mlp.up_proj.{kind}"] = gate, up
            hf[f"{dst}mlp.down_proj.{kind}"] = ours[f"{src}mlp.down.{kind}"]
        hf[f"{dst}input_layernorm.weight"] = ours[f"{src}attn_norm.weight"]
        for mine, theirs in norms.items():
            hf[f"{dst}{theirs}.weight"] = ours[f"{src}{mine}.weight"]
    return hf
