"""Checkpoint loading: a path or a model alias -> our `Transformer` plus its tokenizer.

Owns: reading HF folders and .gguf files (the packaged models' paths: packaged.py), dtype / device resolution, mapping
transformers' parameter names onto our fused modules (q/k/v -> ``qkv``,
gate/up -> ``gate_up``), and applying the ``quantization`` setting (int8 / int4
quantize the built model; "gguf" swaps in the file's own blocks, fused the same way).
Does not own: GGUF decoding and the conversion cache (gguf_convert.py), the
forward pass (transformer.py), the quantized modules and kernels (quant.py). Configs and tokenizers come from transformers.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.config import SpecDecodeError, first_line
from specdecode.model.cpu_int4 import CPU_ISAS, cpu_lib, pick_cpu_kernel
from specdecode.model.gguf_convert import Int4Groups, converted_folder, gguf_int4_weights, gguf_keeps_blocks
from specdecode.model.packaged import resolve_source
from specdecode.model.quant import Int4Linear, Q8Linear, parse_quantization, quantize_model_, set_submodule
from specdecode.model.shard import Shard, check_tensor_parallel, split_state
from specdecode.model.transformer import ModelConfig, Transformer

if TYPE_CHECKING:
    import transformers

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: transformers.PreTrainedTokenizerBase | None  # None when the checkpoint has none
    name: str  # short display name
    path: str  # the folder the weights were read from
    quantization: str | None = None  # the weight format the linears got ("auto" resolved)


FLOAT16_UNSTABLE = ("gemma3_text",)  # architectures whose activations leave fp16's range (vLLM's list)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"auto"`` -> bfloat16; also float32/fp32, bfloat16/bf16, float16/fp16 or a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise SpecDecodeError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise SpecDecodeError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise SpecDecodeError(f"unknown device {device!r}") from None
    if device.type not in ("cpu", "cuda"):  # mps, xpu, meta, ...: tracebacks deep in the build or the sampler
        raise SpecDecodeError(f"device {str(device)!r} is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecDecodeError(f"device {device} requested but CUDA is not available")
    return device


def keeps_gguf_blocks(path: str | None, device: torch.device) -> bool:
    """Whether "auto" keeps ``path``'s own GGUF blocks: a .gguf whose projections all stay
    quantized, on a CPU our kernel runs on."""
    source, _ = resolve_source(path)
    native = source.is_file() and source.suffix == ".gguf" and device.type == "cpu"
    return native and cpu_lib() is not None and gguf_keeps_blocks(source)


def _folder(source: Path, name: str, progress: bool) -> Path:
    """The HF folder of a model: itself, or a .gguf's converted folder (converted once)."""
    if source.is_file():
        if source.suffix != ".gguf":
            raise SpecDecodeError(f"not a model folder or .gguf file: {source}")
        return converted_folder(source, name, progress)
    return source


def _read_config(folder: Path) -> ModelConfig:
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise SpecDecodeError(f"no config.json in model folder {folder}")
    try:
        hf_config = AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # transformers' validators raise their own kinds (a string hidden_size, 0 heads, ...)
        raise SpecDecodeError(f"cannot read {folder / 'config.json'}: {first_line(e)}") from None
    config = ModelConfig.from_hf(hf_config)
    return dataclasses.replace(config, eos_token_ids=_eos_ids(config, folder))


def load_config(path: str | None, progress: bool = True) -> tuple[ModelConfig, str]:
    """A model's config and display name, reading no weights (a folder needs only its
    config.json; a .gguf is converted once, as `load_model` does)."""
    source, name = resolve_source(path)
    return _read_config(_folder(source, name, progress)), name


def load_model(
    path: str | None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    progress: bool = True,
    quantization: str | None = None,
    shard: Shard | None = None,
) -> LoadedModel:
    """Load an HF folder, a .gguf file, an alias (smollm2-135m, gemma3-270m) or None (the default).

    GGUF files are converted once into a cached HF folder (fp32, so the dequantised
    weights are exact); later loads read that folder. ``dtype`` is the activation
    (and embedding) dtype; ``quantization`` picks the weights of the linears:
    None / "none" (``dtype``), "int8" (per channel), "int4" (group 32; "int4-g64",
    "int4-g128"), "gguf" (a .gguf's own Q4_0/Q4_1/Q4_K/Q8_0 blocks as int4 groups), or
    "auto": "gguf" for a .gguf whose blocks all stay quantized, on a CPU our int4 kernel runs
    on (there it is faster than bf16 and exact to the file), else none (vLLM, too,
    keeps a GGUF quantized unless told otherwise). ``.quantization`` says what it became.
    ``shard``: build only this rank's part of a tensor-parallel model (shard.py), quantized
    after the cut so that each rank's int4 groups are whole groups of the full model.
    """
    dtype, device = resolve_dtype(dtype), resolve_device(device)  # before any slow conversion
    quant = parse_quantization(quantization)
    source, name = resolve_source(path)
    sharded = shard is not None and shard.size > 1
    if quant is not None and quant.mode == "auto":  # a shard cuts float weights: the blocks are dequantized
        quant = parse_quantization("gguf" if keeps_gguf_blocks(path, device) and not sharded else None)
    if quant is not None and quant.a8 and (device.type != "cpu" or cpu_lib() is None):
        raise SpecDecodeError(f"quantization '{quant}' (int8 activations) needs our CPU kernel: AVX2 and a C compiler")
    if source.is_dir() and quant is not None and quant.mode == "gguf":
        raise SpecDecodeError(f"quantization '{quant}' needs a .gguf file, not the folder {source}")
    folder = _folder(source, name, progress)
    config = _read_config(folder)  # an unsupported config fails before the weights are read
    if dtype == torch.float16 and config.architecture in FLOAT16_UNSTABLE:
        raise SpecDecodeError(f"{config.architecture} does not run in float16 (its activations overflow it, as "
                              "vLLM refuses too); use bfloat16 or float32")  # fmt: skip
    if sharded:
        check_tensor_parallel(config, shard.size, quant)
    hf_state = read_safetensors(folder)
    config = _tied_as_transformers(config, hf_state)
    if quant is not None and quant.mode == "gguf":  # read (and reject) the blocks before building
        blocks = gguf_int4_weights(source, config.num_heads, config.num_kv_heads)
    model = build_model(config, hf_state, dtype, device, shard)
    if quant is not None and quant.mode == "gguf":
        use_gguf_blocks_(model, config, blocks, a8=quant.a8)
    elif quant is not None:
        quantize_model_(model, str(quant))
    else:
        model.use_cpu_blocks()  # (the two branches above build it from their new weights)
    effective = None if quant is None else str(quant)
    return LoadedModel(model, config, load_tokenizer(folder), name, str(folder), effective)


def use_gguf_blocks_(
    model: Transformer, config: ModelConfig, blocks: dict[str, Int4Groups], int4_kernel: str = "auto", a8: bool = False
) -> None:
    """Replace each linear whose GGUF parts were all block-quantized by one Int4Linear (group 32).

    Parts are fused along the outputs like the dense weights (q/k/v, gate/up); a part in two
    planes (Q8_0) turns the others into two planes too. A linear whose parts are all Q8_0 runs
    them as they are (`Q8Linear`) where our CPU kernel does. Linears with any dense part stay dense.
    ``a8``: the linears take int8-quantized activations.
    """
    blocks = {k.removeprefix("model."): v for k, v in blocks.items()}
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        parts = {
            "attn.qkv": [f"{src}self_attn.{p}_proj.weight" for p in "qkv"],
            "attn.o": [f"{src}self_attn.o_proj.weight"],
            "mlp.gate_up": [f"{src}mlp.gate_proj.weight", f"{src}mlp.up_proj.weight"],
            "mlp.down": [f"{src}mlp.down_proj.weight"],
        }
        for ours, theirs in parts.items():
            _swap_int4(model, dst + ours, [blocks.get(t) for t in theirs], int4_kernel, a8)
    head = "embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
    _swap_int4(model, "lm_head", [blocks.get(head)], int4_kernel, a8)
    model.use_cpu_blocks(int4_kernel)  # the fused CPU block runs from the new weights, where it applies


def _swap_int4(model: Transformer, name: str, parts: list[Int4Groups | None], kernel: str, a8: bool) -> None:
    if any(p is None for p in parts):
        return
    lin = model.get_submodule(name)
    device = lin.weight.device
    bias = None if lin.bias is None else lin.bias.detach()
    all_q8 = all(p.source_type == "Q8_0" for p in parts)
    if all_q8 and Q8Linear.available(device) and pick_cpu_kernel(kernel) in CPU_ISAS:
        q8, d = (torch.cat(t) for t in zip(*(p.as_q8() for p in parts)))
        set_submodule(model, name, Q8Linear(q8, d, lin.in_features, bias, kernel=kernel, a8=a8))
        return
    planes = max(p.planes for p in parts)
    parts = [p.to_planes(planes) for p in parts]
    q, s, z = (torch.cat([getattr(p, f) for p in parts]).to(device) for f in ("q", "scales", "zeros"))
    source = "+".join(sorted({p.source_type for p in parts}))
    int4 = Int4Linear(q, s, z, 32, lin.in_features, bias, input_planes=planes, source=source, kernel=kernel, a8=a8)
    set_submodule(model, name, int4)


def _eos_ids(config: ModelConfig, folder: Path) -> tuple[int, ...]:
    """config.json's EOS ids and generation_config.json's, as transformers' generate and vLLM stop
    on (Qwen2.5 / Qwen3 instruct list <|endoftext|> only in the latter)."""
    path = folder / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
        raise SpecDecodeError(f"cannot read {path}") from None
    extra = [] if eos is None else [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in extra):
        raise SpecDecodeError(f"{path}: eos_token_id must be token ids, got {eos!r}")
    outside = [t for t in extra if not 0 <= t < config.vocab_size]
    if outside:  # transformers warns and goes on; a token that cannot be sampled never stops anything
        warnings.warn(f"{path}: eos_token_id {outside} outside the vocabulary of {config.vocab_size}; ignored")
    return tuple(dict.fromkeys([*config.eos_token_ids, *(t for t in extra if t not in outside)]))


def load_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerBase | None:
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # a malformed tokenizer.json, or one that needs sentencepiece / tiktoken
        raise SpecDecodeError(f"cannot load the tokenizer in {folder}: {first_line(e)}") from None


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """The weights as transformers finds them: ``model.safetensors``, else the shards
    ``model.safetensors.index.json`` lists, else every ``*.safetensors``. So another file beside
    the HF weights (Mistral's consolidated.safetensors, an adapter) is read only in the last case."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpecDecodeError(f"{index} is not a safetensors index: {first_line(e)}") from None
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SpecDecodeError(f"{index} lists {len(missing)} missing shard(s), e.g. {missing[0]}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecDecodeError(f"no *.safetensors weights in model folder {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors' own error: truncated, empty, not a safetensors file
            raise SpecDecodeError(f"cannot read {f}: {first_line(e)}") from None
    return state


def build_model(
    config: ModelConfig, hf_state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
    shard: Shard | None = None,
) -> Transformer:
    """Our Transformer with ``hf_state`` (transformers' names) fused and cast, in eval mode;
    with ``shard``, that rank's part of it."""
    cast: dict[int, torch.Tensor] = {}  # by source tensor, so a tied head is cast once
    state = to_our_names(config, hf_state)
    if shard is not None and shard.size > 1:
        state = split_state(config, state, shard)
    state = {k: cast.setdefault(id(v), v.to(device=device, dtype=dtype)) for k, v in state.items()}
    with torch.device("meta"):
        model = Transformer(config, shard)
    check_shapes(state, model.state_dict(), "the checkpoint", "the model its config.json describes")
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings and model.shard is None:
        model.lm_head.weight = model.embed.weight
    return model.to(device).eval().requires_grad_(False)


def check_shapes(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: str, target: str) -> None:
    """One line naming the first tensor of ``state`` whose shape is not ``expected``'s (torch's own
    load_state_dict error runs over many lines): model checkpoints and drafter folders alike."""
    for k, v in state.items():
        if k in expected and v.shape != expected[k].shape:
            raise SpecDecodeError(f"weight {k!r} is {list(v.shape)} in {source}, {list(expected[k].shape)} in {target}")


def _tied_as_transformers(config: ModelConfig, hf: dict[str, torch.Tensor]) -> ModelConfig:
    """A tied config stays tied unless the checkpoint carries an LM head that differs from the
    embeddings: transformers then uses that head (untied), and so do we."""
    names = {k.removeprefix("model."): v for k, v in hf.items()}
    head, embed = names.get("lm_head.weight"), names.get("embed_tokens.weight")
    if config.tie_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        return dataclasses.replace(config, tie_embeddings=False)
    return config


def to_our_names(config: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> ours, fusing q/k/v and gate/up. Raises on missing or extra weights."""
    hf = {k.removeprefix("model."): v for k, v in hf.items() if "rotary_emb" not in k}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise SpecDecodeError(f"checkpoint is missing weight {name!r}")
        used.add(name)
        return hf[name]

    out = {"embed.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    head = "lm_head.weight"
    out[head] = out["embed.weight"] if config.tie_embeddings else take(head)
    used.add(head)  # a tied checkpoint may still carry a copy of the embeddings
    gemma_norms = {
        "attn_out_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "mlp_out_norm": "post_feedforward_layernorm",
    }
    norms = gemma_norms if config.sandwich_norm else {"mlp_norm": "post_attention_layernorm"}
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "attn.qkv.weight"] = torch.cat([take(f"{attn}{p}_proj.weight") for p in "qkv"])
        if config.attention_bias:
            out[dst + "attn.qkv.bias"] = torch.cat([take(f"{attn}{p}_proj.bias") for p in "qkv"])
        out[dst + "attn.o.weight"] = take(attn + "o_proj.weight")
        if config.attention_out_bias:
            out[dst + "attn.o.bias"] = take(attn + "o_proj.bias")
        if config.qk_norm:
            out[dst + "attn.q_norm.weight"] = take(attn + "q_norm.weight")
            out[dst + "attn.k_norm.weight"] = take(attn + "k_norm.weight")
        out[dst + "mlp.gate_up.weight"] = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
        out[dst + "mlp.down.weight"] = take(mlp + "down_proj.weight")
        if config.mlp_bias:
            out[dst + "mlp.gate_up.bias"] = torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")])
            out[dst + "mlp.down.bias"] = take(mlp + "down_proj.bias")
        out[dst + "attn_norm.weight"] = take(src + "input_layernorm.weight")
        for ours, theirs in norms.items():
            out[f"{dst}{ours}.weight"] = take(f"{src}{theirs}.weight")
    extra = sorted(set(hf) - used)
    if extra:
        raise SpecDecodeError(f"checkpoint has {len(extra)} unexpected weights, e.g. {extra[0]!r}")
    return out
