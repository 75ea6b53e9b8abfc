"""batch_invariant=True: a position's logits are bitwise the same alone or inside a
(γ+1)-token pass or a tree: int4 weights in bf16, and dense weights in fp32."""

from __future__ import annotations

import pytest
import torch

from specdecode.model.cpu_int4 import cpu_lib
from specdecode.model.loader import load_model
from specdecode.model.quant import quantize_model_
from tests.tiny import make_tiny_checkpoint, root_path, small_tree

pytestmark = pytest.mark.skipif(cpu_lib() is None, reason="needs our int4 kernel (AVX512-BF16 or AVX2, and a C compiler)")


# bf16 with int4 weights (our int4 kernel); fp32 with dense weights, where torch's GEMM and SDPA
# would otherwise run (our fp32 GEMM and attention, model/invariant.py); gemma3 has sliding windows
@pytest.fixture(scope="module", params=[("llama", "int4"), ("gemma3", "int4"), ("llama", None), ("gemma3", None),
                                        ("qwen3", None)])  # fmt: skip
def model(request, tmp_path_factory):
    arch, quant = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bi") / "m", arch, seed=0)
    m = load_model(str(path), dtype="bfloat16" if quant else "float32", device="cpu").model
    return quantize_model_(m, quant) if quant else m


def prefilled(model, prompt: torch.Tensor):
    cache = model.new_cache(prompt.shape[0], 64)
    model(prompt, torch.arange(prompt.shape[1]).expand_as(prompt), cache, batch_invariant=True)  # rows alone
    cache.commit(torch.full((prompt.shape[0],), prompt.shape[1]))
    return cache


@torch.inference_mode()
def test_chain_pass_equals_one_token_steps(model):
    torch.manual_seed(0)
    toks = torch.randint(3, 90, (2, 20))
    cache = prefilled(model, toks[:, :11])
    multi = model(toks[:, 11:], 11 + torch.arange(9).expand(2, 9), cache, batch_invariant=True)
    cache = prefilled(model, toks[:, :11])
    single = []
    for t in range(11, 20):
        single.append(model(toks[:, t : t + 1], torch.full((2, 1), t), cache, batch_invariant=True))
        cache.commit(torch.ones(2, dtype=torch.long))
    assert torch.equal(multi, torch.cat(single, dim=1))
    # one row alone gives the same bits as inside the batch of two
    alone = model(toks[:1, 11:], 11 + torch.arange(9)[None], prefilled(model, toks[:1, :11]), batch_invariant=True)
    assert torch.equal(alone, multi[:1])


@torch.inference_mode()
def test_tree_nodes_equal_their_paths(model):
    torch.manual_seed(1)
    prompt = torch.randint(3, 90, (1, 10))
    tokens, parents, depth, mask = small_tree()
    tree = model(tokens, 10 + depth, prefilled(model, prompt), block_mask=mask[None], batch_invariant=True)
    for node in range(6):
        path = root_path(node, parents)
        cache = prefilled(model, prompt)
        for i, n in enumerate(path):
            out = model(tokens[:, n : n + 1], torch.tensor([[10 + i]]), cache, batch_invariant=True)
            cache.commit(torch.ones(1, dtype=torch.long))
        assert torch.equal(out[0, 0], tree[0, node]), node
