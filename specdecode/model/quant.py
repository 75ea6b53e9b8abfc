"""Quantized linears: int8 per output channel and group-wise int4, weight-only; and on our CPU
kernel, int4 / GGUF Q8_0 times int8-quantized activations ("-a8", opt-in).

Owns: `Int8Linear` (``torch._weight_int8pack_mm``), `Int4Linear` (on CPU our kernel, AMX,
AVX512-BF16 or AVX2, compiled on first use, else torch's ``_weight_int4pack_mm_for_cpu``; on CUDA
``_weight_int4pack_mm``), `Q8Linear` (GGUF Q8_0 blocks as they are, on our CPU kernel),
the quantize / dequantize helpers that define their numerics,
`quantize_model_` (swap a Transformer's linears in place), the parsing of the ``quantization``
setting and `describe_kernels`.
Does not own: reading GGUF blocks (gguf_convert.py), choosing when to quantize (loader.py).

Numerics (checked against torch 2.13's kernels):
  int8: w = q * s[n], q in [-127, 127], one scale per output row (symmetric).
  int4: w = (q - 8) * s[n, g] + z[n, g], q in [0, 15], one (scale, zero) per row and group of
        ``group_size`` inputs. torch's kernels take ``scales_and_zeros`` [K/g, N, 2] in bf16 and
        dequantise in fp32 (``lut[q] * s + z``), accumulate in fp32 and round the output to bf16.
        Only bf16 is vectorised on CPU (fp32/fp16 run a scalar loop, far slower), so int4 always
        computes in bf16 and casts the result back to the activation dtype. Our kernel (bottom of
        this file) keeps s and z - 8 s in fp16 instead, which holds GGUF's fp16 block scales exactly.
  a8:   the int4 / Q8_0 weights above times x quantized per row and group of 32 to int8
        (d = max|x| / 127, nearest even), integer dot products; see kernels/a8_avx2.c.
Both modules pad K internally (int4: to a group multiple; int8: to a multiple of 32, as the bf16
CPU kernel crashes otherwise) and int4 pads N to its kernel's column tiles (16 or 32).

Kernel choice (benchmarks/bench_quant.py compares them): ours is faster than torch's int4 CPU
kernel at every row count M from 1 to 48 (by more at several rows than at one), because
torch's re-dequantises every weight tile per block of 4 rows; so there is no per-M switch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.config import SpecDecodeError
from specdecode.model.cpu_int4 import (
    CPU_ISAS, cpu_isa, cpu_mm, pack_int4_a8, pack_int4_cpu, pack_q8_a8, pack_q8_cpu, pick_cpu_kernel,
)  # fmt: skip

QUANTIZATIONS = ("auto", "none", "int8", "int4", "int4-g32", "int4-g64", "int4-g128", "gguf")
# "-a8": the same int4 weights times int8-quantized activations (our CPU kernel; see cpu_int4.py)
QUANTIZATIONS += tuple(f"{q}-a8" for q in QUANTIZATIONS if q.startswith(("int4", "gguf")))
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
LINEAR_NAMES = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # per Block, plus lm_head


@dataclass(frozen=True)
class Quantization:
    mode: str  # "int8" | "int4" | "gguf" | "auto" (load_model resolves it to "gguf" or none)
    group_size: int | None = None  # int4 only
    a8: bool = False  # the int4 / Q8_0 weights times int8-quantized activations (int4 and gguf only)

    def __str__(self) -> str:
        base = f"int4-g{self.group_size}" if self.mode == "int4" else self.mode
        return base + "-a8" * self.a8


def parse_quantization(value: str | None, group_size: int | None = None) -> Quantization | None:
    """None / "none" -> None; "int8", "int4" (g32), "int4-g64", ..., "gguf", and "int4...-a8" /
    "gguf-a8" (int8 activations) -> a Quantization."""
    if value is None or value == "none":
        return None
    if not isinstance(value, str) or value not in QUANTIZATIONS:
        raise SpecDecodeError(f"unsupported quantization {value!r}; supported: {', '.join(QUANTIZATIONS)}")
    if value.endswith("-a8"):
        return replace(parse_quantization(value.removesuffix("-a8"), group_size), a8=True)
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
        key = {"meta": "Meta", "privateuseone": "PrivateUse1"}.get(q.device.type, q.device.type.upper())
        if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", key):
            # torch had CPU kernels only before ~2.9: the first forward would fail instead
            raise SpecDecodeError(
                f"int8 weights have no kernel on {q.device.type} in torch {torch.__version__}: use int4 or none"
            )
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
    ``a8``: each row's inputs are quantized to int8 per group of 32 and multiplied as integers
    (our CPU kernel only; faster on CPUs without AVX512-BF16, not exact to the dequantised W).
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
        a8: bool = False,
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
        self.impl = "cuda" if device.type == "cuda" else pick_cpu_kernel(kernel)
        self.a8 = a8
        if a8 and self.impl not in CPU_ISAS:
            raise SpecDecodeError(f"int8 activations (-a8) need our CPU int4 kernel (AVX2), not {self.impl!r}")
        if self.impl in CPU_ISAS:  # ours
            self.n_pad = -N % (8 if a8 else 32)
            packed, sz = (pack_int4_a8 if a8 else pack_int4_cpu)(q, scales, zeros, group_size, self.n_pad)
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
        cls, w: Tensor, group_size: int = DEFAULT_GROUP_SIZE, bias: Tensor | None = None, kernel: str = "auto",
        a8: bool = False,
    ) -> Int4Linear:  # fmt: skip
        q, s, z = quantize_int4(w, group_size)
        return cls(q, s, z, group_size, in_features=w.shape[1], bias=bias, kernel=kernel, a8=a8)

    def kernel(self) -> str:
        name = {"cuda": "int4pack_mm", "stock": "int4pack_mm_for_cpu"}.get(self.impl, f"int4 {self.impl}")
        planes = f" x{self.input_planes} planes" if self.input_planes > 1 else ""
        act = " x int8 activations" if self.a8 else ""
        return f"{name} g{self.group_size}{planes}{act}" + (f" ({self.source})" if self.source else "")

    def forward(self, x: Tensor) -> Tensor:
        return _bf16_linear(self, x, self._mm)

    def _mm(self, x2: Tensor) -> Tensor:
        if self.input_planes > 1:
            x2 = torch.cat([x2] * self.input_planes, dim=1)  # [M, planes·K]; cat: cheaper than repeat for these shapes
        x2 = x2.contiguous()
        if self.impl in CPU_ISAS:
            return cpu_mm(x2, self.weight, self.scales_and_zeros, self.impl, self.a8)
        if self.impl == "cuda":
            return torch._weight_int4pack_mm(x2, self.weight, self.group_size, self.scales_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(x2, self.weight, self.group_size, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, input_planes={self.input_planes}, a8={self.a8}, "
            f"bias={self.bias is not None}"
        )


class Q8Linear(nn.Module):
    """y = x @ W.T + b for GGUF Q8_0 weights kept as they are: W = d[n, g] * q[n, k], q int8 and
    one fp16 d per 32 inputs, through our CPU kernel in bf16 (`Q8Linear.available()`; elsewhere
    the loader keeps Q8_0 as two int4 planes); ``kernel`` picks its build (cpu_int4.CPU_ISAS).
    1.06 bytes a weight, against 1.25 for the planes: for the default model's tied Q8_0 head,
    30 MB read per token instead of 35. ``a8``: times int8-quantized activations (Int4Linear's)."""

    def __init__(
        self, q: Tensor, d: Tensor, in_features: int, bias: Tensor | None = None, source: str = "Q8_0",
        kernel: str = "auto", a8: bool = False,
    ):  # fmt: skip
        super().__init__()
        N, K = q.shape
        if K % 32 or d.shape != (N, K // 32) or in_features > K:
            raise ValueError(f"q8: q {tuple(q.shape)}, d {tuple(d.shape)}, in_features {in_features} disagree")
        self.impl = pick_cpu_kernel(kernel)
        if self.impl not in CPU_ISAS:
            raise SpecDecodeError(f"Q8_0 weights kept as they are need our CPU kernel, not {self.impl!r}")
        self.out_features, self.in_features, self.source = N, in_features, source
        self.k_pad, self.n_pad, self.a8 = K - in_features, -N % (8 if a8 else 32), a8
        packed, scales = pack_q8_a8(q, d, self.n_pad) if a8 else pack_q8_cpu(q, d, self.n_pad)
        self.register_buffer("weight", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.float())

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cpu" and cpu_isa() is not None

    def kernel(self) -> str:
        return f"q8_0 {self.impl} g32{' x int8 activations' * self.a8} ({self.source})"

    def forward(self, x: Tensor) -> Tensor:
        mm = lambda x2: cpu_mm(x2.contiguous(), self.weight, self.scales, self.impl, self.a8)  # noqa: E731
        return _bf16_linear(self, x, mm)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, a8={self.a8}, "
                f"bias={self.bias is not None}")  # fmt: skip


def _bf16_linear(m: Int4Linear | Q8Linear, x: Tensor, mm: Callable[[Tensor], Tensor]) -> Tensor:
    """``x`` [..., in] -> [..., out] through ``mm`` (bf16 [M, in + k_pad] -> [M, out + n_pad]):
    the padding, the bias in fp32 and the casts that both packed linears share."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, m.in_features).to(torch.bfloat16)
    if m.k_pad:
        x2 = F.pad(x2, (0, m.k_pad))
    y = mm(x2)
    if m.n_pad:
        y = y[:, : m.out_features]
    if m.bias is not None:
        y = (y.float() + m.bias).to(y.dtype)
    return y.to(x.dtype).reshape(*lead, m.out_features)


# ---- whole models ------------------------------------------------------------------------


def linear_names(model: nn.Module) -> list[str]:
    """The quantizable linears of a Transformer: every block's qkv, o, gate_up, down, then lm_head."""
    return [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in LINEAR_NAMES] + ["lm_head"]


def quantize_model_(
    model: nn.Module, quantization: str, group_size: int | None = None, int4_kernel: str = "auto"
) -> nn.Module:  # quantization: a setting ("int4-g64-a8", ...) as parse_quantization reads it
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
        if isinstance(lin, nn.Linear):
            set_submodule(model, name, quantized_linear(lin, spec, dtype, int4_kernel))
    model.use_cpu_blocks(int4_kernel)  # the fused CPU block runs from the new weights, where it applies
    return model


def quantized_linear(lin: nn.Linear, spec: Quantization, dtype: torch.dtype, int4_kernel: str = "auto") -> nn.Module:
    """``lin`` as an Int8Linear (computing in ``dtype``) or an Int4Linear (``spec``'s group size
    and activations)."""
    w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
    if spec.mode == "int8":
        return Int8Linear.from_weight(w, b, dtype=dtype)
    return Int4Linear.from_weight(w, spec.group_size, b, kernel=int4_kernel, a8=spec.a8)


def quantize_linears_(module: nn.Module, quantization: str | None) -> nn.Module:
    """Every plain ``nn.Linear`` inside ``module`` as Int8Linear / Int4Linear, in place: a learned
    drafter's own net in its target's weight format, through the same kernels. A GGUF target's
    drafters use int4 in groups of 32 (their weights come from safetensors, not the GGUF).
    Modules held outside the tree (a borrowed target head) are not touched."""
    spec = parse_quantization(quantization)
    if spec is None:
        return module
    if spec.mode != "int8":  # int4 in the target's group size (GGUF: 32) and activations
        spec = Quantization("int4", spec.group_size or DEFAULT_GROUP_SIZE, spec.a8)
    for name, lin in [(n, m) for n, m in module.named_modules() if type(m) is nn.Linear]:
        set_submodule(module, name, quantized_linear(lin, spec, lin.weight.dtype))
    return module


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace ``model.<name>``; the fused CPU blocks of every Transformer in ``model``, which
    point into the old weights, are dropped (`Transformer.use_cpu_blocks` builds them again)."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
    for m in model.modules():  # the model itself, or a decoder body inside a drafter's net (a
        if hasattr(m, "cpu_blocks"):  # Transformer, found by its field: quant sits below transformer.py)
            m.cpu_blocks = None


def describe_kernels(model: nn.Module) -> str:
    """One line naming the matmul kernels that run, e.g.
    ``int4pack_mm_for_cpu g32 (211 layers), bf16 embedding``."""
    kinds: Counter[str] = Counter()
    for name in linear_names(model):
        m = model.get_submodule(name)
        if isinstance(m, (Int8Linear, Int4Linear, Q8Linear)):
            kinds[m.kernel()] += 1
        else:
            kinds[f"{str(m.weight.dtype).removeprefix('torch.')} matmul"] += 1
    parts = [f"{k} ({n} layer{'s' * (n != 1)})" for k, n in kinds.items()]
    emb = str(model.embed.weight.dtype).removeprefix("torch.")
    fused = [f"fused CPU blocks ({model.cpu_blocks.isa})"] if model.cpu_blocks is not None else []
    return ", ".join(parts + [f"{emb} embedding"] + fused)
