"""dflash end to end on tiny random targets with randomly initialised nets, in fp32:
greedy equals plain greedy (batch 1 and 4, γ 4 and 8, several architectures, blocks cut by
a confidence threshold), sampled output follows the target's exact joint distribution, and
under continuous batching (requests joining, leaving, preempted) each request decodes as it
would alone."""

from __future__ import annotations

import pytest

from specdecode import LLM, SamplingParams
from specdecode.drafters.registry import parse_spec

from specdecode.engine.serving import ServingEngine
from tests.drafters.test_dflash import make_dflash
from tests.engine.checks import (
    assert_greedy_matches_plain,
    assert_samples_follow_target,
    greedy,
    sampling_target,
)
from tests.tiny import make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2]]
ARCH_OVERRIDES = {"llama": {"num_hidden_layers": 4}, "qwen2": {}, "gemma3": {}}  # gemma3: qk-norm, scaled embeddings
# untrained nets: seeds whose drafts the target sometimes accepts, so greedy tests run the accept path
NET_SEEDS = {"llama": 2, "qwen2": 5, "gemma3": 2}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_engine")
    out = {}
    for arch, overrides in ARCH_OVERRIDES.items():
        target = make_tiny_checkpoint(root / arch, arch, seed=0, **overrides)
        out[arch] = (str(target), make_dflash(root / f"{arch}_net", target, seed=NET_SEEDS[arch]))
    return out


def dflash(net: str, gamma: int, threshold: float = 0.0) -> dict:
    return {"method": "dflash", "model": net, "num_speculative_tokens": gamma, "confidence_threshold": threshold}


@pytest.mark.parametrize("arch,gamma", [("llama", 4), ("llama", 8), ("qwen2", 8), ("gemma3", 4)])
def test_greedy_equals_plain(ckpts, arch, gamma):
    target, net = ckpts[arch]
    plain = LLM(model=target, dtype="float32", device="cpu", speculative_config=None)
    llm = LLM(model=target, speculative_config=dflash(net, gamma), dtype="float32", device="cpu")
    for max_tokens in (1, 17, 40):
        batch = assert_greedy_matches_plain(llm, plain, PROMPTS, max_tokens, (arch, gamma))
    assert batch[0].metrics.num_drafts > 0
    m = batch[0].metrics  # the whole block each round (the last may be cut by max_tokens)
    assert gamma * (m.num_drafts - 1) < m.num_draft_tokens <= gamma * m.num_drafts


def test_confidence_threshold_cuts_blocks_and_stays_exact(ckpts):
    """A block is cut after its first token the net is unsure of: greedy still equals plain
    greedy at batch 1 and 4, and fewer positions are verified, never none."""
    target, net = ckpts["llama"]
    plain = LLM(model=target, dtype="float32", device="cpu", speculative_config=None)
    llm = LLM(model=target, speculative_config=dflash(net, 8, threshold=0.5), dtype="float32", device="cpu")
    out = assert_greedy_matches_plain(llm, plain, PROMPTS, 30, "dflash, confidence_threshold 0.5")
    drafted, rounds = sum(o.metrics.num_draft_tokens for o in out), sum(o.metrics.num_drafts for o in out)
    assert rounds <= drafted < 8 * rounds


def test_adaptive_budget_plans_on_the_blocks_draft_probabilities(ckpts, monkeypatch, virtual_clock):
    """Under an adaptive budget each block reports its tokens' draft probabilities (at least
    1/V: greedy takes the top one) as confidences, and greedy stays exact."""
    target, net = ckpts["llama"]
    plain = LLM(model=target, dtype="float32", device="cpu", speculative_config=None)
    spec = {**dflash(net, 8), "verify_budget": "adaptive"}
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    seen, budgets = [], llm.engine.budget.budgets

    def spy(reqs, limits, proposal=None):
        if proposal is not None:
            seen.append((proposal.tokens, proposal.confidence))
        return budgets(reqs, limits, proposal)

    monkeypatch.setattr(llm.engine.budget, "budgets", spy)
    assert_greedy_matches_plain(llm, plain, PROMPTS, 24, "dflash, adaptive")
    V = plain.target.config.vocab_size
    assert seen and all(c is not None and c.shape == t.shape for t, c in seen)  # as deep as the step asked
    assert all(bool(((c >= 1 / V - 1e-6) & (c <= 1 + 1e-6)).all()) for _, c in seen)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,threshold", [(1.0, 0, 1.0, 0.0), (0.8, 3, 0.9, 0.0), (1.0, 0, 1.0, 0.4)]
)
def test_sampled_joint_distribution_matches_target(tmp_path, temperature, top_k, top_p, threshold):
    target = sampling_target(tmp_path / "t", num_hidden_layers=4)
    net = make_dflash(tmp_path / "net", target, seed=5, block_size=4)
    llm = LLM(model=str(target), speculative_config=dflash(net, 3, threshold), dtype="float32", device="cpu")
    outs = assert_samples_follow_target(llm, 3, temperature, top_k, top_p=top_p)
    if threshold:  # q(d) below it cut some blocks
        assert sum(o.metrics.num_draft_tokens for o in outs) < 3 * sum(o.metrics.num_drafts for o in outs)


def test_adaptive_budget_under_sampling_keeps_the_targets_distribution(tmp_path, virtual_clock):
    """The block's draft probabilities are q(d_k) of the tokens it sampled: a budget planned on
    them verifies d_k more often when q(d_k) is high, so a verified token no longer follows q_k
    and the output over-weights what the draft likes (chi-square p ~ 1e-23 at 3000 samples).
    Sampled rows plan on the online estimates instead. Here a position must pay for itself
    (one row; a verified position costs half a step), so the plan keeps some drafts and drops others."""
    from specdecode.engine.adaptive import AdaptiveBudget
    from tests.engine.test_adaptive import roofline

    V, n, samples, temperature = 6, 2, 3000, 3.0
    target = make_tiny_checkpoint(tmp_path / "t", "llama", seed=0, vocab_size=V)
    net = make_dflash(tmp_path / "net", target, seed=1)
    spec = {**dflash(net, 4), "verify_budget": "adaptive"}
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", device="cpu", max_num_seqs=1)
    assert llm.engine.drafter.report_confidence
    policy = AdaptiveBudget(roofline(knee=1, slope=0.5), max_gamma=4)
    policy._observe_cost = lambda *args: None  # the curve stays as given (no refit from the tiny model's passes)
    llm.engine.budget = policy
    outs = assert_samples_follow_target(llm, n, temperature, 0, samples)
    assert 0 < sum(o.metrics.num_drafts for o in outs) < samples  # some rounds drafted, some did not


def test_adaptive_budget_with_a_confidence_stop_under_sampling_keeps_the_targets_distribution(tmp_path, virtual_clock):
    """A confidence stop cuts a sampled block after a token whose q(d) is low, so the block's
    length follows its drafts; a plan capped by that length (the drafting overhead paid once
    makes a cap of 1 not worth drafting, a cap of 2 worth it) verified d_1 by its own q (chi-square
    p ~ 1e-21). A sampled row's plan takes γ as its cap, and the stop then cuts the block."""
    from specdecode.engine.adaptive import AdaptiveBudget
    from specdecode.engine.cost import VerifyCost

    V, n, samples, temperature = 6, 2, 3000, 3.0
    target = make_tiny_checkpoint(tmp_path / "t", "llama", seed=0, vocab_size=V)
    net = make_dflash(tmp_path / "net", target, seed=1)
    spec = {**dflash(net, 4, threshold=0.2), "verify_budget": "adaptive"}
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", device="cpu", max_num_seqs=1)
    policy = AdaptiveBudget(VerifyCost([(1, 1.0), (64, 1.0), (164, 2.0)]), max_gamma=4)  # positions free to 64
    policy._observe_cost = lambda *args: None
    policy.draft_overhead = 0.6  # seconds a pass that carries drafts pays beyond its positions
    policy.acceptance.confidence_rows = lambda ids, evidence=None: [[0.5] * 4 for _ in ids]  # history-free estimates
    llm.engine.budget = policy
    outs = assert_samples_follow_target(llm, n, temperature, 0, samples)
    assert sum(o.metrics.num_drafts for o in outs) > 0


def run_staggered(engine: ServingEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Requests join one per step while the others decode, and leave as they finish."""
    out: list[list[int]] = [[] for _ in prompts]
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params[i])
        if engine.has_unfinished():
            for e in engine.step():
                out[int(e.request_id)] += e.new_token_ids
        steps += 1
        assert steps < 500
    return out


@pytest.mark.parametrize("num_blocks", [None, 20])  # 20 blocks of 4: requests take turns, preempted and recomputed
def test_served_concurrently_equals_alone(ckpts, num_blocks):
    target_path, net = ckpts["llama"]
    plain = LLM(model=target_path, dtype="float32", device="cpu", speculative_config=None)
    prompts = PROMPTS + [[4, 4, 4, 4], [9, 8, 7, 6, 5, 4, 3]]
    max_tokens = [20, 7, 33, 25, 12, 18]
    alone = [plain.generate([p], greedy(m))[0].token_ids for p, m in zip(prompts, max_tokens)]
    engine = ServingEngine(plain.target, parse_spec(dflash(net, 4)), max_model_len=64, max_num_seqs=6,
                           block_size=4, num_blocks=num_blocks)  # fmt: skip
    assert run_staggered(engine, prompts, [greedy(m) for m in max_tokens]) == alone
    if num_blocks is not None:
        assert engine.stats().num_preempted_total > 0
    assert engine.stats().kv_blocks_used == 0
    assert engine.drafter.cache.batch_size == 0  # every row left the drafter too
