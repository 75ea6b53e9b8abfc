"""`medusa` end to end on tiny random targets with randomly initialised heads, in fp32:
greedy equals plain greedy (chain, static tree; batch 1 and 4; served concurrently),
sampling follows the target's distribution, and typical acceptance is flagged lossy."""

from __future__ import annotations

import pytest

from specdecode import LLM, SamplingParams
from specdecode.drafters.registry import parse_spec

from specdecode.drafters.learned import save_net
from specdecode.engine.serving import ServingEngine
from specdecode.entrypoints.cli import _print_stats
from tests.drafters.test_medusa import random_medusa
from tests.engine.checks import (
    assert_greedy_matches_plain,
    assert_samples_follow_target,
    greedy,
    sampling_target,
    serve_all,
)
from tests.tiny import make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2]]
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]


def medusa_folder(target_path, out, seed: int = 0) -> str:
    target = LLM(model=str(target_path), dtype="float32", device="cpu", speculative_config=None).target.model
    return str(save_net(random_medusa(target, seed=seed), target, out))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa_engine")
    target = make_tiny_checkpoint(root / "target", "llama", seed=0)
    return {"target": str(target), "medusa": medusa_folder(target, root / "medusa")}


@pytest.fixture(scope="module")
def plain(ckpts):
    return LLM(model=ckpts["target"], dtype="float32", device="cpu", speculative_config=None)


def specs(ckpts) -> dict[str, dict]:
    return {
        "chain": {"method": "medusa", "model": ckpts["medusa"], "num_speculative_tokens": 3},
        "tree": {"method": "medusa", "model": ckpts["medusa"], "speculative_token_tree": TREE},
        "default_tree": {"method": "medusa", "model": ckpts["medusa"], "speculative_token_tree": "default",
                         "num_speculative_tokens": 2},
        "typical": {"method": "medusa", "model": ckpts["medusa"], "acceptance": "typical"},
    }  # fmt: skip


@pytest.mark.parametrize("name", ["chain", "tree", "default_tree"])
def test_greedy_equals_plain(ckpts, plain, name):
    llm = LLM(model=ckpts["target"], speculative_config=specs(ckpts)[name], dtype="float32", device="cpu")
    for max_tokens in (1, 2, 17, 40):
        batch = assert_greedy_matches_plain(llm, plain, PROMPTS, max_tokens, name)
    assert batch[0].metrics.num_drafts > 0 and not batch[0].metrics.lossy


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_served_concurrently_equals_alone(ckpts, plain, name):
    lengths = [20, 7, 33, 25]
    alone = [plain.generate([p], greedy(n))[0].token_ids for p, n in zip(PROMPTS, lengths)]
    # max_num_seqs 2: rows join as others finish, so prefill / select_rows interleave with rounds
    engine = ServingEngine(plain.target, parse_spec(specs(ckpts)[name]), max_model_len=64, max_num_seqs=2)
    assert serve_all(engine, PROMPTS, [greedy(n) for n in lengths]) == alone


@pytest.mark.parametrize(
    "shape,temperature,top_k,top_p", [("chain", 1.0, 0, 1.0), ("chain", 0.8, 3, 0.9), ("tree", 0.9, 0, 1.0)]
)
def test_sampled_joint_distribution_matches_target(tmp_path, shape, temperature, top_k, top_p):
    target = sampling_target(tmp_path / "t")
    folder = medusa_folder(target, tmp_path / "m", seed=3)
    spec = {"method": "medusa", "model": folder, "num_speculative_tokens": 2}
    if shape == "tree":
        spec["speculative_token_tree"] = [[0], [1], [0, 0], [0, 1], [2]]
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", device="cpu")
    outs = assert_samples_follow_target(llm, 3, temperature, top_k, top_p=top_p)
    assert not any(o.metrics.lossy for o in outs)


def test_typical_acceptance_is_flagged_lossy(ckpts, plain, capsys):
    llm = LLM(model=ckpts["target"], speculative_config=specs(ckpts)["typical"], dtype="float32", device="cpu")
    sampled = [SamplingParams(temperature=1.0, max_tokens=12, seed=s, ignore_eos=True) for s in range(4)]
    outs = llm.generate(PROMPTS, sampled)
    assert all(o.metrics.lossy and o.metrics.to_dict()["lossy"] for o in outs)
    assert all(len(o.token_ids) == 12 for o in outs)
    # greedy typical acceptance is greedy verification: exact, not flagged; nor is a sampled
    # request that drafts nothing (γ = 0), sampled from p alone
    ref = plain.generate(PROMPTS, greedy(17))
    got = llm.generate(PROMPTS, greedy(17))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert not any(o.metrics.lossy for o in got)
    engine = llm.engine
    engine.add_request("bent", llm.tokenize(PROMPTS[0]), sampled[0])
    engine.add_request("plain", llm.tokenize(PROMPTS[1]), sampled[1], spec_override={"num_speculative_tokens": 0})
    last = {}
    while engine.has_unfinished():
        last.update({e.request_id: e.stats for e in engine.step()})
    assert last["bent"].lossy and not last["plain"].lossy and last["plain"].num_draft_tokens == 0
    # the CLI's report says so; an exact run's does not
    _print_stats({"metrics": outs[0].metrics.to_dict(), "tokens_per_s": 1.0, "kernels": "-"}, speculative=True)
    exact = LLM(model=ckpts["target"], speculative_config=specs(ckpts)["chain"], dtype="float32", device="cpu")
    out = exact.generate([PROMPTS[0]], sampled[0])[0]
    _print_stats({"metrics": out.metrics.to_dict(), "tokens_per_s": 1.0, "kernels": "-"}, speculative=True)
    report = capsys.readouterr().err.split("---")
    assert "not guaranteed to follow the target's distribution" in report[1]
    assert "LOSSY" not in report[2]
