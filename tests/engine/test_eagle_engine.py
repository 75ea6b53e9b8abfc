"""`eagle`, `eagle3` and `mtp` end to end on a tiny target, with nets trained for a few
seconds on its samples (so drafts are often accepted): greedy equals plain greedy at
batch 1 and 4, chains and trees; sampled output follows the target's exact joint
distribution; continuous batching with joins, leaves and preemption stays exact."""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.drafters.registry import parse_spec

from specdecode.drafters.eagle3 import Eagle3Net
from specdecode.drafters.eagle_net import FeatureNet
from specdecode.drafters.mtp import MtpNet
from specdecode.engine.serving import ServingEngine
from specdecode.model.loader import load_model
from tests.engine.checks import (
    assert_greedy_matches_plain,
    assert_samples_follow_target,
    sampling_target,
    serve_all,
)
from tests.learned import trained_folder
from tests.tiny import make_tiny_checkpoint

NETS = {"eagle": FeatureNet, "eagle3": Eagle3Net, "mtp": MtpNet}
PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = str(make_tiny_checkpoint(root / "target", "llama", seed=0))
    model = load_model(target, dtype=torch.float32, device="cpu").model
    nets = {m: str(trained_folder(cls, model, root / m, draft_vocab=0)) for m, cls in NETS.items()}
    return target, nets, LLM(model=target, dtype="float32", device="cpu", speculative_config=None)


@pytest.mark.parametrize("method", list(NETS))
@pytest.mark.parametrize("shape", [{}, {"topk": 3, "num_draft_tokens": 8}])
def test_greedy_equals_plain(setup, method, shape):
    target, nets, plain = setup
    spec = {"method": method, "model": nets[method], "num_speculative_tokens": 3, **shape}
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    for max_tokens in (1, 17, 40):
        batch = assert_greedy_matches_plain(llm, plain, PROMPTS, max_tokens, (method, shape))
    m = batch[1].metrics
    assert m.acceptance_rate > 0.3, "a trained net should be accepted often: the accept paths must run"


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_confidence_threshold_stops_chains_and_stays_exact(setup, method):
    """With ``confidence_threshold`` a row drafts no further after a token its net is unsure of
    (Hugging Face's assistant_confidence_threshold), row by row in a batch: greedy still equals
    plain greedy, fewer tokens are drafted the higher it is, and every round still proposes its
    first token."""
    target, nets, plain = setup
    drafted = {}
    for h in (0.0, 0.6, 0.999):
        spec = {"method": method, "model": nets[method], "num_speculative_tokens": 3, "confidence_threshold": h}
        llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
        out = assert_greedy_matches_plain(llm, plain, PROMPTS, 30, (method, h))
        drafted[h] = [(o.metrics.num_draft_tokens, o.metrics.num_drafts) for o in out]
    assert all(3 * (n - 1) < t <= 3 * n for t, n in drafted[0.0])  # all 3 each round (the last may be cut)
    assert all(n <= t <= 3 * n for h in (0.6, 0.999) for t, n in drafted[h]), drafted  # >= 1 token a round
    per_round = {h: sum(t for t, _ in d) / sum(n for _, n in d) for h, d in drafted.items()}
    assert per_round[0.999] < per_round[0.6] < 3, drafted  # a higher threshold stops more chains


@pytest.mark.parametrize("method", list(NETS))
def test_defaults_to_one_token(setup, method):
    """γ = 1 by default (eagle and eagle3: with the shipped nets a second draft token costs more than it saves)."""
    target, nets, plain = setup
    llm = LLM(model=target, speculative_config={"method": method, "model": nets[method]}, dtype="float32", device="cpu")
    out = assert_greedy_matches_plain(llm, plain, PROMPTS, 20, method)
    assert out[0].metrics.num_draft_tokens == out[0].metrics.num_drafts


@pytest.mark.parametrize(
    "method,shape,temperature,top_k,top_p",
    # top-k / top-p and a draft vocabulary that gives q = 0 to a token the target can sample; the
    # conformance suite runs each method's default chain and tree at plain temperature
    [("eagle3", {}, 0.8, 3, 1.0), ("eagle3", {"topk": 2}, 1.0, 0, 0.9), ("mtp", {"topk": 2}, 0.8, 3, 1.0),
     ("eagle", {"confidence_threshold": 0.5}, 1.0, 0, 1.0)],
)  # fmt: skip
def test_sampled_joint_distribution_matches_target(tmp_path, method, shape, temperature, top_k, top_p):
    target = sampling_target(tmp_path / "t")
    model = load_model(str(target), dtype=torch.float32, device="cpu").model
    net = trained_folder(NETS[method], model, tmp_path / "net", steps=20, draft_vocab=5)  # q = 0 on one token
    spec = {"method": method, "model": str(net), "num_speculative_tokens": 2, **shape}
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", device="cpu")
    outs = assert_samples_follow_target(llm, 3, temperature, top_k, top_p=top_p)
    if "confidence_threshold" in shape:  # the stopped chains' path ran: q(d) below it stopped some
        assert sum(o.metrics.num_draft_tokens for o in outs) < 2 * sum(o.metrics.num_drafts for o in outs)


@pytest.mark.parametrize("shape", [{}, {"topk": 2, "num_draft_tokens": 6}])
def test_serving_with_preemption_equals_alone(setup, shape):
    target, nets, plain = setup
    prompts = PROMPTS + [[4, 4, 4, 4], [9, 8, 7, 6, 5, 4, 3]]
    lengths = [20, 7, 33, 25, 12, 18]
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    want = [plain.generate([p], g)[0].token_ids for p, g in zip(prompts, greedy)]
    spec = parse_spec({"method": "eagle", "model": nets["eagle"], "num_speculative_tokens": 3, **shape})
    # the smallest pool that holds one sequence: requests take turns, preempted ones recompute
    engine = ServingEngine(plain.target, spec, max_model_len=64, max_num_seqs=6, block_size=4, num_blocks=20)
    assert serve_all(engine, prompts, greedy) == want
    assert engine.stats().num_preempted_total > 0
    assert engine.stats().kv_blocks_used == 0


def test_drafter_nets_run_the_targets_quantized_kernels(setup):
    """With a quantized target the net's own linears (and its draft-vocabulary head) are
    quantized the same way; with our row-invariant int4 kernel and the batch-invariant mode,
    speculative greedy still equals plain greedy exactly, in bf16."""
    from specdecode.model.cpu_int4 import cpu_lib
    from specdecode.model.quant import Int4Linear, Int8Linear

    target, nets, _ = setup
    int8 = LLM(model=target, speculative_config={"method": "eagle", "model": nets["eagle"]}, dtype="bfloat16",
               device="cpu", quantization="int8")  # fmt: skip
    net = int8.engine.drafter.net
    assert not [n for n, m in net.named_modules() if type(m) is torch.nn.Linear]
    assert isinstance(net.body.lm_head.linear, Int8Linear) and isinstance(net.fc, Int8Linear)
    if cpu_lib() is None:
        pytest.skip("exactness needs our int4 kernel (AVX512-BF16 or AVX2, and a C compiler)")
    kw = dict(dtype="bfloat16", device="cpu", quantization="int4", batch_invariant=True)
    llm = LLM(model=target, speculative_config={"method": "eagle", "model": nets["eagle"]}, **kw)
    assert isinstance(llm.engine.drafter.net.fc, Int4Linear)
    assert_greedy_matches_plain(llm, LLM(model=target, speculative_config=None, **kw), PROMPTS, 24, "eagle int4")


def test_confidence_head_feeds_the_adaptive_budget_and_stays_lossless(setup, tmp_path, monkeypatch, virtual_clock):
    target, _, plain = setup
    model = load_model(target, dtype=torch.float32, device="cpu").model
    path = trained_folder(FeatureNet, model, tmp_path / "conf", draft_vocab=0, confidence_head=True)
    spec = {"method": "eagle", "model": str(path), "num_speculative_tokens": 3, "verify_budget": "adaptive"}
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    seen, budgets = [], llm.engine.budget.budgets

    def spy(reqs, limits, proposal=None):
        if proposal is not None and proposal.confidence is not None:
            seen.append(proposal.confidence)
        return budgets(reqs, limits, proposal)

    monkeypatch.setattr(llm.engine.budget, "budgets", spy)
    assert_greedy_matches_plain(llm, plain, PROMPTS, 16, "eagle + confidence head")
    assert seen and all(c.shape[1] >= 1 and bool(((c > 0) & (c < 1)).all()) for c in seen)


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_draft_probabilities_feed_the_adaptive_budget_and_stay_lossless(setup, monkeypatch, method, virtual_clock):
    """Without a confidence head, a chain drafted under an adaptive budget reports each token's
    draft probability as its confidence (greedy: the net's top probability, at least 1/V);
    under a fixed budget nothing reads it, and none is computed. Greedy stays exact."""
    target, nets, plain = setup
    seen = {}
    for budget in ("fixed", "adaptive"):
        spec = {"method": method, "model": nets[method], "num_speculative_tokens": 3, "verify_budget": budget}
        llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
        drafter, proposals = llm.engine.drafter, []

        def spy(batch, n, propose=drafter.propose, out=proposals):
            out.append(propose(batch, n))
            return out[-1]

        monkeypatch.setattr(drafter, "propose", spy)
        assert_greedy_matches_plain(llm, plain, PROMPTS, 16, (method, budget))
        seen[budget] = proposals
    V = plain.target.config.vocab_size
    assert seen["fixed"] and all(d.confidence is None for d in seen["fixed"])
    conf = [(d.tokens, d.confidence) for d in seen["adaptive"]]
    assert conf and all(c is not None and c.shape == t.shape for t, c in conf)
    assert all(bool(((c >= 1 / V - 1e-6) & (c <= 1 + 1e-6)).all()) for _, c in conf)


def test_prompt_entries_are_fed_when_a_row_joins(setup, monkeypatch):
    """A joining row's prompt entries are fed at prefill, all but its last (whose output gives
    the first draft): its first proposal then feeds one entry, as later ones do, so what
    proposing costs, which an adaptive budget prices drafting from, does not hold the prompt."""
    target, nets, plain = setup
    llm = LLM(model=target, speculative_config={"method": "eagle", "model": nets["eagle"]}, dtype="float32", device="cpu")
    drafter, seen = llm.engine.drafter, []

    def spy(batch, n, propose=drafter.propose):
        seen.append(([len(f) for f in drafter.pending.rows], drafter.cache.lengths.tolist()))
        return propose(batch, n)

    monkeypatch.setattr(drafter, "propose", spy)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]  # 7, 3 and 1 tokens: 6, 2 and 0 entries fed at once
    assert_greedy_matches_plain(llm, plain, prompts, 8, "eagle")
    assert seen[0] == ([1], [6])  # the first prompt alone
    # the three joining together, the shortest prompt's prefill first (fewest tokens left first)
    assert next(s for s in seen if len(s[0]) == 3) == ([1, 1, 1], [0, 2, 6])


def _fresh_features(model, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The target's features [1, T, F] at ``tokens``, computed in one pass."""
    cache = model.new_cache(1, len(tokens))
    _, hidden = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache, hidden_layers=layers)
    return torch.cat(hidden, dim=-1)


@pytest.mark.parametrize("method", list(NETS))
def test_draft_cache_equals_a_fresh_feed_after_rounds(setup, method):
    """After rounds with rejections (greedy and sampled rows), what a row's draft cache holds
    plus what it still owes gives the logits a fresh feed of its committed tokens gives: the
    entries of rejected drafts were rolled back (a missing rollback passed every other test)."""
    target, nets, _ = setup
    spec = parse_spec({"method": method, "model": nets[method], "num_speculative_tokens": 3})
    engine = ServingEngine(load_model(target, dtype=torch.float32, device="cpu"), spec, max_model_len=96)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=3),
              SamplingParams(temperature=0.8, max_tokens=60, ignore_eos=True, seed=4)]  # fmt: skip
    for i, (p, sp) in enumerate(zip(PROMPTS[1:], params)):
        engine.add_request(str(i), p, sp)
    for _ in range(10):
        engine.step()
    stats = [s.stats for s in engine.batch.seqs]
    assert len(stats) == 3 and sum(s.num_accepted_tokens for s in stats) > 0
    assert sum(s.num_draft_tokens - s.num_accepted_tokens for s in stats) > 0  # rejections to roll back
    drafter = engine.drafter
    net = drafter.net
    live, _ = drafter._feed_pending(engine.batch)  # [B, Vd] at each row's newest entry
    for b, seq in enumerate(engine.batch.seqs):
        tokens = seq.token_ids
        n = len(tokens) - 1  # entries (feature t, token t + 1) for t < n
        assert int(drafter.cache.lengths[b]) == n
        states = net.fuse(_fresh_features(engine.model, tokens[:-1], drafter.hidden_layers))
        cache = net.body.new_cache(1, n + 2)
        with torch.no_grad():
            fresh, _ = net(states, torch.tensor([tokens[1:]]), torch.arange(n)[None], cache, logits_at=torch.tensor([[n - 1]]))
        torch.testing.assert_close(live[b], fresh[0, 0], atol=1e-4, rtol=1e-4)
