"""Our row-invariant attention and dense GEMM (model/invariant.py, kernels/invariant.c): as
accurate as torch's, and bitwise the same for a query or a row whatever shares its call, on
each build the host CPU runs. (Whole passes through them: test_batch_invariant.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdecode.model import invariant
from specdecode.model.cpu_int4 import CPU_ISAS, cpu_lib
from tests.tiny import small_tree

pytestmark = pytest.mark.skipif(cpu_lib() is None, reason="needs our CPU library (AVX2 or AVX512, and a C compiler)")
BUILDS = [isa for isa in CPU_ISAS if cpu_lib(isa) is not None]  # AVX512 lanes, AVX2 lanes


@pytest.fixture(params=BUILDS)
def build(request, monkeypatch):
    """Each build the host CPU runs (a process uses the best; the others must be right too)."""
    monkeypatch.setattr(invariant, "cpu_lib", lambda: cpu_lib(request.param))
    return request.param


def random_attention(B, T, S, H, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    lengths = torch.tensor([S - T - b for b in range(B)])  # rows of different cached lengths
    return q, k, v, lengths


def sdpa(q, k, v, vis, scale):
    """The reference: torch's SDPA in fp64 with the same visibility."""
    B, T, H, D = q.shape
    G = H // k.shape[1]
    mask = vis.vis.view(B, 1, T, -1).bool()
    kk, vv = (t.double().repeat_interleave(G, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.double().transpose(1, 2), kk, vv, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, Hkv, D", [(4, 2, 64), (3, 1, 16), (6, 3, 24), (2, 2, 128)])
def test_attention_matches_sdpa(build, dtype, H, Hkv, D):
    B, T, S = 3, 5, 40
    q, k, v, lengths = random_attention(B, T, S, H, Hkv, D, dtype)
    vis = invariant.visibility(None, lengths, T, S, H // Hkv)
    got = invariant.attend(q, k, v, vis, D**-0.5)
    want = sdpa(q, k, v, vis, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_computes_the_same_bits_whatever_shares_its_call(build, dtype):
    """One query alone (a decode step) against the same query among T in a pass, rows of other
    lengths, a padded batch with only some queries computed, and a longer cache view whose
    extra slots it does not see."""
    B, T, S, H, Hkv, D = 3, 6, 50, 4, 2, 64
    q, k, v, lengths = random_attention(B, T, S, H, Hkv, D, dtype, seed=1)
    vis = invariant.visibility(None, lengths, T, S, H // Hkv)
    full = invariant.attend(q, k, v, vis, 0.125)
    for b in range(B):
        for t in range(T):
            n = int(lengths[b]) + t + 1  # the slots this query sees
            alone = invariant.visibility(None, torch.tensor([n - 1]), 1, n, 1)
            one = invariant.attend(q[b : b + 1, t : t + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], alone, 0.125)
            assert torch.equal(one[0, 0], full[b, t]), (b, t)
    pack = torch.tensor([0, 1, 6, 12, 13, 14])  # real tokens of a padded pass
    packed = invariant.attend(q, k, v, invariant.visibility(None, lengths, T, S, H // Hkv, pack), 0.125)
    assert torch.equal(packed.view(B * T, H, D)[pack], full.view(B * T, H, D)[pack])


def test_attention_sees_only_its_mask(build):
    """A tree mask: a node attends to the cache and its ancestors only, in slot order; keys it
    does not see may hold anything."""
    B, T, S, H, Hkv, D = 1, 6, 30, 4, 2, 32
    q, k, v, lengths = random_attention(B, T, S, H, Hkv, D, torch.float32, seed=2)
    tokens, parents, depth, mask = small_tree()
    prefix = S - T
    seen = torch.zeros(T, S, dtype=torch.bool)
    seen[:, :prefix] = True
    seen[:, prefix:] = mask
    vis = invariant.visibility(seen[None, None].repeat(1, 1, H // Hkv, 1), torch.tensor([prefix]), T, S, H // Hkv)
    got = invariant.attend(q, k, v, vis, D**-0.5)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, prefix:][:, :, ~mask[5].bool()] = 1e4  # what node 5 does not see
    v2[:, :, prefix:][:, :, ~mask[5].bool()] = -1e4
    again = invariant.attend(q, k2, v2, vis, D**-0.5)
    assert torch.equal(again[0, 5], got[0, 5])
    torch.testing.assert_close(got.double(), sdpa(q, k, v, vis, D**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K, N", [(64, 96), (72, 13), (576, 1536)])
def test_linear_matches_torch_and_a_row_does_not_depend_on_the_batch(build, dtype, K, N):
    if dtype == torch.bfloat16 and (K % 32 or N % 8):
        pytest.skip("the bf16 GEMM's shapes (other shapes run torch's linear)")
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=True).to(dtype)
    x = torch.randn(20, K).to(dtype)
    with torch.inference_mode():
        full = invariant.linear(lin, x)
        torch.testing.assert_close(full.double(), lin(x).double(), atol=1e-4 if dtype == torch.float32 else 0.05,
                                   rtol=1e-4 if dtype == torch.float32 else 0.02)  # fmt: skip
        for M in (1, 2, 3, 5, 7):
            assert torch.equal(invariant.linear(lin, x[:M]), full[:M]), M
        assert torch.equal(invariant.linear(lin, x[7:8]), full[7:8])
