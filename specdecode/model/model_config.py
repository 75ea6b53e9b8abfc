"""`ModelConfig`: our architecture flags, built from a Hugging Face config.

Owns: the flags that tell the one transformer (transformer.py) which architecture it runs
(Llama / SmolLM2 / Mistral, Qwen2, Qwen3, Gemma3 text), their validation, and `from_hf`,
which maps a transformers ``PretrainedConfig`` onto them or rejects it in one line.
Does not own: the forward pass (transformer.py) or RoPE formulas (rope.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.config import SpecDecodeError
from specdecode.model.masks import FULL, SLIDING
from specdecode.model.rope import RopeConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


@dataclass(frozen=True)
class ModelConfig:
    """Our architecture flags. Build it with `from_hf`; every flag defaults to plain Llama."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    architecture: str = "llama"  # transformers' model_type, for messages only
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    local_rope: RopeConfig | None = None  # RoPE of sliding layers when it differs (Gemma3)
    tie_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v
    attention_out_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE
    norm_offset: float = 0.0  # Gemma: norms scale by (1 + w), computed in fp32
    embed_scale: float = 1.0  # Gemma: sqrt(hidden_size)
    activation: str = "silu"  # "silu" | "gelu_tanh"
    sandwich_norm: bool = False  # Gemma3: norms after attention and after the MLP too
    sliding_window: int | None = None  # a key is visible iff query_pos - key_pos < window
    layer_types: tuple[str, ...] = ()  # FULL / SLIDING per layer; () = all FULL
    query_scale: float | None = None  # None = head_dim ** -0.5
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {FULL, SLIDING}:
            raise SpecDecodeError(f"layer_types must be {self.num_layers} of {FULL!r}/{SLIDING!r}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise SpecDecodeError("sliding layers need a sliding_window")
        if self.activation not in ("silu", "gelu_tanh"):
            raise SpecDecodeError(f"unsupported activation {self.activation!r}; supported: silu, gelu_tanh")
        if self.num_heads % self.num_kv_heads:
            raise SpecDecodeError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @staticmethod
    def from_hf(hf: Any) -> ModelConfig:
        """Our flags from a transformers ``PretrainedConfig`` (Llama, Mistral, Qwen2/3, Gemma3 text)."""
        arch = hf.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise SpecDecodeError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch == "gemma3_text"
        if getattr(hf, "attn_logit_softcapping", None) is not None:
            raise SpecDecodeError("attention logit soft-capping is not supported")
        if getattr(hf, "use_bidirectional_attention", False):
            raise SpecDecodeError("bidirectional attention is not supported")
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
        activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
        if activation is None:
            raise SpecDecodeError(f"unsupported activation {act!r}; supported: silu, gelu_pytorch_tanh")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        max_pos = hf.max_position_embeddings
        window = getattr(hf, "sliding_window", None)
        hf_types = getattr(hf, "layer_types", None)
        if hf_types is not None:
            layer_types = tuple(SLIDING if t == "sliding_attention" else FULL for t in hf_types)
        else:  # Mistral: one window for every layer; transformers' Llama ignores a sliding_window key
            layer_types = (SLIDING if window and arch == "mistral" else FULL,) * hf.num_hidden_layers
        if SLIDING not in layer_types:
            window = None
        rope_params = hf.rope_parameters
        local_rope = None
        if "full_attention" in rope_params or "sliding_attention" in rope_params:
            rope = RopeConfig.from_hf(rope_params["full_attention"], max_pos)
            if "sliding_attention" in rope_params:
                local_rope = RopeConfig.from_hf(rope_params["sliding_attention"], max_pos)
        else:
            rope = RopeConfig.from_hf(rope_params, max_pos)
        eos = hf.eos_token_id
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        bias = bool(getattr(hf, "attention_bias", False))
        return ModelConfig(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            architecture=arch,
            rms_norm_eps=hf.rms_norm_eps,
            rope=rope,
            local_rope=local_rope if local_rope != rope else None,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bias,
            attention_out_bias=False if arch == "qwen2" else bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3_text"),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=hf.hidden_size**0.5 if gemma else 1.0,
            activation=activation,
            sandwich_norm=gemma,
            sliding_window=window,
            layer_types=layer_types,
            query_scale=hf.query_pre_attn_scalar**-0.5 if gemma else None,
            final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos_ids,
        )
