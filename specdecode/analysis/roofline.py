"""Roofline model of one verification step: when does verifying B·(γ+1) positions stop being free?

Owns: FLOPs per verified position (matrix parameters plus the LM head, since every
verified position needs logits), the time to read the weights once, the threshold
number of positions where compute catches up with that read, a few hardware and model
presets, and a quick local profile of the CPU or GPU this runs on.
Does not own: choosing γ per request under load (the serving scheduler's job).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdecode.config import SpecDecodeError


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # dense bf16 FLOP/s
    bandwidth: float  # bytes/s of weight reads


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs from a model: its matrix shapes and weight bytes."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    bytes_per_param: float = 2.0

    @property
    def layer_matrix_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o, k, v
        return attn + 3 * self.hidden * self.intermediate  # gate, up, down

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def weight_bytes(self) -> float:
        embeddings = self.head_params * (1 if self.tied else 2)
        return (self.layers * self.layer_matrix_params + embeddings) * self.bytes_per_param


HARDWARE = {
    "h100": Hardware("NVIDIA H100 SXM (bf16 dense)", 990e12, 3.35e12),
    "a100": Hardware("NVIDIA A100 SXM 80GB (bf16 dense)", 312e12, 2.039e12),
    "h200": Hardware("NVIDIA H200 (bf16 dense)", 990e12, 4.8e12),
}

MODELS = {
    "llama-3-8b": ModelShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128, 128256, tied=False),
    "llama-3-70b": ModelShape("Llama-3-70B", 8192, 28672, 80, 64, 8, 128, 128256, tied=False),
}


def shape_from_config(name: str, config) -> ModelShape:
    """A ModelShape from our ModelConfig (specdecode.model.transformer)."""
    return ModelShape(name, config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
                      config.num_kv_heads, config.head_dim, config.vocab_size, config.tie_embeddings)  # fmt: skip


@dataclass(frozen=True)
class Roofline:
    model: ModelShape
    hardware: Hardware

    @property
    def flops_per_position(self) -> float:
        """2 FLOPs per matrix parameter, plus the LM head: a verified position needs logits."""
        return 2.0 * (self.model.layers * self.model.layer_matrix_params + self.model.head_params)

    @property
    def weight_read_s(self) -> float:
        return self.model.weight_bytes / self.hardware.bandwidth

    @property
    def threshold_positions(self) -> float:
        """B·(γ+1) at which compute time equals the weight read: beyond it, verification costs extra."""
        return self.weight_read_s * self.hardware.flops / self.flops_per_position

    def compute_s(self, positions: int) -> float:
        return positions * self.flops_per_position / self.hardware.flops

    def step_s(self, positions: int) -> float:
        """Roofline time of one step: the slower of reading the weights and computing."""
        return max(self.weight_read_s, self.compute_s(positions))


def profile_local(device: torch.device) -> Hardware:
    """Measure the machine it runs on: a large matmul for FLOP/s and a GEMV over a large weight
    for bandwidth, in bf16; on a CPU also in fp32, keeping the faster of each. A CPU without bf16
    arithmetic (AVX2) runs torch's bf16 matmul emulated, far slower than its fp32 matmul and our
    int4 kernels' fp32 FMAs: the model's passes see the fp32 rate."""
    if device.type == "cpu":
        runs = [_profile(device, dtype) for dtype in (torch.bfloat16, torch.float32)]
        flops, bandwidth = max(r[0] for r in runs), max(r[1] for r in runs)
        which = "bf16" if flops == runs[0][0] else "fp32"
        return Hardware(f"local CPU ({torch.get_num_threads()} threads), measured, {which} matmul", flops, bandwidth)
    flops, bandwidth = _profile(device, torch.bfloat16)
    return Hardware(f"{torch.cuda.get_device_name(device)}, measured", flops, bandwidth)


def _profile(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOP/s of a large matmul, bytes/s of a GEMV over a large weight) in ``dtype``."""

    def best(fn, repeats: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    flops = 2 * n**3 / best(lambda: a @ a)
    rows = (1 << 15 if dtype == torch.bfloat16 else 1 << 14) if device.type == "cpu" else 1 << 17
    w = torch.randn(rows, 4096, dtype=dtype, device=device)  # 256 MiB on CPU: well past the caches
    x = torch.randn(1, 4096, dtype=dtype, device=device)
    bandwidth = w.numel() * w.element_size() / best(lambda: torch.nn.functional.linear(x, w))
    return flops, bandwidth


def resolve_hardware(name: str) -> Hardware:
    if name == "local":
        return profile_local(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if name not in HARDWARE:
        raise SpecDecodeError(f"unknown hardware {name!r}; valid: {', '.join([*HARDWARE, 'local'])}")
    return HARDWARE[name]


def resolve_model(name: str) -> ModelShape:
    """A preset name, or anything load_model accepts (its config gives the shapes)."""
    if name in MODELS:
        return MODELS[name]
    from specdecode.model.loader import load_config

    config, display = load_config(None if name == "default" else name)  # the shapes only: no weights read
    return shape_from_config(display, config)
