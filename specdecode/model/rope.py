"""Rotary position embeddings: parameters and inverse frequencies, as transformers computes them.

Owns: `RopeConfig` (parsed from transformers' ``rope_parameters``), `rope_frequencies` for
the scaling types default, linear, llama3 and yarn, and `apply_rope` (the rotation).
Does not own: the tables a pass rotates by (transformer.py). Types whose frequencies
depend on the sequence length (dynamic, longrope) are rejected with a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specdecode.config import SpecDecodeError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, as in transformers' ``rope_parameters``."""

    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3 / yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor / mscale
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(params: dict[str, Any], max_positions: int) -> RopeConfig:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise SpecDecodeError(f"unsupported RoPE scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise SpecDecodeError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")

        def get(key: str, default: Any) -> Any:
            value = params.get(key)
            return default if value is None else value

        original = get("original_max_position_embeddings", max_positions)
        # yarn without a factor: the context's growth over the original (as transformers infers it)
        implied = max_positions / original if kind == "yarn" else 1.0
        return RopeConfig(
            theta=float(params["rope_theta"]),
            type=kind,
            factor=float(get("factor", implied)),
            original_max_position_embeddings=original,
            low_freq_factor=float(get("low_freq_factor", 1.0)),
            high_freq_factor=float(get("high_freq_factor", 4.0)),
            beta_fast=float(get("beta_fast", 32.0)),
            beta_slow=float(get("beta_slow", 1.0)),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(get("truncate", True)),
        )


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[Tensor, float]:
    """Inverse frequencies [dim/2] (fp32, CPU) and the cos/sin scale, as transformers computes them."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.type == "yarn":
        return _yarn_frequencies(rope, dim)
    return inv_freq, 1.0


def _yarn_frequencies(rope: RopeConfig, dim: int) -> tuple[Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, base, orig = rope.factor, rope.theta, rope.original_max_position_embeddings
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotate-half RoPE on [B, T, heads, D]: ``x * cos + rotate_half(x) * sin``.

    ``sin_signed`` is ``cat(-sin, sin)``, so rotate_half becomes a single roll.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
