"""Row-invariant passes of the torch blocks on CPU: attention and dense linears through our
library (kernels/invariant.c), so that a position's logits do not depend on what shares its pass.

Owns: when the torch blocks may use them (`exact_kernels`), the attention call with each
query's visible key slots, and the dense linear (fp32: our GEMM; bf16: the fused block's
bf16 GEMM), as torch custom ops inside torch.compile.
Does not own: the fused CPU block (cpu_block.py, invariant by construction), the quantized
linears (quant.py: our int4 / Q8_0 kernels are row-invariant already), or masks (masks.py).

Why: torch's SDPA and fp32 GEMM choose their blocking by the shape of the whole pass, so a
token verified among γ others rounds differently from the same token decoded alone, and
greedy speculative output leaves plain greedy's path at a near-tie. On CUDA no such kernel
is ours (cuBLAS and SDPA pick kernels by shape): there passes stay as torch computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specdecode.model.cpu_int4 import cpu_lib


def exact_kernels(x: Tensor) -> bool:
    """Whether our row-invariant kernels can run a pass over activations ``x``: fp32 or bf16 on
    a CPU our library is built for, without autograd (they have no backward)."""
    ok = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled()
    return ok and cpu_lib() is not None


@dataclass
class Visibility:
    """Which slots each computed query of a pass sees, for one layer kind: built once a pass."""

    vis: Tensor  # uint8 [N, S]
    rows: Tensor  # int32 [N]: each query's batch row
    pack: Tensor | None  # the computed queries' flat indices into B·T (None: all B·T)


def visibility(
    mask: Tensor | None, lengths: Tensor, T: int, kv_len: int, group: int, pack: Tensor | None = None
) -> Visibility:
    """The slots query (b, t) sees, from a folded mask [B, 1, G·T, S] (masks.attention_masks;
    its group-0 rows) or, with no mask, causally; ``pack``: only the real tokens of a padded
    pass (flat indices into B·T) are computed."""
    B = lengths.shape[0]
    if mask is None:
        s = torch.arange(kv_len, device=lengths.device)
        ends = lengths[:, None] + torch.arange(T, device=lengths.device)  # [B, T] the newest slot each query sees
        vis = s[None, None, :] <= ends[:, :, None]
    else:
        vis = mask.view(B, group, T, -1)[:, 0]
    vis = vis.reshape(B * T, -1)
    rows = torch.arange(B, dtype=torch.int32).repeat_interleave(T)
    if pack is not None:
        vis, rows = vis[pack], rows[pack]
    return Visibility(vis.to(torch.uint8).contiguous(), rows, pack)


def attend(q: Tensor, k: Tensor, v: Tensor, seen: Visibility, scale: float) -> Tensor:
    """Attention of queries ``q`` [B, T, H, D] over ``k`` / ``v`` [B, Hkv, S, D] (the cache as
    `KVCache.append` returns it; any strides with D contiguous), each query computed alone over
    the slots ``seen`` gives it, in slot order. Queries left out of ``seen.pack`` are 0. [B, T, H, D]."""
    B, T, H, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    qf = q.reshape(B * T, H, D)
    qf = (qf if seen.pack is None else qf[seen.pack]).contiguous()
    out = torch.empty_like(qf)
    cpu_lib().attend_rows(
        int(q.dtype == torch.bfloat16), qf.shape[0], S, H, Hkv, D, scale, qf.data_ptr(), seen.rows.data_ptr(),
        seen.vis.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if seen.pack is None:
        return out.view(B, T, H, D)
    full = out.new_zeros(B * T, H, D)
    full[seen.pack] = out
    return full.view(B, T, H, D)


def linear(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)``, through our row-invariant GEMM where ``module`` is a dense fp32 or bf16
    `nn.Linear` on CPU (quantized linears are invariant as they are)."""
    if type(module) is not nn.Linear or module.weight.dtype != x.dtype or module.weight.device.type != "cpu":
        return module(x)
    w = module.weight
    if x.dtype == torch.bfloat16 and (w.shape[1] % 32 or w.shape[0] % 8):
        return module(x)  # the bf16 GEMM's shape rules (model/kernels); no model we load breaks them
    y = _gemm_op(x.reshape(-1, x.shape[-1]), w) if torch.compiler.is_compiling() else _gemm(x.reshape(-1, x.shape[-1]), w)
    y = y.view(*x.shape[:-1], w.shape[0])
    return y if module.bias is None else y + module.bias


def _gemm(x2: Tensor, w: Tensor) -> Tensor:
    x2, w = x2.contiguous(), w.contiguous()
    M, K = x2.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype)
    gemm = cpu_lib().f32_gemm if x2.dtype == torch.float32 else cpu_lib().bf16_gemm
    gemm(x2.data_ptr(), M, K, w.data_ptr(), N, y.data_ptr(), torch.get_num_threads())
    return y


@torch.library.custom_op("specdecode::invariant_gemm", mutates_args=())
def _gemm_op(x2: Tensor, w: Tensor) -> Tensor:
    return _gemm(x2, w)


@_gemm_op.register_fake
def _(x2: Tensor, w: Tensor) -> Tensor:
    return x2.new_empty(x2.shape[0], w.shape[0])

