"""GGUF (llama.cpp) checkpoints -> Hugging Face folders, cached on disk.

Owns: mapping llama.cpp tensor names to transformers' names, undoing what
llama.cpp's converter did to the weights (Q/K row permutation for ``llama``, +1 on
Gemma norm weights), dequantisation with the ``gguf`` package, the atomic
conversion cache ``${SPECDECODE_CACHE:-~/.cache/specdecode}/<name>-<hash>/``, and
decoding Q4_0 / Q4_1 / Q4_K / Q8_0 blocks into int4 groups of 32 for
``quantization="gguf"`` (`gguf_int4_weights`).
Does not own: building our Transformer (loader.py). The config and tokenizer are
built by transformers from the GGUF metadata; only the weights mapping is ours.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdecode.config import SpecDecodeError, first_line

CONVERTER_VERSION = 2  # bump when the conversion output changes (2: GGUF RoPE scaling read)
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
    """$SPECDECODE_CACHE, else ~/.cache/specdecode, else (no home: HOME unset and a user without
    a passwd entry, as in some containers) a folder of this user's in the temporary folder."""
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"])
    try:
        return Path.home() / ".cache" / "specdecode"
    except RuntimeError:  # "Could not determine home directory"
        return _temporary_cache()


@functools.cache  # one folder per process: a fresh one made per call would split the caches
def _temporary_cache() -> Path:
    """The kernels are loaded from here: a folder another user made first (or made open to
    others) could hold a library of theirs, so only our own private folder is used, else a fresh one."""
    folder = Path(tempfile.gettempdir()) / f"specdecode-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        if not folder.is_symlink() and st.st_uid == os.getuid() and not st.st_mode & 0o022:  # none but us writes
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="specdecode-"))


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
    if w.shape[0] % (2 * n_head):  # the header's head count disagrees with the tensor
        raise SpecDecodeError(f"a Q/K weight of {w.shape[0]} rows does not split into {n_head} heads of even size; "
                              "the GGUF's head counts disagree with its tensors")  # fmt: skip
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
        _check_finite(t.name, w)
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
    except (ValueError, OSError, IndexError) as e:  # IndexError: a header or key-value section cut or garbled
        raise SpecDecodeError(f"not a readable GGUF file: {gguf_path} ({first_line(e)})") from None
    arch = gguf_architecture(reader)
    folder, file = str(gguf_path.parent), gguf_path.name
    try:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=file)
    except Exception as e:  # transformers' GGUF reader on missing metadata, its validators on bad values
        raise SpecDecodeError(f"cannot read a model config from {gguf_path}'s metadata: {_message(e)}") from None
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:  # transformers drops it for some architectures (qwen3)
        hf_config.head_dim = int(key_length.contents())
    _rope_scaling(reader, arch, hf_config)
    if hasattr(hf_config, "quantization_config"):  # the weights we write are plain fp32
        del hf_config.quantization_config
    state = gguf_state_dict(reader, arch, hf_config, progress)
    hf_config.tie_word_embeddings = "lm_head.weight" not in state
    hf_config.save_pretrained(out)
    if "tokenizer.ggml.model" in reader.fields:
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        except (KeyError, ValueError, OSError, TypeError) as e:  # e.g. no merges, no tokens, a "bert" vocabulary
            raise SpecDecodeError(f"cannot build the tokenizer from {gguf_path}'s metadata: {_message(e)}") from None
        tokenizer.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "source.json").write_text(json.dumps({"gguf": str(gguf_path.resolve()), "version": CONVERTER_VERSION}))


def _message(e: BaseException) -> str:
    """The first line of an exception's text; a KeyError's is just the missing key."""
    return f"missing {e}" if isinstance(e, KeyError) else first_line(e)


def _rope_scaling(reader: Any, arch: str, hf_config: Any) -> None:
    """``{arch}.rope.scaling.*`` into the config (transformers reads it only for some architectures):
    linear scaling, on Gemma-3's global layers only (as its HF configs scale them); others refused."""
    kind = reader.fields.get(f"{arch}.rope.scaling.type")
    kind = str(kind.contents()) if kind is not None else "none"
    if kind == "none":
        return
    if kind != "linear":
        raise SpecDecodeError(f"GGUF RoPE scaling {kind!r} is not supported (linear is)")
    factor = reader.fields.get(f"{arch}.rope.scaling.factor")
    if factor is None:
        raise SpecDecodeError(f"GGUF RoPE scaling is linear but {arch}.rope.scaling.factor is missing")
    factor = float(factor.contents())
    params = hf_config.rope_parameters
    (params["full_attention"] if "full_attention" in params else params).update(rope_type="linear", factor=factor)


# ---- GGUF blocks kept quantized ("gguf" quantization) -----------------------------------

GGUF_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")  # decoded into int4 groups of 32
GGUF_DENSE_TYPES = ("F32", "F16", "BF16")  # left to the dense (converted) weights


@dataclass
class Int4Groups:
    """One weight [N, K] as int4 groups of 32 in the kernels' convention w = (q - 8) * s + z.

    ``planes`` = 1 (4-bit types) or 2 (Q8_0 as hi/lo nibbles: q = 16 hi + lo, so the weight is
    the sum of two int4 matrices over the same input; ``q`` is then [N, 2K], hi plane first).
    """

    q: torch.Tensor  # uint8 [N, planes * K], values 0..15
    scales: torch.Tensor  # fp32 [N, planes * K / 32]
    zeros: torch.Tensor  # fp32 [N, planes * K / 32] (float64 for Q4_1, whose m + 8d must stay exact)
    planes: int
    source_type: str

    def as_q8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A Q8_0 weight's own (q int8 [N, K], d fp32 [N, K / 32]) back from its two planes."""
        assert self.source_type == "Q8_0" and self.planes == 2
        K = self.q.shape[1] // 2
        hi, lo = self.q[:, :K].to(torch.int16), self.q[:, K:].to(torch.int16)
        return (16 * (hi - 8) + lo).to(torch.int8), self.scales[:, self.scales.shape[1] // 2 :]

    def to_planes(self, planes: int) -> Int4Groups:
        """The same weight with extra all-zero planes (w = (8 - 8) * 0 + 0)."""
        extra = planes - self.planes
        if extra <= 0:
            return self
        N, G = self.scales.shape
        q = torch.cat([self.q, torch.full((N, self.q.shape[1] * extra // self.planes), 8, dtype=torch.uint8)], 1)
        pad = torch.zeros(N, G * extra // self.planes, dtype=self.zeros.dtype)
        return Int4Groups(
            q, torch.cat([self.scales, pad], 1), torch.cat([self.zeros, pad], 1), planes, self.source_type
        )


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles are elements 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_int4_groups(raw: np.ndarray, type_name: str, n: int, k: int) -> Int4Groups:
    """Raw GGUF rows [n, bytes] of type ``type_name`` (see GGUF_INT4_TYPES) -> Int4Groups."""
    if type_name == "Q4_K":
        b = raw.reshape(n, k // 256, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [n, B, 1]
        from gguf.quants import Q4_K

        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
        sc = sc.reshape(n, k // 256, 8).astype(np.float32)
        mn = mn.reshape(n, k // 256, 8).astype(np.float32)
        qs = b[..., 16:].reshape(n, k // 256, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, k)
        scale = (d * sc).reshape(n, -1)  # w = d sc q - dmin m per 32
        zero = (8 * d * sc - dmin * mn).reshape(n, -1)
        return Int4Groups(torch.from_numpy(q.copy()), torch.from_numpy(scale), torch.from_numpy(zero), 1, type_name)
    width = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    b = raw.reshape(n, k // 32, width)
    d = _f16(b[..., 0:2])[..., 0]  # [n, G]
    if type_name == "Q4_0":  # w = d (q - 8)
        q, zero = _nibbles(b[..., 2:]), np.zeros_like(d)
    elif type_name == "Q4_1":  # w = d q + m
        # in float64: in fp32 the sum lost m's low bits where |m| << |d|, and the kernel's z = zero - 8d
        # (computed in float64, stored fp16) was then not m
        q, zero = _nibbles(b[..., 4:]), _f16(b[..., 2:4])[..., 0].astype(np.float64) + 8 * d.astype(np.float64)
    else:  # Q8_0: w = d q8, q8 = 16 hi + lo with hi in [-8, 7], lo in [0, 15]
        q8 = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int16)
        hi, lo = (q8 >> 4) + 8, q8 & 0x0F  # arithmetic shift: floor division by 16
        q = np.concatenate([hi.reshape(n, k), lo.reshape(n, k)], axis=1).astype(np.uint8)
        scale = np.concatenate([16 * d, d], axis=1)  # hi plane: (hi - 8) 16 d; lo plane: (lo - 8) d + 8 d
        zero = np.concatenate([np.zeros_like(d), 8 * d], axis=1)
        return Int4Groups(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero), 2, type_name)
    q = q.reshape(n, k).astype(np.uint8)
    return Int4Groups(torch.from_numpy(q), torch.from_numpy(d.copy()), torch.from_numpy(zero), 1, type_name)


def gguf_keeps_blocks(gguf_path: Path) -> bool:
    """Whether ``quantization="gguf"`` can keep this file's weights as they are: every 2-D
    projection in a GGUF_INT4_TYPES or dense type, and at least one quantized (a header scan)."""
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(str(gguf_path)).tensors
    except Exception:  # noqa: BLE001 -- not a readable GGUF: the conversion says so, in one line
        return False
    kinds = {t.tensor_type.name for t in tensors if len(t.shape) == 2 and not t.name.endswith("norm.weight")}
    return bool(kinds & set(GGUF_INT4_TYPES)) and kinds <= set(GGUF_INT4_TYPES + GGUF_DENSE_TYPES)


def _check_finite(name: str, *tensors: torch.Tensor) -> None:
    """A damaged file's blocks (NaN or inf scales) ran and wrote empty text, exit 0."""
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise SpecDecodeError(f"GGUF tensor {name!r} holds non-finite values (NaN or inf): the file is damaged")


def gguf_int4_weights(gguf_path: Path, num_heads: int, num_kv_heads: int) -> dict[str, Int4Groups]:
    """transformers' name -> Int4Groups for every 2-D projection of a GGUF stored in a GGUF_INT4_TYPES
    type; dense (F32/F16/BF16) weights are left out. Any other type raises, naming the supported ones."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = gguf_architecture(reader)
    out = {}
    for t in reader.tensors:
        if len(t.shape) != 2 or t.name.endswith("norm.weight"):
            continue
        kind = t.tensor_type.name
        if kind in GGUF_DENSE_TYPES:
            continue
        if kind not in GGUF_INT4_TYPES:
            raise SpecDecodeError(
                f"quantization 'gguf' cannot keep tensor {t.name!r} of type {kind} quantized; "
                f"supported types: {', '.join(GGUF_INT4_TYPES + GGUF_DENSE_TYPES)}"
            )
        k, n = (int(d) for d in t.shape)  # ggml lists dims innermost first
        g = decode_int4_groups(np.asarray(t.data), kind, n, k)
        _check_finite(t.name, g.scales, g.zeros)
        heads = num_heads if ".attn_q." in t.name else num_kv_heads if ".attn_k." in t.name else None
        if arch == "llama" and heads is not None:  # rows permuted whole: blocks run along K
            g = Int4Groups(unpermute_qk(g.q, heads), unpermute_qk(g.scales, heads), unpermute_qk(g.zeros, heads),
                           g.planes, g.source_type)  # fmt: skip
        out[hf_name(t.name, arch)] = g
    return out
