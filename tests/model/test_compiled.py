"""Compiled blocks: the same logits as eager on every pass shape, speculative greedy still
equal to plain greedy, bad modes as one line, and a failed compile falls back to eager."""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.model import compiled
from specdecode.model.compiled import compile_blocks, parse_compile, uncompile_blocks
from specdecode.model.cpu_int4 import cpu_lib
from specdecode.model.loader import load_model
from tests.tiny import make_tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("compiled") / "m", "llama", seed=3))


def test_modes_parse_and_bad_ones_name_the_supported():
    assert parse_compile(False) is None and parse_compile("none") is None
    assert parse_compile(True) == "default" and parse_compile("auto") == "default"
    assert parse_compile("reduce-overhead") == "reduce-overhead"
    with pytest.raises(SpecDecodeError, match="unknown compile mode 'fast'; supported: auto, none, default"):
        parse_compile("fast")


def _passes(model) -> list[torch.Tensor]:
    """prefill of 2 rows, then per row lengths 9 and 7: 1-token decode, a 4-token verify, and a
    padded pass where row 1 has only 2 real tokens (the packed path); then one row alone."""
    dev = model.embed.weight.device
    torch.manual_seed(0)
    prompt = torch.randint(0, 100, (2, 9)).to(dev)
    cache = model.new_cache(2, 32)
    out = [model(prompt, torch.arange(9, device=dev).expand(2, 9), cache).clone()]  # (CUDA graphs reuse outputs)
    cache.commit(torch.tensor([9, 7], device=dev))
    for T, valid in ((1, None), (4, None), (4, torch.tensor([[True] * 4, [True, True, False, False]]))):
        tokens = torch.randint(0, 100, (2, T), generator=torch.Generator().manual_seed(T)).to(dev)
        positions = cache.lengths[:, None] + torch.arange(T, device=dev)
        out.append(model(tokens, positions, cache, valid=None if valid is None else valid.to(dev)).clone())
        cache.commit(torch.tensor([1, 1], device=dev))
    one = model.new_cache(1, 32)  # one row: its own graphs (sizes 1 are specialised)
    out.append(model(prompt[:1], torch.arange(9, device=dev)[None], one).clone())
    one.commit(torch.tensor([9], device=dev))
    out.append(model(prompt[:1, :1], torch.tensor([[9]], device=dev), one).clone())
    return out


@pytest.mark.parametrize(
    "device, mode",
    [("cpu", "default"),
     pytest.param("cuda", "reduce-overhead", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
)  # fmt: skip
def test_compiled_blocks_give_eager_logits_on_every_pass_shape(tiny, device, mode):
    """On CUDA, ``reduce-overhead`` also replays each bucket as a CUDA graph."""
    model = load_model(tiny, dtype="float32", device=device, progress=False).model
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        eager = _passes(model)
        compile_blocks(model, mode)
        try:
            got = _passes(model)
            again = _passes(model)  # graphs replayed (CUDA graphs: after their recording)
        finally:
            uncompile_blocks(model)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # compiled, not eager twice
    for e, g, a in zip(eager, got, again):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(cpu_lib() is None, reason="needs our int4 kernel (AVX512-BF16 or AVX2)")
def test_compiled_int4_blocks_run_our_kernel_as_a_custom_op(tiny):
    """Inside a graph our int4 kernel is an opaque custom op (a ctypes call cannot be traced).
    bf16 activations: the graph rounds at other points than eager, so the logits agree to a
    small fraction of their spread, and the greedy tokens agree."""
    model = load_model(tiny, dtype="bfloat16", device="cpu", quantization="int4", progress=False).model
    model.cpu_blocks = None  # the torch blocks, which are what compiles
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        eager = _passes(model)
        compile_blocks(model, "default")
        try:
            got = _passes(model)
        finally:
            uncompile_blocks(model)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    for e, g in zip(eager, got):
        e, g = e.float(), g.float()
        assert (e - g).abs().max() < 0.1 * e.std()
        assert (e.argmax(-1) == g.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize(
    "device, dtype, mode",
    [("cpu", "float32", True), ("cpu", "bfloat16", True),
     pytest.param("cuda", "float32", "reduce-overhead",
                  marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
)  # fmt: skip
def test_compiled_speculative_greedy_equals_plain_greedy(tiny, device, dtype, mode):
    """fp32: every pass compiled (our row-invariant kernels as custom ops). bf16: by default the
    fused CPU block takes every pass, so it runs with batch_invariant=False, where the block
    keeps the short passes and the prefills longer than it takes (the warm-up's, and the
    80-token prompt's here) run the compiled torch blocks. CUDA: CUDA graphs."""
    torch._dynamo.utils.counters.clear()
    inv = {"batch_invariant": False} if dtype == "bfloat16" else {}
    llm = LLM(model=tiny, speculative_config=NGRAM, dtype=dtype, device=device, compile=mode, **inv)
    try:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the warm-up compiled
        assert llm.compile_mode == ("reduce-overhead" if device == "cuda" else "default")
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10], [(7 * i) % 50 + 3 for i in range(80)]]
        spec = llm.generate(prompts, params)
        plain = llm.generate(prompts, params, speculative=False)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert sum(o.metrics.num_accepted_tokens for o in spec) > 0  # verify passes ran compiled
    finally:
        uncompile_blocks(llm.target.model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_warm_up_leaves_no_bucket_to_compile_while_serving(tiny, dtype):
    """After load, passes of other batch sizes and widths, causal, packed or tree-masked,
    reuse the warm-up's graphs: nothing compiles (a stall, or a failure) mid-request. In bf16
    the fused CPU block takes the passes up to 64 positions, so these are wider."""
    llm = LLM(model=tiny, speculative_config=NGRAM, dtype=dtype, device="cpu", compile=True)
    model = llm.target.model
    try:
        built = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        B, T = (3, 5) if dtype == "float32" else (5, 17)
        cache = model.new_cache(B, 2 * T)
        tokens = torch.randint(0, 100, (B, T))
        positions = torch.arange(T).expand(B, T)
        valid = torch.ones(B, T, dtype=torch.bool)
        valid[0, 2:] = False
        tree = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
        inv = {"batch_invariant": llm.engine.batch_invariant}  # as the engine runs its passes
        with torch.inference_mode():
            for extra in ({}, {"valid": valid}, {"block_mask": tree}):
                model(tokens, positions, cache, **extra, **inv)
            cache.commit(torch.full((B,), T))
            model(tokens[:, :1], cache.lengths[:, None], cache, **inv)  # B rows decoding one token
            rows = 3 if dtype == "float32" else 70
            one = torch.ones(rows, 1, dtype=torch.long)
            model(one, torch.zeros(rows, 1, dtype=torch.long), model.new_cache(rows, 1), **inv)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == built
    finally:
        uncompile_blocks(model)


def test_the_warm_up_fits_a_tiny_context(tiny):
    llm = LLM(model=tiny, speculative_config=NGRAM, dtype="float32", device="cpu", compile=True, max_model_len=12)
    try:
        assert llm.compile_mode == "default"  # no fallback: the dummy prompts fit 12 tokens
    finally:
        uncompile_blocks(llm.target.model)


def test_a_compiler_error_falls_back_even_if_errors_were_suppressed(tiny, monkeypatch):
    """A user's earlier ``suppress_errors = True`` must not hide a failed compile at load
    (it would report "compiled" and run eagerly)."""
    import torch._inductor.compile_fx as compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: C++ compiler not found")

    torch._dynamo.reset()  # compile anew, through the broken backend
    monkeypatch.setattr(compile_fx, "compile_fx", broken)
    # config.patch, not monkeypatch: undoing a monkeypatch of dynamo's config module deletes
    # the setting (pytest 9.2), which breaks every later use of it in the process
    with torch._dynamo.config.patch(suppress_errors=True):
        with pytest.warns(UserWarning, match="torch.compile failed, running eagerly"):
            llm = LLM(model=tiny, speculative_config=NGRAM, dtype="float32", device="cpu", compile=True)
    assert llm.compile_mode is None
    torch._dynamo.reset()


def test_a_failed_compile_falls_back_to_eager_with_a_warning(tiny, monkeypatch):
    def broken(engines, progress=True):
        raise RuntimeError("inductor: C++ compiler not found\nlong traceback text")

    monkeypatch.setattr(compiled, "warm_up", broken)
    with pytest.warns(UserWarning, match="torch.compile failed, running eagerly: RuntimeError: inductor: C"):
        llm = LLM(model=tiny, speculative_config=NGRAM, dtype="float32", device="cpu", compile="default")
    assert llm.compile_mode is None
    assert all(block._compiled_call_impl is None for block in llm.target.model.layers)
    out = llm.generate([[5, 6, 7, 5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
