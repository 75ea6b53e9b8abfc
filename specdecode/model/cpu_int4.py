"""Our CPU int4 and Q8_0 kernels and fused block, compiled with the system C compiler on first use.

Owns: compiling kernels/*.c into the specdecode cache for the best instruction set the host
CPU has (AMX, else AVX512-BF16, else AVX2 + FMA + F16C), deciding whether the host can run them,
packing int4 weights and GGUF Q8_0 blocks into their layouts (one layout for every build),
and calling them through ctypes.
Does not own: the quantized Linear modules (quant.py), which fall back to torch's stock
kernel wherever no build is available (no compiler, an older CPU, or CUDA).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from importlib.resources import files
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.config import SpecDecodeError

# The stock CPU kernel dequantises a weight tile for every block of 4 rows and multiplies in
# fp32, so 5 positions cost several times one. Ours decodes each slice of nibbles once for several rows
# (AVX512: 16 columns x 2 k into bf16, a 16-entry lookup: q in 0..15 is exact in bf16,
# multiplied into up to 8 rows with vdpbf16ps; AVX2: into fp32, 16 columns for 1-2 rows or 8
# columns for up to 5, with FMAs), accumulates in fp32, and applies the group's scale and zero
# once per group:
#     y[m, n] = sum_g s[n, g] * (x[m, g] . q[n, g]) + z[n, g] * sum(x[m, g])
# with w = s q + z (z = the stock kernel's zero - 8 s). Scales and zeros are fp16, so GGUF's
# Q4_0 / Q4_1 / Q8_0 blocks (fp16 d and m) are kept bit-exact. Groups of 64 / 128 run as groups
# of 32 with repeated scales. Layout: weight [N/32, G, 16, 32] bytes (q[k] | q[k+1] << 4 for
# 32 columns), scales_and_zeros [N/32, G, 2, 32] fp16. Q8_0 (`pack_q8_cpu`): int8
# converted the same way, one fp16 d per group and no zero term. Threads: OpenMP, which
# resolves to the libgomp that torch has already loaded, so both share one thread pool.
# Opt-in int8 activations (quantization "...-a8", kernels/a8_avx2.c, in both builds): each
# row's groups of 32 inputs quantized to int8 and multiplied by the int4 or Q8_0 weights with
# vpmaddubsw, as llama.cpp does; not exact to the dequantised weights, but still row-invariant.

# One library per instruction set, the same entry points and weight layouts in each: the
# AVX512 build multiplies bf16 pairs with vdpbf16ps; the AMX build (the same sources with the
# tile instructions enabled) decodes each group's weights to bf16 once and multiplies up to 16
# rows in two tile instructions, so verifying 16 positions costs little more than one;
# the AVX2 build (kernels/*_avx2.c) widens weights to fp32 and uses FMAs. Listed best first:
# "auto" takes the first the host CPU runs.
CPU_ISAS = {
    "amx": (
        ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma"),
        ("int4_avx512_bf16.c", "block_bf16.c", "a8_avx2.c", "argmax.c", "invariant.c"),
        ("-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c"),
    ),
    "avx512_bf16": (
        ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma"),
        ("int4_avx512_bf16.c", "block_bf16.c", "a8_avx2.c", "argmax.c", "invariant.c"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c"),
    ),
    "avx2": (
        ("avx2", "fma", "f16c"),
        ("int4_avx2.c", "block_avx2.c", "a8_avx2.c", "argmax.c", "invariant.c"),
        ("-mavx2", "-mfma", "-mf16c"),
    ),
}
INT4_CPU_KERNELS = ("auto", *CPU_ISAS, "stock")
_HEADERS = ("avx2.h", "block.h", "block_body.h", "sum16.h")


def _read(name: str) -> str:
    return files("specdecode.model").joinpath(f"kernels/{name}").read_text()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cpu_isa() -> str | None:
    """The instruction set our CPU library is built for on the host (the best it runs), or None."""
    return next((isa for isa in CPU_ISAS if cpu_lib(isa) is not None), None)


COMPILE_TIMEOUT_S = 300  # a build takes seconds: a generous bound for a slow or busy host
QUIET_ISAS = ("amx",)  # builds whose flags a compiler may not know (GCC < 11): checked first, skipped quietly


def _compiler_takes(compiler: str, flags: tuple[str, ...]) -> bool:
    """Whether ``compiler`` accepts ``flags`` (compiling an empty C file)."""
    cmd = [compiler, *flags, "-x", "c", "-c", "-o", os.devnull, "-"]
    try:
        return subprocess.run(cmd, input=b"int x;\n", capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def cpu_lib(isa: str | None = None) -> ctypes.CDLL | None:
    """Our library for ``isa`` (default: the best the host CPU runs), compiled once into the
    specdecode cache; None when the host's CPU or compiler can't run it."""
    from specdecode.model.gguf_convert import cache_root

    if isa is None:
        best = cpu_isa()
        return None if best is None else cpu_lib(best)
    needs, sources, isa_flags = CPU_ISAS[isa]
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or not set(needs) <= _cpu_flags():
        return None
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", *isa_flags]
    texts = {name: _read(name) for name in (*sources, *_HEADERS)}
    digest = hashlib.sha256(("".join(texts.values()) + " ".join(flags)).encode()).hexdigest()[:12]
    target = cache_root() / "kernels" / f"cpu_{isa}-{digest}.so"
    check = target.with_suffix(".sha256")  # the built file's own hash: a damaged one (truncated by a copy
    # or a crash) killed every later process with SIGBUS in dlopen, which Python cannot catch
    try:
        if not target.is_file() or not check.is_file() or check.read_text() != _file_hash(target):
            if isa in QUIET_ISAS and not _compiler_takes(compiler, isa_flags):
                return None  # an older compiler (GCC < 11): the next build serves, without a warning every load
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / "lib.so"
                for name, text in texts.items():
                    (Path(tmp) / name).write_text(text)
                srcs = [str(Path(tmp) / name) for name in sources]
                cmd = [compiler, *flags, "-o", str(out), *srcs, "-lm"]
                try:  # a compiler that hangs must not hang the model load
                    done = subprocess.run(cmd, check=False, capture_output=True, timeout=COMPILE_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    warnings.warn(f"specdecode: building the {isa} CPU kernels took over {COMPILE_TIMEOUT_S} s; "
                                  "they are unavailable")  # fmt: skip
                    return None
                if done.returncode != 0:
                    first = (done.stderr.decode(errors="replace").strip().splitlines() or ["?"])[0]
                    warnings.warn(f"specdecode: building the {isa} CPU kernels failed ({first}); they are unavailable")
                    return None
                (Path(tmp) / "lib.sha256").write_text(_file_hash(out))
                os.replace(out, target)
                os.replace(Path(tmp) / "lib.sha256", check)
        lib = ctypes.CDLL(str(target))
    except OSError as e:  # a cache folder we cannot write or load from (read-only, noexec, a file)
        warnings.warn(f"specdecode: the {isa} CPU kernels cannot be built or loaded under {target.parent} ({e}); "
                      "they are unavailable (set SPECDECODE_CACHE to a writable folder)")  # fmt: skip
        return None
    if isa == "amx" and not lib.amx_available():  # the kernel refused the tile registers (an old Linux)
        return None
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
    lib.int4_a8_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.int4_a8_gemm.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.int4_a8_gemm.restype = None
    lib.q8_a8_gemm.argtypes, lib.q8_a8_gemm.restype = lib.int4_a8_gemm.argtypes, None
    lib.block_forward.argtypes = [ctypes.c_void_p] * 5
    lib.block_forward.restype = None
    lib.argmax_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.argmax_bf16.restype = None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.attend_rows.argtypes = [i32] * 6 + [ctypes.c_float] + [ptr] * 5 + [i64] * 3 + [ptr, i32]
    lib.attend_rows.restype = None
    lib.f32_gemm.argtypes = [ptr, i32, i32, ptr, i32, ptr, i32]
    lib.f32_gemm.restype = None
    return lib


def cpu_argmax(x: Tensor, isa: str | None = None) -> Tensor | None:
    """``x.float().max(dim=-1).indices`` for bf16 ``x`` [..., V] on the CPU, through our library
    (``isa``'s build, default the best; kernels/argmax.c: the same index, ties and NaN included,
    without converting to fp32 first); None where it does not run (another dtype or device, no build, torch.compile)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] == 0 or torch.compiler.is_compiling():
        return None
    lib = cpu_lib(isa)
    if lib is None:
        return None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.long)
    lib.argmax_bf16(x2.data_ptr(), x2.shape[0], x2.shape[1], out.data_ptr())
    return out.view(x.shape[:-1])


def pick_cpu_kernel(kernel: str) -> str:
    """The int4 CPU kernel ``kernel`` names: "auto" is our best build for the host CPU, else stock."""
    if kernel not in INT4_CPU_KERNELS:
        raise SpecDecodeError(f"unknown int4 kernel {kernel!r}; supported: {', '.join(INT4_CPU_KERNELS)}")
    if kernel == "auto":
        return cpu_isa() or "stock"
    if kernel != "stock" and cpu_lib(kernel) is None:
        needs = ", ".join(CPU_ISAS[kernel][0])
        extra = " that knows -mamx-tile (GCC 11+), and Linux 5.16+" if kernel == "amx" else ""
        raise SpecDecodeError(f"the {kernel} int4 kernel needs a CPU with {needs} and a C compiler{extra}")
    return kernel


def _groups_of_32(q: Tensor, scales: Tensor, zeros: Tensor, group_size: int, n_pad: int) -> tuple[Tensor, ...]:
    """q uint8, s and z = zero - 8 s (w = s q + z) in float64, one per 32 inputs, N padded by n_pad."""
    rep = group_size // 32
    s = scales.double().repeat_interleave(rep, dim=1)
    z = zeros.double().repeat_interleave(rep, dim=1) - 8 * s
    return tuple(F.pad(t, (0, 0, 0, n_pad)) for t in (q.to(torch.uint8), s, z))


def pack_int4_cpu(q: Tensor, scales: Tensor, zeros: Tensor, group_size: int, n_pad: int) -> tuple[Tensor, Tensor]:
    """(q [N, Kp], scales / stock-convention zeros [N, Kp/g]) -> our layout (see above)."""
    q, s, z = _groups_of_32(q, scales, zeros, group_size, n_pad)
    NT, G = q.shape[0] // 32, q.shape[1] // 32
    q = q.view(NT, 32, G, 16, 2)
    packed = (q[..., 0] | q[..., 1] << 4).permute(0, 2, 3, 1).contiguous()  # [NT, G, 16, 32]
    sz = torch.stack((s.view(NT, 32, G), z.view(NT, 32, G)), dim=2).permute(0, 3, 2, 1)  # [NT, G, 2, 32]
    return packed, sz.to(torch.float16).contiguous()


def pack_int4_a8(q: Tensor, scales: Tensor, zeros: Tensor, group_size: int, n_pad: int) -> tuple[Tensor, Tensor]:
    """(q [N, Kp], scales / stock-convention zeros [N, Kp/g]) -> int4_a8_gemm's layout (see
    kernels/a8_avx2.c): weight [N/8, G, 4, 32] bytes, scales and zeros [N/8, G, 2, 8] fp16."""
    q, s, z = _groups_of_32(q, scales, zeros, group_size, n_pad)
    N8, G = q.shape[0] // 8, q.shape[1] // 32
    q = q.view(N8, 8, G, 4, 2, 4)  # (octet, column, group, v, nibble, e): k = 32 g + 8 v + 4 nibble + e
    packed = (q[:, :, :, :, 0] | q[:, :, :, :, 1] << 4).permute(0, 2, 3, 1, 4).reshape(N8, G, 4, 32)
    sz = torch.stack((s.view(N8, 8, G), z.view(N8, 8, G)), dim=2).permute(0, 3, 2, 1)  # [N8, G, 2, 8]
    return packed.contiguous(), sz.to(torch.float16).contiguous()


def pack_q8_cpu(q: Tensor, d: Tensor, n_pad: int) -> tuple[Tensor, Tensor]:
    """GGUF Q8_0 (q int8 [N, K], d [N, K/32], w = d q) -> q8_gemm's layout (see the kernel source):
    q [N/32, G, 16, 64] int8, each 64 bytes a k pair of 32 columns; d [N/32, G, 32] fp16."""
    N, K = q.shape
    q, d = F.pad(q.to(torch.int8), (0, 0, 0, n_pad)), F.pad(d.float(), (0, 0, 0, n_pad))
    NT, G = (N + n_pad) // 32, K // 32
    # (tile, half, column, group, pair, k) -> (tile, group, pair, half, column, k)
    packed = q.view(NT, 2, 16, G, 16, 2).permute(0, 3, 4, 1, 2, 5).reshape(NT, G, 16, 64).contiguous()
    return packed, d.view(NT, 32, G).permute(0, 2, 1).to(torch.float16).contiguous()


def pack_q8_a8(q: Tensor, d: Tensor, n_pad: int) -> tuple[Tensor, Tensor]:
    """GGUF Q8_0 (q int8 [N, K], d [N, K/32]) -> q8_a8_gemm's layout (kernels/a8_avx2.c):
    q [N/8, G, 8, 32] int8, vector v's byte 4c + e = q[c, 4v + e]; d [N/8, G, 8] fp16."""
    N, K = q.shape
    q, d = F.pad(q.to(torch.int8), (0, 0, 0, n_pad)), F.pad(d.float(), (0, 0, 0, n_pad))
    N8, G = (N + n_pad) // 8, K // 32
    packed = q.view(N8, 8, G, 8, 4).permute(0, 2, 3, 1, 4).reshape(N8, G, 8, 32)
    return packed.contiguous(), d.view(N8, 8, G).permute(0, 2, 1).to(torch.float16).contiguous()


def cpu_mm(x: Tensor, packed: Tensor, scales: Tensor, isa: str, a8: bool = False) -> Tensor:
    """y [M, N] bf16 = x [M, K] bf16 @ a packed weight, through our ``isa`` build: int4
    (``packed`` uint8, ``scales`` the scales and zeros) or Q8_0 (``packed`` int8, ``scales`` d);
    with ``a8``, in `pack_int4_a8` / `pack_q8_a8`'s layout and times int8-quantized x.
    Inside torch.compile it runs as the opaque custom op below (a ctypes call cannot be
    traced); eagerly it is called directly, since the op dispatcher would add its overhead to
    every linear of every step."""
    if torch.compiler.is_compiling():
        return _mm_op(x, packed, scales, isa, a8)
    return _mm(x, packed, scales, isa, a8)


def _mm(x: Tensor, packed: Tensor, scales: Tensor, isa: str, a8: bool) -> Tensor:
    if x.device.type != "cpu" or packed.device.type != "cpu":  # C would read a device pointer as host memory
        raise SpecDecodeError(f"the {isa} CPU kernel got tensors on {x.device} / {packed.device}; "
                              "load the model on that device instead of moving a CPU-quantized one")  # fmt: skip
    M, K = x.shape
    N = packed.shape[0] * (8 if a8 else 32)
    y = torch.empty(M, N, dtype=torch.bfloat16)
    lib, threads = cpu_lib(isa), torch.get_num_threads()
    if a8:
        gemm = lib.q8_a8_gemm if packed.dtype == torch.int8 else lib.int4_a8_gemm
        gemm(x.data_ptr(), M, K, packed.data_ptr(), scales.data_ptr(), N, y.data_ptr(), threads)
    elif packed.dtype == torch.int8:  # Q8_0
        lib.q8_gemm(x.data_ptr(), M, K, packed.data_ptr(), scales.data_ptr(), N, y.data_ptr(), threads)
    else:
        xs = torch.empty(M * K // 32, dtype=torch.float32)
        lib.int4_gemm(x.data_ptr(), M, K, packed.data_ptr(), scales.data_ptr(), N, y.data_ptr(), xs.data_ptr(), threads)
    return y


def cpu_rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    """RMSNorm of bf16 ``x`` [..., D] by bf16 ``weight`` [D] in one call of our library (see
    rms_norm_bf16 in the kernel sources); callers check `cpu_lib()` first."""
    x = x.contiguous()
    y = torch.empty_like(x)
    D = x.shape[-1]
    cpu_lib().rms_norm_bf16(x.data_ptr(), x.numel() // D, D, weight.data_ptr(), eps, offset, y.data_ptr())
    return y


def fast_cpu_norm(x: Tensor, weight: Tensor) -> bool:
    """Whether our CPU library normalises ``x``: bf16 on a CPU it compiled for, no autograd, and
    not inside torch.compile (which fuses the torch norm into its neighbours instead)."""
    if torch.compiler.is_compiling():
        return False
    ok = x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
    return ok and x.shape[-1] % 16 == 0 and not torch.is_grad_enabled() and cpu_lib() is not None


@torch.library.custom_op("specdecode::cpu_mm", mutates_args=())
def _mm_op(x: Tensor, packed: Tensor, scales: Tensor, isa: str, a8: bool) -> Tensor:
    return _mm(x, packed, scales, isa, a8)


@_mm_op.register_fake
def _(x: Tensor, packed: Tensor, scales: Tensor, isa: str, a8: bool) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * (8 if a8 else 32), dtype=torch.bfloat16)
