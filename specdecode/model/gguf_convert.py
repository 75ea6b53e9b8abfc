"""GGUF (llama.cpp) checkpoints -> Hugging Face folders, cached on disk.

Owns: mapping llama.cpp tensor names to transformers' names, undoing what
llama.cpp's converter did to the weights (Q/K row permutation for ``llama``, +1 on
Gemma norm weights), dequantisation with the ``gguf`` package, and the atomic
conversion cache ``${SPECDECODE_CACHE:-~/.cache/specdecode}/<name>-<hash>/``.
Does not own: building our Transformer (loader.py). The config and tokenizer are
built by transformers from the GGUF metadata; only the weights mapping is ours.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from specdecode.config import SpecDecodeError

CONVERTER_VERSION = 1  # bump when the conversion output changes
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def cache_root() -> Path:
    return Path(os.environ.get("SPECDECODE_CACHE") or Path.home() / ".cache" / "specdecode")


def hf_name(gguf_name: str, arch: str) -> str:
    """transformers' parameter name for a llama.cpp tensor name; raises on unknown names."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    table = {**_LAYER_NAMES, **(_GEMMA3_NORMS if arch == "gemma3" else {"ffn_norm": "post_attention_layernorm"})}
    if m is None or m.group(2) not in table:
        raise SpecDecodeError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF")
    return f"model.layers.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``LlamaModel.permute`` of Q/K rows (interleaved -> rotate-half RoPE)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise SpecDecodeError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def gguf_state_dict(reader, arch: str, hf_config, progress: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF as an fp32 state dict with transformers' names and layout."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise SpecDecodeError("GGUF files with rope_freqs (llama3-style RoPE scaling) are not supported")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    state = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not progress):
        name = hf_name(t.name, arch)
        try:
            data = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise SpecDecodeError(f"unsupported GGUF tensor type {t.tensor_type.name} (tensor {t.name!r})") from None
        w = torch.from_numpy(data.astype("float32", copy=False).copy())
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # ggml lists dims innermost first
        if arch == "llama" and ".attn_q." in t.name:
            w = unpermute_qk(w, heads)
        elif arch == "llama" and ".attn_k." in t.name:
            w = unpermute_qk(w, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w)
        state[name] = w
    return state


def converted_folder(gguf_path: Path, name: str, progress: bool = True) -> Path:
    """The cached HF folder for ``gguf_path``, converting it on first use (atomically)."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    folder = cache_root() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        convert_gguf(gguf_path, tmp, progress)
        _share(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _share(folder: Path) -> None:
    """mkdtemp makes the folder private; give it (and its files) the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def convert_gguf(gguf_path: Path, out: Path, progress: bool = True) -> None:
    """Write config.json, tokenizer files and an fp32 model.safetensors for ``gguf_path`` into ``out``."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    try:
        reader = GGUFReader(str(gguf_path))
    except (ValueError, OSError) as e:
        raise SpecDecodeError(f"not a readable GGUF file: {gguf_path} ({str(e).splitlines()[0]})") from None
    arch = gguf_architecture(reader)
    folder, file = str(gguf_path.parent), gguf_path.name
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=file)
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:  # transformers drops it for some architectures (qwen3)
        hf_config.head_dim = int(key_length.contents())
    if hasattr(hf_config, "quantization_config"):  # the weights we write are plain fp32
        del hf_config.quantization_config
    state = gguf_state_dict(reader, arch, hf_config, progress)
    hf_config.tie_word_embeddings = "lm_head.weight" not in state
    hf_config.save_pretrained(out)
    if "tokenizer.ggml.model" in reader.fields:
        AutoTokenizer.from_pretrained(folder, gguf_file=file).save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "source.json").write_text(json.dumps({"gguf": str(gguf_path.resolve()), "version": CONVERTER_VERSION}))
