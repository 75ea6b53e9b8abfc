"""Quantized linears: kernels against dequantized references, whole tiny models, errors.
(GGUF blocks kept quantized: test_quant_gguf.py.)"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from specdecode.config import SpecDecodeError
from specdecode.model import cpu_int4
from specdecode.model.cpu_int4 import CPU_ISAS, cpu_lib
from specdecode.model.loader import load_model
from specdecode.model.quant import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    describe_kernels,
    linear_names,
    parse_quantization,
    quantize_int4,
    quantize_int8,
    quantize_model_,
    set_submodule,
)


def close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> bool:
    return (y.float() - ref).abs().max().item() <= rel * ref.abs().max().item()


# ---- kernels -----------------------------------------------------------------------------

# (N, K, group): odd group counts (3, 5, 9), K not a multiple of the group (200 / 64), N not of 16
SHAPES_INT4 = [(3, 96, 32), (40, 200, 64), (24, 160, 32), (17, 1152, 128)]


OURS = [isa for isa in CPU_ISAS if cpu_lib(isa) is not None]  # our builds the host CPU runs
KERNELS = ["stock"] + OURS


def kernel_weights(q, s, z, g, kernel: str) -> torch.Tensor:
    """The weights a CPU kernel evaluates (in fp32): stock keeps s, z in bf16; ours keeps s and z - 8 s in fp16."""
    if kernel == "stock":
        return dequantize_int4(q, s.bfloat16(), z.bfloat16(), g)
    n = q.shape[0]
    s16, z16 = s.half().float(), (z.double() - 8 * s.double()).half().float()
    return (q.float().view(n, -1, g) * s16[..., None] + z16[..., None]).view(n, -1)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n,k,g", SHAPES_INT4)
@pytest.mark.parametrize("m", [1, 3, 9, 20])
def test_int4_matches_dequantized_reference(kernel, n, k, g, m):
    gen = torch.Generator().manual_seed(n * k + m)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    q, s, z = quantize_int4(w, g)
    ref_w = kernel_weights(q, s, z, g, kernel)[:, :k]
    assert close(ref_w, w, 0.1)  # 4 bits: within ~1/15 of each group's range
    lin = Int4Linear.from_weight(w, g, bias=b, kernel=kernel)
    assert lin.impl == kernel
    x = torch.randn(2, m, k, generator=gen)
    ref = x.bfloat16().float() @ ref_w.T + b  # the kernel computes in bf16
    y = lin(x)
    assert y.shape == (2, m, n) and y.dtype == torch.float32
    assert close(y, ref, 1e-2)  # bf16 output rounding
    assert close(lin(x.bfloat16()), ref, 1e-2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_int4_rows_do_not_depend_on_how_many_are_verified(kernel):
    """A row's output is bit-identical whether it runs alone or among M rows (decode vs verify)."""
    gen = torch.Generator().manual_seed(7)
    lin = Int4Linear.from_weight(torch.randn(96, 160, generator=gen), 32, kernel=kernel)
    x = torch.randn(20, 160, generator=gen).bfloat16()
    alone = torch.cat([lin(x[i : i + 1]) for i in range(20)])
    for m in (2, 3, 4, 5, 9, 16, 20):  # every kernel shape: half tiles, octets, panels
        assert torch.equal(lin(x[:m]), alone[:m])


def a8_dots(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's groups of 32 inputs quantized as the kernels do (q_x = round(x * 127 / max|x|)
    in fp32, nearest even) and their exact integer dot products with q [N, K]: (dots [M, N, G]
    and d_x [M, G] in float64, x [M, G, 32] as bf16 values)."""
    xf = x.bfloat16().float().view(x.shape[0], -1, 32)  # [M, G, 32]
    amax = xf.abs().amax(-1, keepdim=True)
    qx = torch.round(xf * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    dots = torch.einsum("mgk,ngk->mng", qx.double(), q.double().view(q.shape[0], -1, 32))
    return dots, (amax[..., 0] / 127).double(), xf


def a8_reference(x: torch.Tensor, q, s, z, g) -> torch.Tensor:
    """int4 times int8 activations in float64: s d_x (q_w . q_x) + z sum(x) per group, with the
    kernel's fp16 s and z."""
    dots, d, xf = a8_dots(x, q)
    s16 = s.half().double().repeat_interleave(g // 32, 1)  # [N, G]
    z16 = (z.double() - 8 * s.double()).half().double().repeat_interleave(g // 32, 1)
    return (s16 * d[:, None] * dots).sum(-1) + (z16 * xf.double().sum(-1)[:, None]).sum(-1)


@pytest.mark.parametrize("kernel", OURS)
@pytest.mark.parametrize("n,k,g", SHAPES_INT4)
@pytest.mark.parametrize("m", [1, 3, 5, 9, 20])
def test_int4_a8_matches_its_integer_reference(kernel, n, k, g, m):
    """int8 activations: the kernel is the integer arithmetic above up to the bf16 output, and
    within a few percent of the dequantized weights' product (per-group int8 rounding of x)."""
    gen = torch.Generator().manual_seed(n * k + m + 1)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    q, s, z = quantize_int4(w, g)
    lin = Int4Linear.from_weight(w, g, bias=b, kernel=kernel, a8=True)
    assert lin.a8 and "int8 activations" in lin.kernel()
    x = torch.randn(m, k, generator=gen)
    y = lin(x)
    xp = torch.nn.functional.pad(x, (0, -k % g))
    assert close(y, a8_reference(xp, q, s, z, g).float() + b, 1e-2)  # bf16 output rounding
    assert close(y, x.bfloat16().float() @ kernel_weights(q, s, z, g, kernel)[:, :k].T + b, 0.03)


@pytest.mark.parametrize("kernel", OURS)
def test_int4_a8_rows_do_not_depend_on_how_many_are_verified(kernel):
    gen = torch.Generator().manual_seed(8)
    lin = Int4Linear.from_weight(torch.randn(96, 160, generator=gen), 32, kernel=kernel, a8=True)
    x = torch.randn(20, 160, generator=gen).bfloat16()
    x[3, 32:64] = 0  # an all-zero group: d = 0
    alone = torch.cat([lin(x[i : i + 1]) for i in range(20)])
    for m in (2, 4, 5, 9, 16, 20):
        assert torch.equal(lin(x[:m]), alone[:m])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("a8", [False, True])
def test_no_rows_give_an_empty_result(kernel, a8):
    """A pass with no rows (logits at no position) is empty, not a crash: the AVX2 tiles had no
    0-row entry and segfaulted, int4 and Q8_0 alike."""
    from specdecode.model.quant import Q8Linear

    if a8 and kernel == "stock":
        pytest.skip("int8 activations run on our kernels only")
    gen = torch.Generator().manual_seed(9)
    lins = [Int4Linear.from_weight(torch.randn(40, 96, generator=gen), 32, kernel=kernel, a8=a8)]
    if kernel != "stock":
        q, d = torch.randint(-127, 128, (40, 96), generator=gen, dtype=torch.int8), torch.rand(40, 3, generator=gen)
        lins.append(Q8Linear(q, d, 96, kernel=kernel, a8=a8))
    for lin in lins:
        assert lin(torch.randn(0, 96)).shape == (0, 40)
        assert lin(torch.randn(2, 0, 96).bfloat16()).shape == (2, 0, 40)


@pytest.mark.skipif(not OURS, reason="needs our CPU library")
def test_our_kernel_refuses_tensors_off_the_cpu():
    """A CPU-quantized linear moved to another device would hand C a device pointer."""
    lin = Int4Linear.from_weight(torch.randn(32, 64), 32, kernel=OURS[0])
    with pytest.raises(SpecDecodeError, match="CPU kernel got tensors on meta"):
        lin._mm(torch.empty(1, 64, dtype=torch.bfloat16, device="meta"))


def test_a_kernel_cache_that_cannot_be_written_falls_back_to_torch(tmp_path, monkeypatch):
    """SPECDECODE_CACHE naming a file (or a read-only folder): "auto" takes torch's kernel with
    a warning naming the folder, instead of an OSError on first use."""
    if not OURS:
        pytest.skip("needs our CPU library")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDECODE_CACHE", str(blocker))
    cpu_lib.cache_clear()
    try:
        with pytest.warns(UserWarning, match="cannot be built or loaded"):
            assert cpu_lib(OURS[0]) is None
        assert Int4Linear.from_weight(torch.randn(32, 64), 32, kernel="auto").impl == "stock"
    finally:
        monkeypatch.undo()
        cpu_lib.cache_clear()
    assert cpu_lib(OURS[0]) is not None


def test_a_compiler_without_amx_flags_skips_that_build_quietly(tmp_path, monkeypatch):
    """On an AMX CPU with GCC < 11 (no -mamx-tile) the AMX build is skipped without a warning
    (it used to warn at every load, the failure not being kept) and "auto" takes the next
    build; asking for "amx" by name says what it needs."""
    needs = set(CPU_ISAS["amx"][0])
    if not needs <= cpu_int4._cpu_flags() or "avx512_bf16" not in OURS:
        pytest.skip("needs an AMX CPU")
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -mamx*) echo "unrecognized option $a" >&2; exit 1;; '
                  'esac; done\nexec gcc "$@"\n')  # fmt: skip
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    cpu_lib.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_lib("amx") is None and cpu_int4.cpu_isa() == "avx512_bf16"
        with pytest.raises(SpecDecodeError, match="GCC 11"):
            cpu_int4.pick_cpu_kernel("amx")
    finally:
        monkeypatch.undo()
        cpu_lib.cache_clear()


def test_a_damaged_kernel_in_the_cache_is_rebuilt(tmp_path):
    """A truncated library in the cache (a copied cache, a crash before the data reached the
    disk) killed every later process with SIGBUS in dlopen; its hash is checked first, and a
    damaged one rebuilt. In subprocesses: the damaged file would kill this one."""
    if not OURS:
        pytest.skip("needs our CPU library")
    env = {**os.environ, "SPECDECODE_CACHE": str(tmp_path)}
    probe = [sys.executable, "-c", "from specdecode.model.cpu_int4 import cpu_isa; print(cpu_isa())"]
    assert subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip() == OURS[0]
    (built,) = (tmp_path / "kernels").glob(f"cpu_{OURS[0]}-*.so")
    built.write_bytes(built.read_bytes()[:8000])
    again = subprocess.run(probe, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.strip() == OURS[0], again.stderr[-500:]
    assert built.stat().st_size > 8000


def test_the_cache_without_a_home_folder(monkeypatch):
    """HOME unset and a user without a passwd entry (some containers): Path.home() raises a
    RuntimeError, which crashed the first RMSNorm of any model; a folder in /tmp serves."""
    from specdecode.model.gguf_convert import _temporary_cache, cache_root

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("SPECDECODE_CACHE", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    mine = Path(tempfile.gettempdir()) / f"specdecode-{os.getuid()}"
    _temporary_cache.cache_clear()  # chosen once a process
    assert cache_root() == mine and not mine.stat().st_mode & 0o022
    assert cache_root() == mine  # the same folder each call
    mine.chmod(0o777)  # open to others (or another user's): they could plant a library there
    _temporary_cache.cache_clear()
    try:
        other = cache_root()
        assert other != mine and other.is_dir() and not other.stat().st_mode & 0o022
        assert cache_root() == other  # not a fresh folder per call
    finally:
        mine.chmod(0o700)
        _temporary_cache.cache_clear()


def test_int4_a8_needs_our_kernel():
    with pytest.raises(SpecDecodeError, match="int8 activations"):
        Int4Linear.from_weight(torch.randn(8, 32), 32, kernel="stock", a8=True)


def test_int8_weights_where_torch_has_no_kernel_get_one_line(monkeypatch):
    """torch's int8 GEMM had CPU kernels only before ~2.9: on CUDA the model loaded, then its first
    pass failed. Stood in for by a torch without the CPU kernel."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key",
                        lambda op, key: key != "CPU" and has(op, key))  # fmt: skip
    with pytest.raises(SpecDecodeError, match="int8 weights have no kernel on cpu in torch"):
        Int8Linear.from_weight(torch.randn(8, 32))
    monkeypatch.undo()
    assert Int8Linear.from_weight(torch.randn(8, 32, device="meta")).weight.is_meta  # its key is "Meta", not "META"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(3, 96), (40, 200), (17, 160)])
def test_int8_matches_dequantized_reference(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    q, s = quantize_int8(w)
    assert close(dequantize_int8(q, s), w, 0.01)
    lin = Int8Linear.from_weight(w, b, dtype=dtype)
    for m in (1, 3, 9):
        x = torch.randn(m, k, generator=gen).to(dtype)
        ref = x.float() @ dequantize_int8(q, s.to(dtype)).T + b.to(dtype).float()
        assert close(lin(x), ref, 1e-5 if dtype == torch.float32 else 1e-2)


def test_parse_quantization():
    assert parse_quantization(None) is None and parse_quantization("none") is None
    assert parse_quantization("int4").group_size == 32
    assert parse_quantization("int4-g128").group_size == 128
    assert parse_quantization("int4", group_size=64).group_size == 64
    assert parse_quantization("gguf").mode == "gguf"
    a8 = parse_quantization("int4-g64-a8")
    assert (a8.mode, a8.group_size, a8.a8, str(a8)) == ("int4", 64, True, "int4-g64-a8")
    assert str(parse_quantization("gguf-a8")) == "gguf-a8" and not parse_quantization("gguf").a8
    assert str(parse_quantization("int4-a8")) == "int4-g32-a8"
    for bad in ("int3", "int4-g48", "q4_1", "INT8", 4, "int8-a8", "none-a8", "a8"):
        with pytest.raises(SpecDecodeError, match="supported"):
            parse_quantization(bad)


# ---- whole tiny models ------------------------------------------------------------------


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(
            tokens[None],
            torch.arange(len(tokens))[None],
            model.new_cache(1, len(tokens)),
        )[0]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    cache = model.new_cache(1, len(prompt) + n)
    x, pos, out = torch.tensor([prompt]), torch.arange(len(prompt))[None], []
    with torch.inference_mode():
        for _ in range(n):
            nxt = model(x, pos, cache)[:, -1].argmax(-1)
            cache.commit(torch.tensor([x.shape[1]]))
            out.append(int(nxt))
            x, pos = nxt[:, None], pos[:, -1:] + 1
    return out


SEQ = torch.tensor([5, 17, 33, 90, 41, 8, 77, 12, 60, 25, 99, 14])


def dequantized_copy(model: nn.Module, quant: str) -> nn.Module:
    """A dense copy whose linears hold exactly the weights the quantized kernels use (head untied)."""
    spec = parse_quantization(quant)
    ref = copy.deepcopy(model)
    for name in linear_names(ref):
        lin = ref.get_submodule(name)
        w = lin.weight.detach().float()
        if spec.mode == "int8":
            q, s = quantize_int8(w)
            deq = dequantize_int8(q, s.to(w.dtype))
        else:
            q, s, z = quantize_int4(w, spec.group_size)
            deq = kernel_weights(q, s, z, spec.group_size, KERNELS[-1])[:, : w.shape[1]]
        new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
        new.weight = nn.Parameter(deq.to(w.dtype), requires_grad=False)
        new.bias = lin.bias
        set_submodule(ref, name, new)
    return ref


@pytest.mark.parametrize("quant", ["int8", "int4", "int4-g64"])
def test_quantized_model_matches_dequantized_weights(tiny_folder, quant):
    dense = load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)
    quantized = load_model(
        str(tiny_folder),
        dtype="float32",
        device="cpu",
        progress=False,
        quantization=quant,
    )
    ref, got = (
        logits(dequantized_copy(dense.model, quant), SEQ),
        logits(quantized.model, SEQ),
    )
    # int8 computes in fp32 here; int4 always in bf16
    assert (got - ref).norm() / ref.norm() < (1e-4 if quant == "int8" else 0.03)
    plain = logits(dense.model, SEQ)  # 4 bits on O(1) random weights: close, not equal
    assert (got - plain).norm() / plain.norm() < (0.03 if quant == "int8" else 0.4)
    model = quantized.model
    kind = Int8Linear if quant == "int8" else Int4Linear
    assert all(isinstance(model.get_submodule(n), kind) for n in ("layers.0.attn.qkv", "layers.2.mlp.down", "lm_head"))
    assert isinstance(model.embed, nn.Embedding)  # a tied table stays dense and equal
    assert torch.equal(model.embed.weight, dense.model.embed.weight)
    assert "(13 layers), float32 embedding" in describe_kernels(model)


def test_quantize_model_in_place_and_bf16(tiny_folder):
    model = load_model(str(tiny_folder), dtype="bfloat16", device="cpu", progress=False).model
    ref = logits(model, SEQ)
    assert quantize_model_(model, "int4-g64", int4_kernel="stock") is model
    assert describe_kernels(model) == "int4pack_mm_for_cpu g64 (13 layers), bfloat16 embedding"
    got = logits(model, SEQ)
    assert got.dtype == torch.float32 and (got - ref).norm() / ref.norm() < 0.4
    with pytest.raises(SpecDecodeError, match="gguf"):
        quantize_model_(model, "gguf")


@pytest.mark.skipif(cpu_lib() is None, reason="needs our CPU library (AVX512-BF16 or AVX2)")
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_cpu_rms_norm_equals_torch_and_is_row_invariant(offset):
    """Inference in bf16 normalises through our one-call kernel: what F.rms_norm gives (and the
    Gemma-style fp32 scaling) within one bf16 rounding (its sum of squares runs in 16 lanes),
    and a row's result does not depend on the others."""
    from specdecode.model.cpu_int4 import fast_cpu_norm
    from specdecode.model.transformer import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6, offset).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g) * 0.3 + (1.0 - offset))
    x = (torch.randn(2, 5, 96, generator=g) * 4).to(torch.bfloat16)
    reference = norm(x)  # autograd on: torch's ops
    with torch.inference_mode():
        assert fast_cpu_norm(x, norm.weight)
        ours = norm(x)
        alone = norm(x[1:, 2:3])
    torch.testing.assert_close(ours, reference, rtol=2**-7, atol=1e-6)
    assert torch.equal(alone, ours[1:, 2:3])


@pytest.mark.parametrize("kernel", OURS)
def test_argmax_kernel_is_torchs_argmax_over_fp32(kernel):
    """Greedy verification's argmax over bf16 logits (kernels/argmax.c) returns the index torch
    returns over the same values in fp32: the first of tied maxima, NaN winning over +inf (the
    first NaN of a row), -0 tied with +0, all-negative and -inf rows, and row lengths with and
    without a vector tail."""
    from specdecode.model.cpu_int4 import cpu_argmax

    g = torch.Generator().manual_seed(0)
    for V in (1, 5, 16, 31, 32, 33, 100, 49152):
        rows = [
            torch.randn(4, V, generator=g) * 8,
            torch.randint(-3, 3, (4, V), generator=g).float(),  # many ties
            -torch.rand(4, V, generator=g) - 1.0,  # all negative
            torch.full((2, V), -float("inf")),
        ]
        x = torch.cat(rows).to(torch.bfloat16)
        x[0, V // 2] = float("nan")
        x[0, -1] = float("nan")
        x[1, V // 3] = float("inf")
        if V > 2:
            x[2, :] = -1.0
            x[2, V - 2], x[2, V - 1] = -0.0, 0.0  # -0 first: the first index of the tie wins
        want = x.float().max(dim=-1).indices
        got = cpu_argmax(x.view(2, -1, V), kernel)
        assert got.shape == (2, x.shape[0] // 2) and torch.equal(got.reshape(-1), want), V
    assert cpu_argmax(torch.randn(3, 8), kernel) is None  # fp32 is torch's
