"""Compiled blocks: the same logits as eager on every pass shape, speculative greedy still
equal to plain greedy, bad modes as one line, and a failed compile falls back to eager."""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.model import compiled
from specdecode.model.compiled import compile_blocks, parse_compile, uncompile_blocks
from specdecode.model.loader import load_model
from tests.tiny import make_tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("compiled") / "m", "llama", seed=3))


def test_modes_parse_and_bad_ones_name_the_supported():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert parse_compile(False, cpu) is None and parse_compile("none", cpu) is None
    assert parse_compile(True, cpu) == "default" and parse_compile("auto", cuda) == "reduce-overhead"
    with pytest.raises(SpecDecodeError, match="unknown compile mode 'fast'; supported: auto, none, default"):
        parse_compile("fast", cpu)


def test_compiled_blocks_give_eager_logits_on_every_pass_shape(tiny):
    model = load_model(tiny, dtype="float32", device="cpu", progress=False).model
    torch.manual_seed(0)
    prompt = torch.randint(0, 100, (2, 9))

    def passes() -> list[torch.Tensor]:
        """prefill of 2 rows, then per row lengths 9 and 7: 1-token decode, a 4-token verify, and a
        padded pass where row 1 has only 2 real tokens (the packed path)."""
        cache = model.new_cache(2, 32)
        out = [model(prompt, torch.arange(9).expand(2, 9), cache)]
        cache.commit(torch.tensor([9, 7]))
        for T, valid in ((1, None), (4, None), (4, torch.tensor([[True] * 4, [True, True, False, False]]))):
            tokens = torch.randint(0, 100, (2, T), generator=torch.Generator().manual_seed(T))
            positions = cache.lengths[:, None] + torch.arange(T)
            out.append(model(tokens, positions, cache, valid=valid))
            cache.commit(torch.tensor([1, 1]))
        one = model.new_cache(1, 32)  # one row: its own graphs (sizes 1 are specialised)
        out.append(model(prompt[:1], torch.arange(9)[None], one))
        one.commit(torch.tensor([9]))
        out.append(model(prompt[:1, :1], torch.tensor([[9]]), one))
        return out

    with torch.inference_mode():
        eager = passes()
        compile_blocks(model, "default")
        try:
            got = passes()
        finally:
            uncompile_blocks(model)
    for e, g in zip(eager, got):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_speculative_greedy_equals_plain_greedy(tiny, dtype):
    """fp32: every pass compiled. bf16: the fused CPU block keeps the short passes, and the
    warm-up's prefill, longer than it takes, builds the torch blocks' graphs (they run then)."""
    torch._dynamo.utils.counters.clear()
    llm = LLM(model=tiny, speculative_config=NGRAM, dtype=dtype, device="cpu", compile=True)
    try:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the warm-up compiled
        assert llm.compile_mode == "default"
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10]]
        spec = llm.generate(prompts, params)
        plain = llm.generate(prompts, params, speculative=False)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert sum(o.metrics.num_accepted_tokens for o in spec) > 0  # verify passes ran compiled
    finally:
        uncompile_blocks(llm.target.model)


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
