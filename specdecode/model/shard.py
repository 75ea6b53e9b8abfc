"""One rank's part of a tensor-parallel target (Megatron-style), and how its weights are cut.

Owns: `Shard` (this rank, the world size, the process group, and the two collectives a
sharded forward needs: the all-reduce after each row-parallel linear and the all-gather of
the vocabulary-split LM head), `check_tensor_parallel` (sizes that split by whole heads and
whole quantization groups, weights that can be cut) and `split_state` (a full checkpoint, in
our parameter names, cut down to one rank's rows and columns).
Does not own: the forward pass (transformer.py reads the shard's sizes and calls its
collectives), starting ranks or telling the other ranks what to run (tensor_parallel.py).

The cut: q/k/v and the MLP's gate and up are column-parallel (each rank holds its heads and
its slice of the intermediate size), attention's output and the MLP's down projection are
row-parallel (each rank multiplies its slice; one all-reduce sums them; the bias is kept on
rank 0 only so that it is added once), the LM head is split over the vocabulary (padded to a
multiple of the world size). Embeddings and norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specdecode.config import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.model.model_config import ModelConfig
    from specdecode.model.quant import Quantization


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    group: Any = None  # a torch.distributed process group (None: the default one)

    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """This rank's query heads and kv heads."""
        return cfg.num_heads // self.size, cfg.num_kv_heads // self.size

    def intermediate(self, cfg: ModelConfig) -> int:
        return cfg.intermediate_size // self.size

    def vocab_rows(self, cfg: ModelConfig) -> int:
        """LM-head rows per rank: the vocabulary padded up to a multiple of the world size."""
        return -(-cfg.vocab_size // self.size)

    def reduce(self, x: Tensor) -> Tensor:
        """Sum the ranks' partial outputs of a row-parallel linear, in place."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: Tensor, vocab_size: int) -> Tensor:
        """[..., V/n] per rank -> [..., V]: every rank's slice, in rank order, padding dropped."""
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


def check_tensor_parallel(cfg: ModelConfig, size: int, quant: Quantization | None = None) -> None:
    """One line when ``size`` ranks cannot split ``cfg`` by whole heads, or cannot split weights
    quantized as ``quant``: a .gguf's own blocks, or int4 groups that the row-parallel inputs
    would cut."""
    if size < 1:
        raise SpecDecodeError(f"tensor parallel size must be at least 1, got {size}")
    if cfg.num_heads % size or cfg.num_kv_heads % size:
        raise SpecDecodeError(
            f"tensor parallel size {size} does not divide the model's {cfg.num_heads} attention heads "
            f"and {cfg.num_kv_heads} kv heads: choose a size that divides both"
        )
    if cfg.intermediate_size % size:
        raise SpecDecodeError(f"tensor parallel size {size} does not divide the MLP size {cfg.intermediate_size}")
    if quant is not None and quant.mode == "gguf" and size > 1:
        raise SpecDecodeError("tensor parallelism splits float weights: load the .gguf with --quantization none, "
                              "int8 or int4")  # fmt: skip
    group_size = quant.group_size if quant is not None else None
    if group_size and size > 1:
        for name, inner in (("attention output", cfg.num_heads * cfg.head_dim), ("MLP down", cfg.intermediate_size)):
            if (inner // size) % group_size:
                raise SpecDecodeError(
                    f"tensor parallel size {size} cuts the {name} projection's {inner} inputs into pieces "
                    f"that are not whole int4 groups of {group_size}: choose another size or group"
                )


def split_state(cfg: ModelConfig, state: dict[str, Tensor], shard: Shard) -> dict[str, Tensor]:
    """The full model's ``state`` (our names: ``qkv``, ``gate_up`` fused) cut to ``shard``'s part."""
    r, n = shard.rank, shard.size
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h, hkv = H // n, Hkv // n
    i_local = cfg.intermediate_size // n

    def rows(t: Tensor, start: int, count: int) -> Tensor:
        return t[start : start + count]

    out = {}
    for name, t in state.items():
        leaf = name.rsplit(".", 2)
        kind = ".".join(leaf[-2:])  # e.g. "qkv.weight"
        if kind in ("qkv.weight", "qkv.bias"):  # [(H + 2 Hkv) D, ...]: this rank's q, k and v heads
            q, k, v = t.split((H * D, Hkv * D, Hkv * D))
            t = torch.cat((rows(q, r * h * D, h * D), rows(k, r * hkv * D, hkv * D), rows(v, r * hkv * D, hkv * D)))
        elif kind == "gate_up.weight" or kind == "gate_up.bias":  # [2 I, ...]: this rank's gate and up columns
            gate, up = t.chunk(2)
            t = torch.cat((rows(gate, r * i_local, i_local), rows(up, r * i_local, i_local)))
        elif kind == "o.weight":  # [hidden, H D]: this rank's inputs
            t = t[:, r * h * D : (r + 1) * h * D]
        elif kind == "down.weight":
            t = t[:, r * i_local : (r + 1) * i_local]
        elif kind in ("o.bias", "down.bias"):
            t = t if r == 0 else torch.zeros_like(t)
        elif name == "lm_head.weight":
            per = shard.vocab_rows(cfg)
            t = rows(t, r * per, per)
            if t.shape[0] < per:  # the last rank's padding rows: logits dropped after the gather
                t = torch.cat((t, t.new_zeros(per - t.shape[0], t.shape[1])))
        out[name] = t.contiguous()
    return out
