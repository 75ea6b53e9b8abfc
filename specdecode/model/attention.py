"""The two attention paths besides one SDPA over the padded pass.

Owns: `split` (a padded pass where few rows draft deep: the drafting rows' later queries apart)
and `rowwise` (one SDPA per query over exactly the keys it sees: batch invariance where our
CPU kernels do not run).
Does not own: which path a pass takes or its masks (transformer.py, masks.py), our CPU attention
kernel (invariant.py).

Shapes: queries [B, T, H, D]; keys and values [B, Hkv, S, D]; a kv head's G = H / Hkv query
heads attend together. The result holds B·T·H·D values as [B, T, Hkv, G, D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def split(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, first: Tensor, rest: Tensor, scale: float) -> Tensor:
    """Every row's first query in one SDPA, and only the drafting ``rows``' later queries in a
    second, over those rows' K/V. Each query attends exactly as in the padded SDPA; the padded
    queries of the other rows are not computed (left 0, dropped by the packed linears).
    ``first`` [B, 1, G, S] and ``rest`` [R, 1, G*(T-1), S] are the folded mask's rows for them."""
    B, T, H, D = q.shape
    Hkv, R = k.shape[1], rows.shape[0]
    G = H // Hkv
    q = q.view(B, T, Hkv, G, D)
    out = q.new_zeros(B, T, Hkv, G, D)
    q0 = q[:, 0].reshape(B, Hkv, G, D)
    out[:, 0] = F.scaled_dot_product_attention(q0, k, v, attn_mask=first, scale=scale)
    qr = q[rows, 1:].permute(0, 2, 3, 1, 4).reshape(R, Hkv, G * (T - 1), D)
    o = F.scaled_dot_product_attention(qr, k[rows], v[rows], attn_mask=rest, scale=scale)
    out[rows, 1:] = o.view(R, Hkv, G, T - 1, D).permute(0, 3, 1, 2, 4)
    return out


def rowwise(q: Tensor, k: Tensor, v: Tensor, visible: list[list[Tensor | slice]], scale: float) -> Tensor:
    """One mask-free SDPA per query (b, t) over the key slots ``visible[b][t]``: the same
    computation whether the query is decoded alone or verified among others."""
    B, T, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    out = torch.empty(B, T, Hkv, G, D, dtype=q.dtype, device=q.device)
    for b in range(B):
        for t in range(T):
            keys = visible[b][t]  # [S_bt] slots
            qt = q[b : b + 1, t].reshape(1, Hkv, G, D)
            out[b, t] = F.scaled_dot_product_attention(qt, k[b : b + 1, :, keys], v[b : b + 1, :, keys], scale=scale)[0]
    return out
