"""Weight-only quantized linears: int8 per output channel and group-wise int4.

Owns: `Int8Linear` (``torch._weight_int8pack_mm``), `Int4Linear` (on CPU our AVX512-BF16 kernel,
compiled on first use, else torch's ``_weight_int4pack_mm_for_cpu``; on CUDA
``_weight_int4pack_mm``), the quantize / dequantize helpers that define their numerics,
`quantize_model_` (swap a Transformer's linears in place), the parsing of the ``quantization``
setting and `describe_kernels`.
Does not own: reading GGUF blocks (gguf_convert.py), choosing when to quantize (loader.py).

Numerics (checked against torch 2.13's kernels):
  int8: w = q * s[n], q in [-127, 127], one scale per output row (symmetric).
  int4: w = (q - 8) * s[n, g] + z[n, g], q in [0, 15], one (scale, zero) per row and group of
        ``group_size`` inputs. torch's kernels take ``scales_and_zeros`` [K/g, N, 2] in bf16 and
        dequantise in fp32 (``lut[q] * s + z``), accumulate in fp32 and round the output to bf16.
        Only bf16 is vectorised on CPU (fp32/fp16 run a scalar loop ~30x slower), so int4 always
        computes in bf16 and casts the result back to the activation dtype. Our kernel (bottom of
        this file) keeps s and z - 8 s in fp16 instead, which holds GGUF's fp16 block scales exactly.
Both modules pad K internally (int4: to a group multiple; int8: to a multiple of 32, as the bf16
CPU kernel crashes otherwise) and int4 pads N to its kernel's column tiles (16 or 32).

Kernel choice (measured with benchmarks/bench_quant.py, SmolLM2-135M, 2 threads): ours is faster
than torch's int4 CPU kernel at every M from 1 to 48 (at M = 1 by ~5-15%, at M = 5 by ~1.5x),
because torch's re-dequantises every weight tile per block of 4 rows; so there is no per-M switch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.config import SpecDecodeError

QUANTIZATIONS = ("none", "int8", "int4", "int4-g32", "int4-g64", "int4-g128", "gguf")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
LINEAR_NAMES = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # per Block, plus lm_head


@dataclass(frozen=True)
class Quantization:
    mode: str  # "int8" | "int4" | "gguf"
    group_size: int | None = None  # int4 only


def parse_quantization(value: str | None, group_size: int | None = None) -> Quantization | None:
    """None / "none" -> None; "int8", "int4" (g32), "int4-g64", ..., "gguf" -> a Quantization."""
    if value is None or value == "none":
        return None
    if not isinstance(value, str) or value not in QUANTIZATIONS:
        raise SpecDecodeError(f"unsupported quantization {value!r}; supported: {', '.join(QUANTIZATIONS)}")
    if value.startswith("int4"):
        g = int(value.removeprefix("int4-g")) if "-g" in value else group_size or DEFAULT_GROUP_SIZE
        if group_size is not None and group_size != g:
            raise SpecDecodeError(f"quantization {value!r} contradicts group_size={group_size}")
        if g not in GROUP_SIZES:
            raise SpecDecodeError(f"unsupported int4 group size {g}; supported: {', '.join(map(str, GROUP_SIZES))}")
        return Quantization("int4", g)
    if group_size is not None:
        raise SpecDecodeError(f"group_size applies to int4 only, not {value!r}")
    return Quantization(value)


# ---- numerics --------------------------------------------------------------------------


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: (q int8 [N, K], scales fp32 [N]) with w ~ q * scales[:, None]."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    return q.float() * scales.float()[:, None]


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric group-wise int4 over K padded to a multiple of ``group_size`` (with zeros).

    Returns (q uint8 [N, Kp] in [0, 15], scales fp32 [N, Kp/g], zeros fp32 [N, Kp/g]) with
    w ~ (q - 8) * s + z per group: s = (max - min) / 15, z = min + 8 s (gpt-fast's convention).
    """
    w = w.float()
    N, K = w.shape
    w = F.pad(w, (0, -K % group_size)).view(N, -1, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view(N, -1), scales, lo + 8 * scales


def dequantize_int4(q: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """fp32 [N, Kp]: (q - 8) * s + z, the formula the kernels evaluate (with their s, z dtype)."""
    N = q.shape[0]
    w = (q.float().view(N, -1, group_size) - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return w.view(N, -1)


# ---- modules -----------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """y = x @ (q * s).T + b with int8 q [N, K] and per-row scales, via ``_weight_int8pack_mm``.

    Computes in ``dtype`` (the scales' dtype); other activation dtypes are cast in and out.
    """

    def __init__(self, q: Tensor, scales: Tensor, bias: Tensor | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.k_pad = -self.in_features % 32  # the bf16 CPU kernel crashes on K % 16 != 0
        self.register_buffer("weight", F.pad(q.to(torch.int8), (0, self.k_pad)).contiguous())
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    @classmethod
    def from_weight(cls, w: Tensor, bias: Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        q, s = quantize_int8(w)
        return cls(q.to(w.device), s.to(w.device), bias, dtype)

    def kernel(self) -> str:
        return f"int8pack_mm {str(self.scales.dtype).removeprefix('torch.')}"

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.scales.dtype)
        if self.k_pad:
            x2 = F.pad(x2, (0, self.k_pad))
        y = torch._weight_int8pack_mm(x2.contiguous(), self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(nn.Module):
    """y = x @ W.T + b with W = (q - 8) * s + z group-wise (``dequantize_int4``), computed in bf16.

    Built from (q uint8 [N, P * Kp] in [0, 15], scales and zeros [N, P * Kp / g]) where Kp is K
    padded to a multiple of ``group_size`` (the padded columns meet zero inputs) and P =
    ``input_planes``: W is the sum of P int4 matrices side by side, each applied to the same input
    (GGUF Q8_0 = 16 * hi nibble + lo nibble). ``source`` labels where the weights came from.
    """

    def __init__(
        self,
        q: Tensor,
        scales: Tensor,
        zeros: Tensor,
        group_size: int,
        in_features: int | None = None,
        bias: Tensor | None = None,
        input_planes: int = 1,
        source: str = "",
        kernel: str = "auto",
    ):
        super().__init__()
        N, width = q.shape
        plane = width // input_planes
        G = width // group_size
        if width % input_planes or plane % group_size or scales.shape != (N, G) or zeros.shape != scales.shape:
            raise ValueError(f"int4: q {tuple(q.shape)}, scales {tuple(scales.shape)}, group {group_size} disagree")
        self.out_features, self.in_features = N, in_features or plane
        self.group_size, self.input_planes, self.source = group_size, input_planes, source
        self.k_pad = plane - self.in_features
        self.n_pad = -N % 16  # the CPU kernel works on 16-column tiles
        device = q.device
        self.impl = "cuda" if device.type == "cuda" else _pick_cpu_kernel(kernel)
        if self.impl == "avx512_bf16":
            self.n_pad = -N % 32
            packed, sz = _pack_avx512_bf16(q, scales, zeros, group_size, self.n_pad)
            self.register_buffer("weight", packed)
            self.register_buffer("scales_and_zeros", sz)
            self.register_buffer("bias", None if bias is None else bias.float())
            return
        q = F.pad(q.to(torch.int32), (0, 0, 0, self.n_pad), value=8)
        sz = torch.stack((scales.float(), zeros.float()), dim=-1)  # [N, G, 2]
        sz = F.pad(sz, (0, 0, 0, 0, 0, self.n_pad)).transpose(0, 1).contiguous()  # [G, Np, 2]
        if device.type == "cuda":
            packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            tiles = 8 if width % 128 == 0 else 4 if width % 64 == 0 else 2
            packed = torch._convert_weight_to_int4pack(packed_u8.contiguous(), tiles)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def from_weight(
        cls, w: Tensor, group_size: int = DEFAULT_GROUP_SIZE, bias: Tensor | None = None, kernel: str = "auto"
    ) -> Int4Linear:
        q, s, z = quantize_int4(w, group_size)
        return cls(q, s, z, group_size, in_features=w.shape[1], bias=bias, kernel=kernel)

    def kernel(self) -> str:
        name = {"cuda": "int4pack_mm", "stock": "int4pack_mm_for_cpu", "avx512_bf16": "int4 avx512_bf16"}[self.impl]
        planes = f" x{self.input_planes} planes" if self.input_planes > 1 else ""
        return f"{name} g{self.group_size}{planes}" + (f" ({self.source})" if self.source else "")

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.k_pad:
            x2 = F.pad(x2, (0, self.k_pad))
        if self.input_planes > 1:
            x2 = x2.repeat(1, self.input_planes)
        x2 = x2.contiguous()
        if self.impl == "avx512_bf16":
            y = _avx512_bf16_mm(x2, self.weight, self.scales_and_zeros)
        elif self.impl == "cuda":
            y = torch._weight_int4pack_mm(x2, self.weight, self.group_size, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.weight, self.group_size, self.scales_and_zeros)
        if self.n_pad:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = (y.float() + self.bias).to(y.dtype)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, input_planes={self.input_planes}, bias={self.bias is not None}"
        )


# ---- whole models ------------------------------------------------------------------------


def linear_names(model: nn.Module) -> list[str]:
    """The quantizable linears of a Transformer: every block's qkv, o, gate_up, down, then lm_head."""
    return [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in LINEAR_NAMES] + ["lm_head"]


def quantize_model_(
    model: nn.Module, quantization: str, group_size: int | None = None, int4_kernel: str = "auto"
) -> nn.Module:
    """Replace the Transformer's linears by Int8Linear / Int4Linear in place; returns the model.

    A head tied to the embeddings is quantized as its own copy; the embedding table stays as is.
    """
    spec = parse_quantization(quantization, group_size)
    if spec is None:
        return model
    if spec.mode == "gguf":
        raise SpecDecodeError("quantization 'gguf' needs the GGUF file: use load_model(path, quantization='gguf')")
    dtype = model.embed.weight.dtype
    for name in linear_names(model):
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            continue
        w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
        if spec.mode == "int8":
            new = Int8Linear.from_weight(w, b, dtype=dtype)
        else:
            new = Int4Linear.from_weight(w, spec.group_size, b, kernel=int4_kernel)
        set_submodule(model, name, new)
    return model


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def describe_kernels(model: nn.Module) -> str:
    """One line naming the matmul kernels that run, e.g.
    ``int4pack_mm_for_cpu g32 (211 layers), bf16 embedding``."""
    kinds: Counter[str] = Counter()
    for name in linear_names(model):
        m = model.get_submodule(name)
        if isinstance(m, (Int8Linear, Int4Linear)):
            kinds[m.kernel()] += 1
        else:
            kinds[f"{str(m.weight.dtype).removeprefix('torch.')} matmul"] += 1
    parts = [f"{k} ({n} layer{'s' * (n != 1)})" for k, n in kinds.items()]
    emb = str(model.embed.weight.dtype).removeprefix("torch.")
    return ", ".join(parts + [f"{emb} embedding"])


# ---- our CPU int4 kernel (AVX512-BF16), compiled on first use ----------------------------
#
# The stock CPU kernel dequantises a weight tile for every block of 4 rows and multiplies in
# fp32, so 5 positions cost ~2-3x one. Ours decodes each 16-column x 2-k slice of nibbles once
# into bf16 (a 16-entry lookup: q in 0..15 is exact in bf16), multiplies it into up to 8 rows
# with vdpbf16ps (fp32 accumulation), and applies the group's scale and zero once per group:
#     y[m, n] = sum_g s[n, g] * (x[m, g] . q[n, g]) + z[n, g] * sum(x[m, g])
# with w = s q + z (z = the stock kernel's zero - 8 s). Scales and zeros are fp16, so GGUF's
# Q4_0 / Q4_1 / Q8_0 blocks (fp16 d and m) are kept bit-exact. Groups of 64 / 128 run as groups
# of 32 with repeated scales. Layout: weight [N/32, G, 16, 32] bytes (q[k] | q[k+1] << 4 for
# 32 columns), scales_and_zeros [N/32, G, 2, 32] fp16. Threads: OpenMP, which resolves to the
# libgomp that torch has already loaded, so both share one thread pool.

INT4_CPU_KERNELS = ("auto", "avx512_bf16", "stock")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma")
_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) void tile(
    const int MB, const uint16_t* x, int K, const float* xs, const uint8_t* wp,
    const uint16_t* sz, int G, uint16_t* y, int ldy) {
  const __m512i mask = _mm512_set1_epi32(0x000F000F);
  const __m512i lut = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
      0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);  /* bf16(15) ... bf16(0) */
  __m512 o[8][2];
#pragma GCC unroll 8
  for (int r = 0; r < MB; r++) o[r][0] = o[r][1] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++) {
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int r = 0; r < MB; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint8_t* gp = wp + (size_t)g * 512;
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) _mm_prefetch((const char*)(gp + 2048 + 64 * i), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int p = 0; p < 16; p++) {
      __m256i b = _mm256_loadu_si256((const __m256i*)(gp + p * 32));
      __m512i v0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(b));
      __m512i v1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1));
      /* (v | v << 12) & 0x000F000F: lo nibble in the low word, hi nibble in the high word */
      v0 = _mm512_ternarylogic_epi32(v0, _mm512_slli_epi32(v0, 12), mask, 0xA8);
      v1 = _mm512_ternarylogic_epi32(v1, _mm512_slli_epi32(v1, 12), mask, 0xA8);
      __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(v0, lut);
      __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(v1, lut);
#pragma GCC unroll 8
      for (int r = 0; r < MB; r++) {
        uint32_t pair;
        memcpy(&pair, x + (size_t)r * K + g * 32 + 2 * p, 4);
        __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      }
    }
    const uint16_t* sp = sz + (size_t)g * 64;
    __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sp));
    __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 16)));
    __m512 z0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 32)));
    __m512 z1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 48)));
#pragma GCC unroll 8
    for (int r = 0; r < MB; r++) {
      __m512 xv = _mm512_set1_ps(xs[r * G + g]);
      o[r][0] = _mm512_fmadd_ps(s0, acc[r][0], _mm512_fmadd_ps(z0, xv, o[r][0]));
      o[r][1] = _mm512_fmadd_ps(s1, acc[r][1], _mm512_fmadd_ps(z1, xv, o[r][1]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MB; r++) {
    _mm256_storeu_si256((__m256i*)(y + (size_t)r * ldy), (__m256i)_mm512_cvtneps_pbh(o[r][0]));
    _mm256_storeu_si256((__m256i*)(y + (size_t)r * ldy + 16), (__m256i)_mm512_cvtneps_pbh(o[r][1]));
  }
}

#define TILE(MB) static void tile##MB(const uint16_t* x, int K, const float* xs, const uint8_t* wp, \
    const uint16_t* sz, int G, uint16_t* y, int ldy) { tile(MB, x, K, xs, wp, sz, G, y, ldy); }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
typedef void (*tile_fn)(const uint16_t*, int, const float*, const uint8_t*, const uint16_t*, int, uint16_t*, int);
static const tile_fn TILES[9] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8};

/* y [M, N] bf16 = x [M, K] bf16 @ W.T; K % 32 == 0, N % 32 == 0; xs: M * K / 32 floats of scratch */
void int4_gemm(const uint16_t* x, int M, int K, const uint8_t* wp, const uint16_t* sz, int N, uint16_t* y,
               float* xs, int threads) {
  const int G = K / 32, NT = N / 32, MBN = (M + 7) / 8;
  for (int i = 0; i < M * G; i++) {
    float s = 0;
    for (int j = 0; j < 32; j++) {
      uint32_t u = (uint32_t)x[(size_t)i * 32 + j] << 16;
      float f;
      memcpy(&f, &u, 4);
      s += f;
    }
    xs[i] = s;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int job = 0; job < NT * MBN; job++) {
    int t = job % NT, r0 = job / NT * 8, mbs = M - r0 < 8 ? M - r0 : 8;
    TILES[mbs](x + (size_t)r0 * K, K, xs + r0 * G, wp + (size_t)t * G * 512, sz + (size_t)t * G * 64, G,
               y + (size_t)r0 * N + t * 32, N);
  }
}
"""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@functools.cache
def _avx512_bf16_lib() -> ctypes.CDLL | None:
    """Our kernel, compiled once into the specdecode cache; None when this CPU or host can't run it."""
    from specdecode.model.gguf_convert import cache_root

    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or not set(_CPU_FLAGS) <= _cpu_flags():
        return None
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
    flags += ["-mf16c"]
    digest = hashlib.sha256((_SOURCE + " ".join(flags)).encode()).hexdigest()[:12]
    target = cache_root() / "kernels" / f"int4_avx512_bf16-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, out = Path(tmp) / "int4.c", Path(tmp) / "int4.so"
            src.write_text(_SOURCE)
            done = subprocess.run([compiler, *flags, "-o", str(out), str(src)], check=False, capture_output=True)
            if done.returncode != 0:
                return None
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    lib.int4_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.int4_gemm.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.int4_gemm.restype = None
    return lib


def _pick_cpu_kernel(kernel: str) -> str:
    if kernel not in INT4_CPU_KERNELS:
        raise SpecDecodeError(f"unknown int4 kernel {kernel!r}; supported: {', '.join(INT4_CPU_KERNELS)}")
    if kernel == "stock":
        return "stock"
    if _avx512_bf16_lib() is None:
        if kernel == "avx512_bf16":
            raise SpecDecodeError("the avx512_bf16 int4 kernel needs an AVX512-BF16 CPU and a C compiler")
        return "stock"
    return "avx512_bf16"


def _pack_avx512_bf16(q: Tensor, scales: Tensor, zeros: Tensor, group_size: int, n_pad: int) -> tuple[Tensor, Tensor]:
    """(q [N, Kp], scales / stock-convention zeros [N, Kp/g]) -> our layout (see above)."""
    N, Kp = q.shape
    rep = group_size // 32
    s = scales.double().repeat_interleave(rep, dim=1)
    z = zeros.double().repeat_interleave(rep, dim=1) - 8 * s  # w = s q + z
    q = F.pad(q.to(torch.uint8), (0, 0, 0, n_pad))
    s, z = F.pad(s, (0, 0, 0, n_pad)), F.pad(z, (0, 0, 0, n_pad))
    NT, G = (N + n_pad) // 32, Kp // 32
    q = q.view(NT, 32, G, 16, 2)
    packed = (q[..., 0] | q[..., 1] << 4).permute(0, 2, 3, 1).contiguous()  # [NT, G, 16, 32]
    sz = torch.stack((s.view(NT, 32, G), z.view(NT, 32, G)), dim=2).permute(0, 3, 2, 1)  # [NT, G, 2, 32]
    return packed, sz.to(torch.float16).contiguous()


def _avx512_bf16_mm(x: Tensor, packed: Tensor, sz: Tensor) -> Tensor:
    M, K = x.shape
    N = packed.shape[0] * 32
    y = torch.empty(M, N, dtype=torch.bfloat16)
    xs = torch.empty(M * K // 32, dtype=torch.float32)
    _avx512_bf16_lib().int4_gemm(
        x.data_ptr(), M, K, packed.data_ptr(), sz.data_ptr(), N, y.data_ptr(), xs.data_ptr(), torch.get_num_threads()
    )
    return y
