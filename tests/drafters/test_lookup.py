"""Prompt lookup beside a model drafter (``prompt_lookup_max`` on `eagle`, `draft_model`, `dflash`, `medusa`):
rows whose suffix n-gram occurred before draft its continuation, the others draft with the
model, in the same round. Greedy equals plain greedy (chains, dynamic and static trees, alone
and batched, both kinds of row seen); sampled output follows the target's exact joint
distribution; an adaptive budget plans the lookup rows on its own estimates; bad options get
one line."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import pytest
import torch

from specdecode import LLM
from specdecode.drafters.registry import parse_spec
from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.drafters.dflash_net import DFlashNet
from specdecode.drafters.eagle_net import FeatureNet
from specdecode.drafters import registry
from specdecode.drafters.base import Draft
from specdecode.drafters.lookup import LookupDrafter, LookupKeys
from specdecode.drafters.medusa import MedusaNet
from specdecode.engine.serving import ServingEngine
from specdecode.cache.kv_cache import NoCache
from specdecode.model.loader import load_model
from tests.engine.checks import (
    SAMPLING_VOCAB,
    assert_greedy_matches_plain,
    assert_samples_follow_target,
    greedy,
    sampling_target,
)
from tests.learned import trained_folder
from tests.tiny import early_exit_checkpoint, make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2]]
# learned drafters for the sampled tests' target (V = 6): the net class and its shape
SAMPLING_NETS = {"eagle": (FeatureNet, {}), "medusa": (MedusaNet, {}),
                 "dflash": (DFlashNet, {"num_layers": 1, "block_size": 4})}  # fmt: skip
TREE = {"topk": 3, "num_draft_tokens": 6}
STATIC = {"speculative_token_tree": [[0], [1], [0, 0]]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup")
    target = make_tiny_checkpoint(root / "target", "llama", seed=0)
    model = load_model(str(target), dtype=torch.float32, device="cpu").model
    models = {"eagle": str(trained_folder(FeatureNet, model, root / "eagle", draft_vocab=0)),
              "draft_model": str(early_exit_checkpoint(target, root / "draft", 1)),
              "medusa": str(trained_folder(MedusaNet, model, root / "medusa", draft_vocab=0)),
              "dflash": str(trained_folder(DFlashNet, model, root / "dflash", steps=30, num_layers=1, block_size=4,
                                           draft_vocab=0))}  # fmt: skip
    return str(target), models, LLM(model=str(target), dtype="float32", device="cpu", speculative_config=None)


def count_sources(drafter, monkeypatch) -> dict[str, int]:
    """Counts the rows each round gave to lookup and to the model (wraps the lookup wrapper
    module's `look_up`), and checks that each copying row's proposal is its copy (wraps `propose`);
    "mixed" counts the rounds in which both kinds of row drafted."""
    assert isinstance(drafter, LookupDrafter), type(drafter)
    seen = {"lookup": 0, "model": 0, "mixed": 0}
    module = sys.modules[type(drafter).propose.__module__]
    look_up, propose, last = module.look_up, drafter.propose, []

    def spy(batch, lookup, num_tokens):
        found, matched = look_up(batch, lookup, num_tokens)
        seen["lookup"] += sum(1 for f in found if f)
        seen["model"] += sum(1 for f in found if not f)
        seen["mixed"] += any(found) and not all(found)
        last[:] = [found]
        return found, matched

    def checked(batch, num_tokens):
        draft = propose(batch, num_tokens)
        tokens = draft.tokens if draft.tree is None else draft.tree.tokens[:, 1:]
        for b, copy in enumerate(last[0]):
            assert not copy or tokens[b, : len(copy)].tolist() == copy, (b, copy, tokens[b].tolist())
        return draft

    monkeypatch.setattr(module, "look_up", spy)
    monkeypatch.setattr(drafter, "propose", checked)
    return seen


@pytest.mark.parametrize(
    "method,shape,steps",
    [("eagle", {}, 1), ("eagle", TREE, 2), ("draft_model", {}, 2), ("draft_model", TREE, 2),
     ("draft_model", STATIC, 2), ("dflash", {}, 2), ("medusa", {}, 2), ("medusa", STATIC, 2)],
)  # fmt: skip
def test_greedy_equals_plain(setup, monkeypatch, method, shape, steps):
    target, models, plain = setup
    spec = {"method": method, "model": models[method], "num_speculative_tokens": 4, "prompt_lookup_max": 3, **shape}
    if shape is not STATIC:
        spec["num_steps"] = steps
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    seen = count_sources(llm.engine.drafter, monkeypatch)
    batch = []
    for max_tokens in (1, 17, 40):
        batch = assert_greedy_matches_plain(llm, plain, PROMPTS, max_tokens, (method, shape))
    assert seen["lookup"] > 0 and seen["model"] > 0 and seen["mixed"] > 0, seen
    # lookup drafts run deeper than the model's and are accepted there
    assert any(len(o.metrics.accepted_per_position) > steps and o.metrics.accepted_per_position[steps] > 0
               for o in batch), [o.metrics.accepted_per_position for o in batch]  # fmt: skip


@pytest.mark.parametrize(
    "method,shape,prompt_lookup_min,temperature,top_k,top_p",
    [("eagle", {}, 1, 1.0, 0, 1.0), ("eagle", {}, 2, 0.8, 3, 1.0), ("eagle", {"topk": 2}, 2, 1.0, 0, 0.9),
     ("draft_model", {}, 2, 1.0, 0, 0.85), ("draft_model", {"topk": 2}, 2, 0.9, 0, 1.0),
     ("draft_model", {"speculative_token_tree": [[0], [1], [0, 0]]}, 2, 1.0, 0, 1.0),
     ("dflash", {}, 2, 1.0, 0, 0.9), ("medusa", {}, 2, 0.8, 3, 1.0), ("medusa", STATIC, 2, 1.0, 0, 1.0)],
)  # fmt: skip
def test_sampled_joint_distribution_matches_target(tmp_path, monkeypatch, method, shape, prompt_lookup_min,
                                                   temperature, top_k, top_p):  # fmt: skip
    target = sampling_target(tmp_path / "t")
    if method in SAMPLING_NETS:
        model = load_model(str(target), dtype=torch.float32, device="cpu").model
        cls, config = SAMPLING_NETS[method]
        drafter = trained_folder(cls, model, tmp_path / "net", steps=20, draft_vocab=5, **config)  # q = 0 on one token
    else:
        drafter = make_tiny_checkpoint(tmp_path / "d", "llama", seed=5, logit_scale=0.5, vocab_size=SAMPLING_VOCAB)
    steps = {} if "speculative_token_tree" in shape else {"num_steps": 1}
    spec = {"method": method, "model": str(drafter), "num_speculative_tokens": 2, "prompt_lookup_max": 2,
            "prompt_lookup_min": prompt_lookup_min, **steps, **shape}  # fmt: skip
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", device="cpu")
    seen = count_sources(llm.engine.drafter, monkeypatch)
    assert_samples_follow_target(llm, 3, temperature, top_k, top_p=top_p)
    # with V = 6 every row's last token occurred before: 1-grams give only lookup rows, 2-grams both
    assert seen["lookup"] > 0 and (prompt_lookup_min == 1 or seen["model"] > 0), seen


@pytest.mark.parametrize("shape", [{}, TREE])
def test_rounds_where_every_row_copies_run_no_net_pass_and_draft_as_if_fed(setup, monkeypatch, shape):
    """The features such rounds owe the net are fed in the next round it drafts in, in one pass:
    the net then drafts from what feeding them round by round gives."""
    target, models, plain = setup
    spec = {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 4, "num_steps": 2,
            "prompt_lookup_max": 3, **shape}  # fmt: skip
    runs = []
    for eager in (False, True):
        llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
        wrapper, drafter, passes, drafted_from = llm.engine.drafter, llm.engine.drafter.inner, [0], []
        net_forward, propose, feed = drafter.net.forward, wrapper.propose, drafter._feed_pending

        def counted(*args, forward=net_forward, passes=passes, **kwargs):
            passes[0] += 1
            return forward(*args, **kwargs)

        def recorded(batch, feed=feed, seen=drafted_from):  # the logits and feature the net drafts from
            logits, out = feed(batch)
            seen.append(torch.cat([logits, out], dim=-1))
            return logits, out

        def round_(batch, n, drafter=drafter, propose=propose, feed=feed, eager=eager):
            draft = propose(batch, n)
            if eager and all(len(f) for f in drafter.pending.rows):  # nothing fed this round: feed now, as before
                feed(batch)
            return draft

        monkeypatch.setattr(drafter.net, "forward", counted)
        monkeypatch.setattr(drafter, "_feed_pending", recorded)
        monkeypatch.setattr(wrapper, "propose", round_)
        for prompts in ([PROMPTS[1]], PROMPTS):
            assert_greedy_matches_plain(llm, plain, prompts, 40, shape)
        runs.append((drafted_from, passes[0]))
    (deferred, deferred_passes), (fed, fed_passes) = runs
    assert len(deferred) == len(fed) > 0
    for a, b in zip(deferred, fed):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert deferred_passes < fed_passes, (deferred_passes, fed_passes)


@pytest.mark.parametrize("shape", [{}, TREE])
def test_a_row_that_may_draft_nothing_does_not_make_the_net_run(setup, monkeypatch, shape):
    """A request with its own γ of 0 beside one that copies: those rounds run no net pass."""
    target, models, plain = setup
    spec = {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 4, "num_steps": 1,
            "prompt_lookup_max": 3, **shape}  # fmt: skip
    engine = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu").engine
    wrapper, drafter, passes, netless = engine.drafter, engine.drafter.inner, [0], []
    net_forward, propose = drafter.net.forward, wrapper.propose

    def counted(*args, **kwargs):
        passes[0] += 1
        return net_forward(*args, **kwargs)

    def round_(batch, n):
        before = passes[0]
        draft = propose(batch, n)
        netless.append(len(batch) == 2 and passes[0] == before)
        return draft

    monkeypatch.setattr(drafter.net, "forward", counted)
    monkeypatch.setattr(wrapper, "propose", round_)
    params = greedy(24)
    engine.add_request("copy", PROMPTS[3], params)
    engine.add_request("none", PROMPTS[1], params, spec_override={"num_speculative_tokens": 0})
    out = {"copy": [], "none": []}
    while engine.has_unfinished():
        for e in engine.step():
            out[e.request_id] += e.new_token_ids
    want = plain.generate([PROMPTS[3], PROMPTS[1]], params)
    assert [out["copy"], out["none"]] == [o.token_ids for o in want]
    assert any(netless), netless


@pytest.mark.parametrize("steps", [2, 3])
def test_a_draft_model_beside_copies_drafts_from_the_committed_tokens(setup, monkeypatch, steps):
    """Its cache holds entries for the committed tokens only: in a round where some rows copy,
    those rows' cache takes their copy (what they may accept), not the model's scratch drafts.
    So the logits it drafts from each round are those of a pass over the committed tokens."""
    target, models, plain = setup
    spec = {"method": "draft_model", "model": models["draft_model"], "num_speculative_tokens": 4,
            "num_steps": steps, "prompt_lookup_max": 3}  # fmt: skip
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    wrapper, drafter, checked, proposing = llm.engine.drafter, llm.engine.drafter.inner, [], []
    feed, propose = drafter._feed, wrapper.propose

    def fed(rows, cache):
        logits = feed(rows, cache)
        if proposing:  # a round's first feed: every row's unseen committed tokens
            for b, seq in enumerate(proposing.pop().seqs):
                ids = torch.tensor(seq.token_ids)[None]
                ref = drafter.model(ids, torch.arange(ids.shape[1])[None], NoCache(1, ids.device))[0, -1]
                checked.append(torch.allclose(logits[b], ref, atol=1e-4, rtol=1e-4))
        return logits

    def round_(batch, n):
        proposing.append(batch)
        draft = propose(batch, n)
        unfed.append(bool(proposing))  # a round where every row copies feeds nothing
        proposing.clear()
        return draft

    unfed: list[bool] = []
    monkeypatch.setattr(drafter, "_feed", fed)
    monkeypatch.setattr(wrapper, "propose", round_)
    assert_greedy_matches_plain(llm, plain, PROMPTS, 40, steps)
    assert checked and all(checked), checked
    assert any(unfed) and not all(unfed), unfed  # rounds that copied ran no draft pass; the others did


def test_an_adaptive_budget_plans_lookup_rows_on_its_own_estimates(setup, monkeypatch, virtual_clock):
    """A lookup row has no draft probability to report: its confidences are NaN, which the
    budget replaces by its online estimates; greedy stays exact."""
    target, models, plain = setup
    spec = {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 4, "num_steps": 2,
            "prompt_lookup_max": 3, "verify_budget": "adaptive"}  # fmt: skip
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    acceptance, seen = llm.engine.budget.acceptance, []
    planned = acceptance.planned

    def spy(reqs, raw, evidence=None):
        seen.append(raw)
        return planned(reqs, raw, evidence)

    monkeypatch.setattr(acceptance, "planned", spy)
    proposals, propose = [], llm.engine.drafter.propose

    def keep(batch, n):
        proposals.append(propose(batch, n))
        return proposals[-1]

    monkeypatch.setattr(llm.engine.drafter, "propose", keep)
    assert_greedy_matches_plain(llm, plain, PROMPTS, 24, "adaptive")
    nan_rows = [d for d in proposals if d.confidence is not None and bool(d.confidence.isnan().all(dim=1).any())]
    assert nan_rows, "some round should have had a lookup row"
    assert seen and all(not math.isnan(c) for raw in seen for row in raw for c in row)


def test_an_adaptive_budget_asking_for_less_still_gets_the_copies_gamma_deep(setup, monkeypatch, virtual_clock):
    """The budget asks the drafter for the depth it planned before seeing the copies' evidence;
    a copy costs nothing at any depth, so lookup rows still propose up to γ and the budget
    plans again on them."""
    target, models, plain = setup
    spec = {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 4, "num_steps": 1,
            "prompt_lookup_max": 3, "verify_budget": "adaptive"}  # fmt: skip
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    # a learned drafter too dear to propose before planning (its measured cost decides that: fixed
    # here, so the test does not hang on the host's timing)
    monkeypatch.setattr(llm.engine.budget, "lookahead", lambda: 0)
    asked, propose = [], llm.engine.drafter.propose

    def keep(batch, n):
        draft = propose(batch, n)
        asked.append((n, int(draft.num_tokens.max())))
        return draft

    monkeypatch.setattr(llm.engine.drafter, "propose", keep)
    assert_greedy_matches_plain(llm, plain, PROMPTS, 24, "adaptive")
    assert any(n < 4 for n, _ in asked), asked  # the budget did ask for less than γ
    assert any(got > n for n, got in asked), asked


@pytest.mark.parametrize("method", ["eagle", "dflash", "medusa"])
def test_seeded_sampling_beside_copies_is_reproducible_whatever_else_runs(tmp_path, monkeypatch, method):
    """A copying row's share of a net pass run for its neighbours draws from scratch: its own
    stream advances by its own drafts only, so each seeded request samples the same tokens
    alone (where its copied rounds run no pass at all) as among the others. (On the sampled
    tests' target: the setup's tiny target is so peaked that a row's draws rarely matter.)"""
    target = sampling_target(tmp_path / "t")
    model = load_model(str(target), dtype=torch.float32, device="cpu")
    cls, config = SAMPLING_NETS[method]
    net = trained_folder(cls, model.model, tmp_path / "net", steps=20, draft_vocab=5, **config)
    spec = parse_spec({"method": method, "model": str(net), "num_speculative_tokens": 3, "num_steps": 2,
                             "prompt_lookup_max": 2})  # fmt: skip
    params = [SamplingParams(temperature=1.0, max_tokens=12 + i, seed=7 + i, ignore_eos=True) for i in range(4)]

    def run(rows: list[int]) -> tuple[dict[str, list[int]], dict[str, int]]:
        engine = ServingEngine(model, spec, max_model_len=96, max_num_seqs=4)
        seen = count_sources(engine.drafter, monkeypatch)
        for r in rows:
            engine.add_request(str(r), [t % SAMPLING_VOCAB for t in PROMPTS[r]], params[r])
        out: dict[str, list[int]] = {str(r): [] for r in rows}
        for _ in range(200):
            if not engine.has_unfinished():
                break
            for e in engine.step():
                out[e.request_id] += e.new_token_ids
        return out, seen

    alone = {k: v for r in range(4) for k, v in run([r])[0].items()}
    crowded, seen = run([0, 1, 2, 3])
    assert crowded == alone and all(len(alone[str(r)]) == 12 + r for r in range(4))
    assert seen["mixed"] > 0, seen  # rounds where some rows copied beside a net pass


@pytest.mark.parametrize("method", ["dflash", "medusa"])
def test_rounds_where_every_row_copies_run_no_block_or_heads(setup, monkeypatch, method):
    """dflash's block and medusa's heads draft from the target's features alone (handed over in
    on_verified whatever drafted), so a round where every row copies skips them outright."""
    target, models, plain = setup
    spec = {"method": method, "model": models[method], "num_speculative_tokens": 4, "num_steps": 2,
            "prompt_lookup_max": 3}  # fmt: skip
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    wrapper, drafter = llm.engine.drafter, llm.engine.drafter.inner
    module = sys.modules[type(wrapper).propose.__module__]
    count = {"copies only": 0, "model": 0, "passes": 0}
    look_up = module.look_up

    def spy(batch, lookup, num_tokens):
        found, matched = look_up(batch, lookup, num_tokens)
        count["copies only" if all(found) else "model"] += 1
        return found, matched

    monkeypatch.setattr(module, "look_up", spy)
    name = "block_logits" if method == "dflash" else "forward"
    run = getattr(drafter.net, name)

    def counted(*args, **kwargs):
        count["passes"] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(drafter.net, name, counted)
    assert_greedy_matches_plain(llm, plain, [PROMPTS[3]], 40, method)
    assert count["copies only"] > 0 and count["model"] > 0, count
    assert count["passes"] == count["model"], count


@pytest.mark.parametrize("method", ["eagle", "draft_model", "layer_skip", "dflash", "medusa"])
@pytest.mark.parametrize(
    "extra,message",
    [({"prompt_lookup_min": 2}, "need prompt_lookup_max"), ({"num_steps": 1}, "need prompt_lookup_max"),
     ({"prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min <= prompt_lookup_max"),
     ({"prompt_lookup_max": 0}, "prompt_lookup_max must be an integer >= 1"),
     ({"prompt_lookup_max": 3, "num_steps": 0}, "num_steps must be an integer >= 1"),
     ({"prompt_lookup_max": 3, "num_steps": "2"}, "num_steps must be an integer >= 1")],
)  # fmt: skip
def test_bad_options_get_one_line(method, extra, message):
    model = {"model": "some/draft"} if method == "draft_model" else {}
    with pytest.raises(SpecDecodeError, match=message) as e:
        parse_spec({"method": method, "num_speculative_tokens": 4, **model, **extra})
    assert "\n" not in str(e.value)


def test_a_static_tree_takes_no_num_steps():
    spec = {"method": "draft_model", "model": "some/draft", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "num_steps": 1, **STATIC}  # fmt: skip
    with pytest.raises(SpecDecodeError, match="static tree.* excludes topk, num_draft_tokens and num_steps"):
        parse_spec(spec)
    with pytest.raises(SpecDecodeError, match="static tree.* excludes num_steps"):
        parse_spec({**spec, "method": "medusa", "model": None})


@pytest.mark.parametrize("lookup", [{"prompt_lookup_max": 3}, {"datastore": True}])
def test_medusa_typical_acceptance_takes_no_lookup(lookup):
    with pytest.raises(SpecDecodeError, match='acceptance "typical" drafts the heads\' chain alone') as e:
        parse_spec({"method": "medusa", "num_speculative_tokens": 3, "acceptance": "typical", **lookup})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "method,extra,message",
    [("dflash", {"num_steps": 5}, r"block size of 4 .* num_steps is 5: set it to at most 4$"),
     ("dflash", {}, r"num_speculative_tokens is 6 .* at most 4 \(or num_steps, beside a lookup\)"),
     ("medusa", {"num_steps": 5}, r"num_steps 5 needs 5 heads, but .* has 4 heads$"),
     ("medusa", {}, r"num_speculative_tokens 6 needs 6 heads, .* set num_steps to at most 4")],
)  # fmt: skip
def test_a_net_too_short_for_its_steps_gets_one_line(setup, method, extra, message):
    target, models, _ = setup
    spec = {"method": method, "model": models[method], "num_speculative_tokens": 6, "prompt_lookup_max": 3, **extra}
    with pytest.raises(SpecDecodeError, match=message) as e:
        LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("method", ["eagle", "draft_model", "dflash", "medusa"])
def test_num_steps_past_gamma_gets_one_line(setup, method):
    target, models, _ = setup
    spec = {"method": method, "model": models[method], "num_speculative_tokens": 2, "num_steps": 3,
            "prompt_lookup_max": 3}  # fmt: skip
    with pytest.raises(SpecDecodeError, match=r"num_steps \(3\) must be at most num_speculative_tokens \(2\)"):
        LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")


@dataclass(frozen=True)
class RepeatOptions(LookupKeys):
    pass


class RepeatDrafter:
    """A new method in one class: drafts the newest token again, for the rows that do not copy."""

    Options = RepeatOptions
    default_num_speculative_tokens = 3
    hidden_layers = ()

    def __init__(self, spec, ctx):
        self.steps, self.device, self.asked = spec.options.steps(spec.num_speculative_tokens), ctx.device, []

    def max_draft_tokens(self, num_tokens):
        return num_tokens

    def prefill(self, batch, rows, hidden=None):
        pass

    def propose(self, batch, num_tokens, copies=None):
        self.asked.append(copies)
        depth = min(num_tokens, self.steps)
        rows = [[-1] * depth if copies and copies[b] else [s.token_ids[-1]] * depth for b, s in enumerate(batch.seqs)]
        return Draft(tokens=torch.tensor(rows, device=self.device))

    def on_verified(self, batch, num_accepted, aux_logits=None, hidden=None):
        pass

    def select_rows(self, rows):
        pass


def test_a_new_method_gets_lookup_from_the_registry_alone(setup, monkeypatch):
    """Options that take `LookupKeys` and a ``propose`` that reads ``copies`` are all a method
    needs: the registry wraps it, copying rows never reach it, and greedy stays exact."""
    target, _, plain = setup
    monkeypatch.setitem(registry._METHODS, "repeat", f"{__name__}:RepeatDrafter")
    llm = LLM(model=target, speculative_config={"method": "repeat", "prompt_lookup_max": 3, "num_steps": 1},
              dtype="float32", device="cpu")  # fmt: skip
    assert isinstance(llm.engine.drafter, LookupDrafter)
    inner = llm.engine.drafter.inner
    seen = count_sources(llm.engine.drafter, monkeypatch)
    batch = assert_greedy_matches_plain(llm, plain, PROMPTS, 40, "repeat")
    assert seen["lookup"] > 0 and seen["mixed"] > 0, seen
    assert any(c and any(c) for c in inner.asked) and any(c and not any(c) for c in inner.asked)
    assert any(len(o.metrics.accepted_per_position) > 1 and o.metrics.accepted_per_position[1] > 0 for o in batch)
    plain_method = LLM(model=target, speculative_config={"method": "repeat"}, dtype="float32", device="cpu")
    assert isinstance(plain_method.engine.drafter, RepeatDrafter)  # no lookup asked: no wrapper
