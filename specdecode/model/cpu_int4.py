"""Our CPU int4 and Q8_0 kernels (AVX512-BF16), compiled with the system C compiler on first use.

Owns: compiling kernels/int4_avx512_bf16.c into the specdecode cache, deciding whether this
machine can run it, packing int4 weights and GGUF Q8_0 blocks into its layouts, and calling
it through ctypes.
Does not own: the quantized Linear modules (quant.py), which fall back to torch's stock
kernel wherever this one is unavailable (no compiler, no AVX512-BF16, or CUDA).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib.resources import files
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.config import SpecDecodeError

# The stock CPU kernel dequantises a weight tile for every block of 4 rows and multiplies in
# fp32, so 5 positions cost ~2-3x one. Ours decodes each 16-column x 2-k slice of nibbles once
# into bf16 (a 16-entry lookup: q in 0..15 is exact in bf16), multiplies it into up to 8 rows
# with vdpbf16ps (fp32 accumulation), and applies the group's scale and zero once per group:
#     y[m, n] = sum_g s[n, g] * (x[m, g] . q[n, g]) + z[n, g] * sum(x[m, g])
# with w = s q + z (z = the stock kernel's zero - 8 s). Scales and zeros are fp16, so GGUF's
# Q4_0 / Q4_1 / Q8_0 blocks (fp16 d and m) are kept bit-exact. Groups of 64 / 128 run as groups
# of 32 with repeated scales. Layout: weight [N/32, G, 16, 32] bytes (q[k] | q[k+1] << 4 for
# 32 columns), scales_and_zeros [N/32, G, 2, 32] fp16. Q8_0 (`pack_q8_avx512_bf16`): int8
# converted to bf16 the same way, one fp16 d per group and no zero term. Threads: OpenMP, which
# resolves to the libgomp that torch has already loaded, so both share one thread pool.

INT4_CPU_KERNELS = ("auto", "avx512_bf16", "stock")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma")


_SOURCES = ("int4_avx512_bf16.c", "block_bf16.c")  # the library: the int4 GEMM, RMSNorm, the fused block


def _sources() -> list[str]:
    return [files("specdecode.model").joinpath(f"kernels/{name}").read_text() for name in _SOURCES]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@functools.cache
def avx512_bf16_lib() -> ctypes.CDLL | None:
    """Our kernel, compiled once into the specdecode cache; None when this CPU or host can't run it."""
    from specdecode.model.gguf_convert import cache_root

    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or not set(_CPU_FLAGS) <= _cpu_flags():
        return None
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
    flags += ["-mf16c", "-lm"]
    sources = _sources()
    digest = hashlib.sha256(("".join(sources) + " ".join(flags)).encode()).hexdigest()[:12]
    target = cache_root() / "kernels" / f"int4_avx512_bf16-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out, srcs = Path(tmp) / "int4.so", [Path(tmp) / name for name in _SOURCES]
            for path, text in zip(srcs, sources):
                path.write_text(text)
            done = subprocess.run([compiler, *flags, "-o", str(out), *map(str, srcs)], check=False, capture_output=True)
            if done.returncode != 0:
                return None
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    lib.int4_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.int4_gemm.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.int4_gemm.restype = None
    lib.rms_norm_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
    lib.rms_norm_bf16.argtypes += [ctypes.c_float, ctypes.c_void_p]
    lib.rms_norm_bf16.restype = None
    lib.bf16_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.bf16_gemm.argtypes += [ctypes.c_void_p, ctypes.c_int]
    lib.bf16_gemm.restype = None
    lib.q8_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.q8_gemm.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.q8_gemm.restype = None
    lib.block_forward.argtypes = [ctypes.c_void_p] * 5
    lib.block_forward.restype = None
    return lib


def pick_cpu_kernel(kernel: str) -> str:
    if kernel not in INT4_CPU_KERNELS:
        raise SpecDecodeError(f"unknown int4 kernel {kernel!r}; supported: {', '.join(INT4_CPU_KERNELS)}")
    if kernel == "stock":
        return "stock"
    if avx512_bf16_lib() is None:
        if kernel == "avx512_bf16":
            raise SpecDecodeError("the avx512_bf16 int4 kernel needs an AVX512-BF16 CPU and a C compiler")
        return "stock"
    return "avx512_bf16"


def pack_avx512_bf16(q: Tensor, scales: Tensor, zeros: Tensor, group_size: int, n_pad: int) -> tuple[Tensor, Tensor]:
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


def pack_q8_avx512_bf16(q: Tensor, d: Tensor, n_pad: int) -> tuple[Tensor, Tensor]:
    """GGUF Q8_0 (q int8 [N, K], d [N, K/32], w = d q) -> q8_gemm's layout (see the kernel source):
    q [N/32, G, 16, 64] int8, each 64 bytes a k pair of 32 columns; d [N/32, G, 32] fp16."""
    N, K = q.shape
    q, d = F.pad(q.to(torch.int8), (0, 0, 0, n_pad)), F.pad(d.float(), (0, 0, 0, n_pad))
    NT, G = (N + n_pad) // 32, K // 32
    # (tile, half, column, group, pair, k) -> (tile, group, pair, half, column, k)
    packed = q.view(NT, 2, 16, G, 16, 2).permute(0, 3, 4, 1, 2, 5).reshape(NT, G, 16, 64).contiguous()
    return packed, d.view(NT, 32, G).permute(0, 2, 1).to(torch.float16).contiguous()


def avx512_bf16_mm(x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    """y [M, N] bf16 = x [M, K] bf16 @ a packed weight: int4 (``packed`` uint8, ``scales`` the
    scales and zeros) or Q8_0 (``packed`` int8, ``scales`` d). Inside torch.compile it runs as
    the opaque custom op below (a ctypes call cannot be traced); eagerly it is called directly,
    since the op dispatcher would add its overhead to every linear of every step."""
    if torch.compiler.is_compiling():
        return _mm_op(x, packed, scales)
    return _mm(x, packed, scales)


def _mm(x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    M, K = x.shape
    N = packed.shape[0] * 32
    y = torch.empty(M, N, dtype=torch.bfloat16)
    lib, threads = avx512_bf16_lib(), torch.get_num_threads()
    if packed.dtype == torch.int8:  # Q8_0
        lib.q8_gemm(x.data_ptr(), M, K, packed.data_ptr(), scales.data_ptr(), N, y.data_ptr(), threads)
    else:
        xs = torch.empty(M * K // 32, dtype=torch.float32)
        lib.int4_gemm(x.data_ptr(), M, K, packed.data_ptr(), scales.data_ptr(), N, y.data_ptr(), xs.data_ptr(), threads)
    return y


def avx512_rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    """RMSNorm of bf16 ``x`` [..., D] by bf16 ``weight`` [D] in one call of our library (see
    rms_norm_bf16 in the kernel source); callers check `avx512_bf16_lib()` first."""
    x = x.contiguous()
    y = torch.empty_like(x)
    D = x.shape[-1]
    avx512_bf16_lib().rms_norm_bf16(x.data_ptr(), x.numel() // D, D, weight.data_ptr(), eps, offset, y.data_ptr())
    return y


def fast_cpu_norm(x: Tensor, weight: Tensor) -> bool:
    """Whether our CPU library normalises ``x``: bf16 on a CPU it compiled for, no autograd, and
    not inside torch.compile (which fuses the torch norm into its neighbours instead)."""
    if torch.compiler.is_compiling():
        return False
    ok = x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
    return ok and x.shape[-1] % 16 == 0 and not torch.is_grad_enabled() and avx512_bf16_lib() is not None


@torch.library.custom_op("specdecode::avx512_bf16_mm", mutates_args=())
def _mm_op(x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    return _mm(x, packed, scales)


@_mm_op.register_fake
def _(x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * 32, dtype=torch.bfloat16)
