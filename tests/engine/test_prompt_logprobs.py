"""prompt_logprobs: each prompt token's logprob under the model, whatever chunks split the prefill."""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.serving import ServingEngine
from tests.tiny import make_tiny_checkpoint

PROMPT = [5, 9, 3, 7, 1, 2, 8, 4, 4, 6, 11, 3]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("plp") / "t", "llama", 2, num_hidden_layers=2)
    return LLM(model=str(path), dtype="float32", device="cpu", speculative_config={"method": "ngram"})


def reference(llm) -> torch.Tensor:
    model = llm.target.model
    logits = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], model.new_cache(1, 32))[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("chunk", [3, 4, 256])
def test_prompt_logprobs_under_chunked_prefill(llm, chunk):
    ref = reference(llm)
    engine = ServingEngine(llm.target, None, max_model_len=64, max_num_batched_tokens=chunk)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    got = [e.prompt_logprobs for e in events if e.prompt_logprobs is not None]
    assert len(got) == 1 and len(got[0]) == len(PROMPT) and got[0][0] is None
    for t, x in enumerate(got[0][1:]):
        assert x.token_id == PROMPT[t + 1] and x.logprob == pytest.approx(ref[t, PROMPT[t + 1]].item(), abs=1e-5)
        assert [i for i, _ in x.top] == ref[t].topk(2).indices.tolist()


def test_prompt_logprobs_from_llm_speculative_or_not(llm):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    spec, plain = llm.generate([PROMPT], params)[0], llm.generate([PROMPT], params, speculative=False)[0]
    assert [x and x.logprob for x in spec.prompt_logprobs] == [x and x.logprob for x in plain.prompt_logprobs]
    assert llm.generate([PROMPT[:1]], params)[0].prompt_logprobs == [None]  # one token: nothing to score
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2))[0].prompt_logprobs is None
