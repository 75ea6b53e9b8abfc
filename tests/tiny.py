"""Tiny random checkpoints for tests: Hugging Face folders and llama.cpp-layout GGUF files.

Owns: `make_tiny_checkpoint` (an HF folder with config, safetensors and a
character-level tokenizer with a chat template) and `make_tiny_gguf` (the same
weights written as llama.cpp would: Q/K rows permuted for llama, Gemma norms +1,
optionally Q8_0-quantised). Weights are re-drawn at O(1) scale so that parity tests
exercise every parameter, norms included.
Does not own: any assertion; tests import these helpers as ``from tests.tiny import ...``.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "llama_untied", "llama_rope_scaling", "qwen2", "qwen3", "gemma3")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_hf_config(arch: str = "llama", **overrides: Any):
    """A transformers config for ``arch`` (see ARCHS) with tiny sizes; ``overrides`` win."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "llama":
        cls, kw = LlamaConfig, dict(tie_word_embeddings=True, rope_parameters=default_rope)
    elif arch == "llama_untied":  # untied head, with biases on attention and MLP
        cls, kw = LlamaConfig, dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    elif arch == "llama_rope_scaling":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
        cls, kw = LlamaConfig, dict(tie_word_embeddings=False, rope_parameters=rope)
    elif arch == "qwen2":
        rope = {"rope_type": "default", "rope_theta": 1e6}
        cls, kw = Qwen2Config, dict(tie_word_embeddings=False, rope_parameters=rope)
    elif arch == "qwen3":
        cls, kw = Qwen3Config, dict(tie_word_embeddings=True, head_dim=32)
    elif arch == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}  # fmt: skip
        kw = dict(
            num_hidden_layers=4, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
            final_logit_softcapping=30.0, tie_word_embeddings=True, rope_parameters=rope,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        )  # fmt: skip
        cls = Gemma3TextConfig
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {', '.join(ARCHS)}")
    return cls(**{**common, **kw, **overrides})


def tiny_tokenizer():
    """A character-level tokenizer (specials + printable ASCII) with a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def randomize_(model: torch.nn.Module, seed: int, norm_center: float) -> None:
    """Redraw every parameter at O(1) scale; norm weights around ``norm_center``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(norm_center + 0.2 * noise)
            elif p.ndim == 2 and "embed" not in name:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:  # embeddings and biases
                p.copy_(0.5 * noise)


def make_tiny_model(arch: str = "llama", seed: int = 0, logit_scale: float = 1.0, **overrides: Any):
    """A randomized transformers model (fp32, eval mode) for ``arch``; ``logit_scale`` multiplies
    the final norm's gain, so every logit (before Gemma's soft-capping) scales by it."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    center = 0.0 if arch == "gemma3" else 1.0
    randomize_(model, seed, norm_center=center)
    if logit_scale != 1.0:
        with torch.no_grad():  # Gemma's norm multiplies by (1 + w)
            gain = model.model.norm.weight
            gain.copy_(logit_scale * (gain + 1 - center) - (1 - center))
    return model.eval()


def make_tiny_checkpoint(
    path: str | Path, arch: str = "llama", seed: int = 0, logit_scale: float = 1.0, **overrides: Any
) -> Path:
    """Write an HF folder (config.json, model.safetensors, tokenizer) for ``arch`` at ``path``."""
    path = Path(path)
    model = make_tiny_model(arch, seed, logit_scale, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def early_exit_checkpoint(src: str | Path, path: str | Path, num_layers: int) -> Path:
    """The HF folder ``src`` cut to its first ``num_layers`` layers (norm and head kept) at ``path``:
    a draft that agrees with the target often, not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):  # qwen2 / gemma3 list one attention type per layer
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(path)
    return path


# ---- GGUF in llama.cpp layout ---------------------------------------------------------

GGUF_ARCH = {"llama": "llama", "llama_untied": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` (interleaved RoPE rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(model, arch: str) -> dict[str, torch.Tensor]:
    cfg = model.config
    gemma = arch == "gemma3"
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm" if gemma else "ffn_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    }  # fmt: skip
    out = {}
    for name, w in model.state_dict().items():
        w = w.detach().float().clone()
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{names[module]}.{kind}"
        if GGUF_ARCH[arch] == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            heads = cfg.num_attention_heads if ".attn_q." in gname else cfg.num_key_value_heads
            w = _llama_cpp_permute(w, heads)
        if gemma and gname.endswith("norm.weight"):
            w = w + 1.0
        out[gname] = w
    return out


def make_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    quant: str = "Q8_0",
    tokenizer: bool = True,
    int_tensors: tuple[str, ...] = (),
    **overrides: Any,
) -> tuple[Path, Any]:
    """Write ``path`` (a .gguf) for ``arch`` in {llama, llama_untied, qwen2, qwen3, gemma3}.

    2-D weights are stored as ``quant`` ("Q8_0", "Q4_1", ... or "F32"); norms and
    biases as F32; tensors named in ``int_tensors`` as I32 (a type no loader should
    accept). With ``tokenizer``, includes a GPT-2 style byte-level tokenizer. Returns
    the path and the transformers model the weights came from.
    """
    import gguf
    import numpy as np

    path = Path(path)
    overrides.setdefault("vocab_size", 128)
    model = make_tiny_model(arch, seed, **overrides)
    cfg = model.config
    a = GGUF_ARCH[arch]
    w = gguf.GGUFWriter(str(path), a)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if a == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if tokenizer:
        _add_byte_tokenizer(w, cfg.vocab_size)
    qtype = gguf.GGMLQuantizationType[quant]
    for name, t in _gguf_tensors(model, arch).items():
        data = t.numpy().astype(np.float32)
        if name in int_tensors:
            w.add_tensor(name, data.astype(np.int32))
        elif data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model


def _add_byte_tokenizer(w, vocab_size: int) -> None:
    """GPT-2 byte-level BPE over printable ASCII plus a few merges, padded to ``vocab_size``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = [*SPECIAL_TOKENS, *(byte_chars[b] for b in range(32, 127)), "he", "ll", "Ġt"]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["h e", "l l", "Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def transformers_from_gguf(path: str | Path):
    """transformers' own model for a GGUF file (fp32, eval), the reference for our GGUF mapping.

    Uses ``from_pretrained(gguf_file=...)`` when ``accelerate`` (which it requires) is
    installed, else the same ``load_gguf_checkpoint`` tensor mapping directly.
    """
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        return model.eval()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers' GGUF mapping left out {missing} / {unexpected}")
    model.tie_weights()
    return model.eval()


def small_tree() -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    """A 6-node draft tree for attention tests: tokens [1, 6] (root 5; 6, 7 children of the
    root; 8, 9 of 6; 10 of 8), parents, depths [1, 6] and the ancestor mask [6, 6]."""
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    parents = [-1, 0, 0, 1, 1, 3]
    mask = torch.eye(6, dtype=torch.bool)
    for i in range(1, 6):
        mask[i] |= mask[parents[i]]
    return tokens, parents, torch.tensor([[0, 1, 1, 2, 2, 3]]), mask


def root_path(node: int, parents: list[int]) -> list[int]:
    """The nodes from the root down to ``node``."""
    path = []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    return path
