"""Continuous batching over the paged cache: requests that join, leave, get preempted or
cancelled decode exactly as they would alone, and no KV block leaks."""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.drafters.registry import parse_spec
from specdecode.config import SpecDecodeError
from specdecode.drafters.draft_cache import DraftKVCache
from specdecode.engine.serving import ServingEngine
from specdecode.model.loader import load_model
from tests.tiny import make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2], [4, 4, 4, 4], [9, 8, 7, 6, 5, 4, 3]]
MAX_TOKENS = [20, 7, 33, 25, 12, 18]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    return {
        "target": str(make_tiny_checkpoint(root / "target", "llama", seed=0)),
        "draft": str(make_tiny_checkpoint(root / "draft", "llama", seed=1)),
    }


@pytest.fixture(scope="module")
def plain(ckpts):
    return LLM(model=ckpts["target"], dtype="float32", device="cpu", speculative_config=None)


@pytest.fixture(scope="module")
def reference(plain):
    """Each prompt's plain greedy output, decoded alone."""
    return [
        plain.generate([p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].token_ids
        for p, n in zip(PROMPTS, MAX_TOKENS)
    ]


SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                   "max_matches": 3, "num_draft_tokens": 8},
    "draft_model": {"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 3},
    "draft_model_tree": {"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 3, "topk": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "lookahead": {"method": "lookahead", "num_speculative_tokens": 3, "lookahead_window": 3, "lookahead_ngram": 3,
                  "lookahead_guess": 3},
    "ngram_adaptive": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                       "verify_budget": "adaptive"},
    # γ up to 8, each step's depth chosen from the measured verify cost; proposing stops there too
    "draft_model_auto": {"method": "draft_model", "model": "{draft}", "num_speculative_tokens": "auto"},
}


def make_engine(plain: LLM, ckpts, name: str, **kw) -> ServingEngine:
    spec = SPECS[name]
    if spec is not None:
        spec = {k: (v.format(**ckpts) if isinstance(v, str) else v) for k, v in spec.items()}
    return ServingEngine(plain.target, parse_spec(spec), max_model_len=64, **kw)


def draft_blocks_used(engine: ServingEngine) -> int:
    """Blocks still held in the drafter's own paged cache (0 for drafters without one)."""
    cache = getattr(engine.drafter, "cache", None)
    return cache.pool.num_used if isinstance(cache, DraftKVCache) else 0


def run_staggered(engine: ServingEngine, params: list[SamplingParams], join_every: int = 2) -> dict[str, list[int]]:
    """Requests join one at a time every ``join_every`` steps while others decode."""
    out: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % join_every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params[i])
            out[f"r{i}"] = []
        if engine.has_unfinished():
            for e in engine.step():
                out[e.request_id] += e.new_token_ids
        steps += 1
        assert steps < 500
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_joining_and_leaving_requests_decode_as_alone(plain, ckpts, reference, name, virtual_clock):
    engine = make_engine(plain, ckpts, name, max_num_seqs=4, block_size=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    out = run_staggered(engine, params)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert engine.stats().kv_blocks_used == 0
    assert draft_blocks_used(engine) == 0  # the draft's blocks came back too
    assert not engine.has_unfinished()


@pytest.mark.parametrize("name", ["plain", "ngram", "draft_model_tree"])
def test_preemption_recomputes_and_stays_exact(plain, ckpts, reference, name, virtual_clock):
    # the smallest pool that holds one full sequence: several requests must take turns
    engine = make_engine(plain, ckpts, name, max_num_seqs=6, block_size=4, num_blocks=20)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    out = run_staggered(engine, params, join_every=1)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert engine.stats().num_preempted_total > 0
    assert engine.stats().kv_blocks_used == 0
    assert draft_blocks_used(engine) == 0


def test_abort_frees_blocks_and_spares_the_others(plain, ckpts, reference):
    engine = make_engine(plain, ckpts, "ngram", max_num_seqs=4, block_size=4)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    for i in (0, 1, 2):  # r1 long enough to be running when cancelled (it loops: ngram drafts it fast)
        engine.add_request(f"r{i}", PROMPTS[i], greedy[i] if i != 1 else SamplingParams(temperature=0.0, max_tokens=40))
    out = {f"r{i}": [] for i in (0, 1, 2)}
    for _ in range(3):
        for e in engine.step():
            out[e.request_id] += e.new_token_ids
    assert "r1" in engine.running
    used = engine.stats().kv_blocks_used
    engine.abort("r1")
    engine.abort("r1")  # a second cancel is harmless
    engine.abort("nobody")
    assert engine.stats().kv_blocks_used < used
    while engine.has_unfinished():
        for e in engine.step():
            out[e.request_id] += e.new_token_ids
    assert out["r0"] == reference[0] and out["r2"] == reference[2]
    assert engine.stats().kv_blocks_used == 0
    engine.add_request("q", PROMPTS[3], greedy[3])  # cancelling a waiting request, too
    engine.abort("q")
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize(
    "name, prompt, override",
    [
        ("ngram", 3, None),
        ("ngram", 5, None),  # x finds shorter chains than the repetitive rows: its draws stay its own
        ("draft_model", 3, None),
        ("draft_model", 0, {"num_speculative_tokens": 1}),  # the others draft 3 deep
    ],
)
def test_seeded_sampling_is_reproducible_whatever_else_runs(plain, ckpts, name, prompt, override):
    sampled = SamplingParams(temperature=1.0, max_tokens=15, seed=7, ignore_eos=True)
    alone = make_engine(plain, ckpts, name)
    alone.add_request("x", PROMPTS[prompt], sampled, spec_override=override)
    want = [t for _ in range(100) if alone.has_unfinished() for e in alone.step() for t in e.new_token_ids]
    crowded = make_engine(plain, ckpts, name, max_num_seqs=3)
    others = [SamplingParams(temperature=0.9, max_tokens=9, seed=s, ignore_eos=True) for s in range(4)]
    for i, sp in enumerate(others):
        crowded.add_request(f"o{i}", PROMPTS[[3, 4, 0, 1][i]], sp)
    crowded.step()
    crowded.add_request("x", PROMPTS[prompt], sampled, spec_override=override)
    got = [t for _ in range(200) if crowded.has_unfinished() for e in crowded.step() if e.request_id == "x"
           for t in e.new_token_ids]
    assert got == want and len(want) == 15


def test_a_seeded_tree_row_cut_by_its_own_gamma_samples_as_alone(tmp_path):
    """Next to a row drafting 3 deep, a row whose own γ is 1 gets its tree cut out of a 3-deep
    proposal, with gaps in its node numbering ([11, 48, -, -, 53, -, -] where alone it is
    [11, 48, 53]); it must draw the same numbers and so sample the same tokens."""
    target = load_model(str(make_tiny_checkpoint(tmp_path / "t", "llama", 2, tie_word_embeddings=False)),
                        dtype="float32", device="cpu")  # fmt: skip
    spec = parse_spec({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                             "prompt_lookup_max": 1, "max_matches": 2, "num_draft_tokens": 9})  # fmt: skip
    sampled = SamplingParams(temperature=1.0, max_tokens=60, seed=504607, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    def run(crowded: bool) -> list[int]:
        engine = ServingEngine(target, spec, max_model_len=96, max_num_seqs=4)
        engine.add_request("s", [59, 98, 114], sampled, spec_override={"num_speculative_tokens": 1})
        if crowded:
            engine.add_request("g", [52, 57, 73, 57, 82, 57, 124, 50], greedy)
        return [t for _ in range(200) if engine.has_unfinished() for e in engine.step() if e.request_id == "s"
                for t in e.new_token_ids]  # fmt: skip

    alone = run(False)
    assert run(True) == alone and len(alone) == 60


@pytest.mark.parametrize("name", ["draft_model_tree", "eagle_tree"])
def test_a_seeded_row_in_a_grown_tree_samples_as_alone_beside_a_deeper_row(plain, ckpts, tmp_path, name):
    """A draft model's or eagle's tree is grown to the batch's depth and then cut to a row's own
    γ: its best nodes had been ranked among deeper ones, so the cut tree was not the one grown
    alone at that depth, and a seeded row sampled other tokens next to a deeper row."""
    if name == "eagle_tree":
        from specdecode.drafters.eagle_net import FeatureNet
        from tests.learned import trained_folder

        net = trained_folder(FeatureNet, plain.target.model, tmp_path / "e", steps=5, draft_vocab=0)
        spec = {"method": "eagle", "model": str(net), "num_speculative_tokens": 3, "topk": 2}
    else:
        spec = {**SPECS[name], "model": ckpts["draft"]}
    x = ("x", [40, 41, 42, 43], SamplingParams(temperature=1.5, max_tokens=20, seed=1, ignore_eos=True))

    def run(beside: bool) -> list[int]:
        engine = ServingEngine(plain.target, parse_spec(spec), max_model_len=64)
        engine.add_request(*x, spec_override={"num_speculative_tokens": 2})
        if beside:
            engine.add_request("o", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        return [t for _ in range(100) if engine.has_unfinished() for e in engine.step() if e.request_id == "x"
                for t in e.new_token_ids]  # fmt: skip

    alone = run(False)
    assert run(True) == alone and len(alone) == 20


def test_bad_requests_are_refused_and_change_nothing(plain, ckpts):
    engine = make_engine(plain, ckpts, "ngram")
    ok = SamplingParams(max_tokens=4)
    engine.add_request("a", [1, 2], ok)
    cases = [
        (("a", [1, 2], ok), "already in use"),
        (("b", [], ok), "prompt is empty"),
        (("b", [1] * 64, ok), "context is 64"),
        (("b", [1] * 60, SamplingParams(max_tokens=10)), "beyond the context"),
        (("b", [10**6], ok), "token ids"),
    ]
    for args, match in cases:
        with pytest.raises(SpecDecodeError, match=match):
            engine.add_request(*args)
    for override in ({"num_speculative_tokens": -1}, {"num_speculative_tokens": 9}, {"method": "suffix"}):
        with pytest.raises(SpecDecodeError, match="override"):
            engine.add_request("b", [1, 2], ok, spec_override=override)
    assert engine.stats().num_waiting == 1


def test_override_to_zero_drafts_nothing_for_that_request(plain, ckpts, reference):
    engine = make_engine(plain, ckpts, "ngram")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[3], ignore_eos=True)
    engine.add_request("off", PROMPTS[3], params, spec_override={"num_speculative_tokens": 0})
    engine.add_request("on", PROMPTS[3], params)
    last = {}
    out = {"off": [], "on": []}
    while engine.has_unfinished():
        for e in engine.step():
            out[e.request_id] += e.new_token_ids
            last[e.request_id] = e.stats
    assert out["off"] == out["on"] == reference[3]
    assert last["off"].num_draft_tokens == 0 and last["on"].num_accepted_tokens > 0


def test_pool_too_small_for_one_sequence_is_refused(plain, ckpts):
    with pytest.raises(SpecDecodeError, match="cannot hold one sequence"):
        make_engine(plain, ckpts, "plain", block_size=4, num_blocks=3)


def test_chunked_prefill_matches_one_pass(plain, ckpts):
    long_prompt = [int(t) for t in torch.randint(1, 30, (40,), generator=torch.Generator().manual_seed(0))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = plain.generate([long_prompt], params)[0].token_ids
    engine = make_engine(plain, ckpts, "ngram", max_num_batched_tokens=7, block_size=4)
    engine.add_request("long", long_prompt, params)
    got = [t for _ in range(100) if engine.has_unfinished() for e in engine.step() for t in e.new_token_ids]
    assert got == want


def test_a_chunk_runs_as_passes_of_at_most_prefill_pass_tokens(plain, ckpts):
    long_prompt = [int(t) for t in torch.randint(1, 30, (40,), generator=torch.Generator().manual_seed(0))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = plain.generate([long_prompt], params)[0].token_ids
    engine = make_engine(plain, ckpts, "ngram", max_num_batched_tokens=16, block_size=4)
    assert engine.prefill_pass == 16  # a chunk of at most 64 positions is one pass
    engine.prefill_pass = 3  # as the fused block's 64 would split a longer chunk
    widths, target = [], engine._target
    engine._target = lambda tokens, *a, **kw: widths.append(tokens.shape[1]) or target(tokens, *a, **kw)
    engine.add_request("long", long_prompt, params)
    got = [t for _ in range(100) if engine.has_unfinished() for e in engine.step() for t in e.new_token_ids]
    assert got == want
    assert widths[:14] == [3, 3, 3, 3, 3, 1] * 2 + [3, 3]  # 16-token chunks, 3 at a time; the rest decodes
    assert engine.cache.pool.num_used == 0


@pytest.mark.parametrize("name", ["ngram_adaptive", "ngram_tree"])
def test_shadow_proposals_teach_the_budget_and_change_no_token(plain, ckpts, reference, name, monkeypatch, virtual_clock):
    """Under a cost where no draft ever pays, the adaptive budget verifies nothing, yet steps
    still propose for its shadow rounds: the output stays plain greedy, chains settle shadow
    rounds, and a tree drafter (no shadows possible) stops being asked after its first tree."""
    from specdecode.engine import probes
    from specdecode.engine.adaptive import AdaptiveBudget
    from specdecode.engine.cost import VerifyCost

    monkeypatch.setattr(probes, "PROBE_EVERY", 10**9)  # no probes: every recorded round is a shadow

    spec = dict(SPECS[name], verify_budget="adaptive")
    engine = ServingEngine(plain.target, parse_spec(spec), max_model_len=64, max_num_seqs=4, block_size=4)
    assert isinstance(engine.budget, AdaptiveBudget)
    engine.budget.cost = VerifyCost([(1, 1.0), (2, 2.0)])  # a position costs as much as a whole step
    engine.budget._observe_cost = lambda *args: None  # and stays so (no refit from the tiny model's passes)
    engine.budget.propose_first = lambda: True  # propose on every step (the share is tested in test_adaptive.py)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    out = run_staggered(engine, params)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert engine.stats().kv_blocks_used == 0
    if name == "ngram_tree":
        assert not engine._shadows and not engine.budget.acceptance.records
    else:
        assert engine._shadows and len(engine.budget.acceptance.records) > 5  # shadow rounds: nothing was verified


def test_the_adaptive_budget_learns_how_much_prefill_a_step_carries(plain):
    """Each step tells the budget how long its prefill chunk took (0 with no prompt in flight):
    the running mean rises while prompts join and decays once they are all in."""
    spec = parse_spec(SPECS["ngram_adaptive"])
    engine = ServingEngine(plain.target, spec, max_model_len=64, max_num_seqs=4, block_size=4)
    engine.add_request("r0", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()
    after_prompt = engine.budget.prefill_seconds
    assert after_prompt > 0
    seen = []
    observe = engine.budget.observe_prefill
    engine.budget.observe_prefill = lambda seconds: (seen.append(seconds), observe(seconds))
    while engine.has_unfinished():
        engine.step()
    assert 0 < engine.budget.prefill_seconds < after_prompt
    assert seen and set(seen) == {0.0}  # exactly 0: a timed no-op added the OS's pauses to the mean


def test_a_reused_request_id_starts_with_nothing_learned(plain):
    """Ids may be reused once a request has ended: an aborted request's counts, state and
    shadow round in the adaptive budget must not plan (or be settled against) a new one."""
    spec = parse_spec({**SPECS["ngram_adaptive"], "prompt_lookup_min": 1})
    engine = ServingEngine(plain.target, spec, max_model_len=64, max_num_seqs=4, block_size=4)
    engine.add_request("a", [2, 3] * 5, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while "a" not in engine.budget.acceptance.per_request:
        engine.step()
    engine.abort("a")  # mid-way, with something learned
    engine.add_request("a", [9, 8, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert "a" not in engine.budget.acceptance.per_request and "a" not in engine.budget.probes.last


@pytest.mark.parametrize("name", ["draft_model", "ngram"])
def test_reset_after_a_step_that_failed_midway_leaves_a_clean_engine(plain, ckpts, reference, name):
    """A drafter that raised while the last running row left the batch: the engine had dropped
    the row, the batch kept it, no request's abort could reach it, and every later step failed
    (2 draft blocks leaked). `reset` (what the server and the LLM do after a failed step) drops
    every row and block."""
    engine = make_engine(plain, ckpts, name)
    real, calls = engine.drafter.select_rows, [0]

    def flaky(rows):
        calls[0] += 1
        if calls[0] == 2:  # the second removal: the last running row leaves
            raise RuntimeError("drafter hiccup")
        return real(rows)

    engine.drafter.select_rows = flaky
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    with pytest.raises(RuntimeError, match="hiccup"):
        while engine.has_unfinished():
            engine.step()
    engine.reset()
    assert not engine.has_unfinished() and len(engine.batch) == 0
    assert engine.stats().kv_blocks_used == 0 and draft_blocks_used(engine) == 0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[2], ignore_eos=True)
    engine.add_request("c", PROMPTS[2], params)
    out = []
    while engine.has_unfinished():
        out += [t for e in engine.step() for t in e.new_token_ids]
    assert out == reference[2]


def test_a_short_prompt_is_not_held_behind_a_long_ones_prefill(plain):
    """Fair chunked prefill, counted in steps: a 4-token request that arrives while a 200-token
    prompt prefills in chunks of 16 gets its first token within two steps, long before the long
    prompt's prefill ends; both decode exactly as alone. Two long prompts at once take turns
    (max_long_prefills 1): the one with fewer tokens left goes first, whole."""
    long_prompt = [(7 * i) % 90 + 3 for i in range(200)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = {p: plain.generate([list(p)], params)[0].token_ids for p in (tuple(long_prompt), (5, 9, 3, 4))}
    engine = ServingEngine(plain.target, None, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16)
    engine.add_request("long", long_prompt, params)
    out: dict[str, list[int]] = {"long": [], "short": []}
    first_at, step = {}, 0
    while engine.has_unfinished():
        step += 1
        if step == 3:
            engine.add_request("short", [5, 9, 3, 4], params)
        for e in engine.step():
            out[e.request_id] += e.new_token_ids
            first_at.setdefault(e.request_id, step)
    assert first_at["short"] <= 4 and first_at["long"] >= 200 // 16
    assert out["long"] == want[tuple(long_prompt)] and out["short"] == want[(5, 9, 3, 4)]
    assert engine.cache.pool.num_used == 0

    engine = ServingEngine(plain.target, None, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16)
    engine.add_request("a", long_prompt, params)
    engine.add_request("b", long_prompt[:100], params)
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for e in engine.step():
            if e.new_token_ids:
                first.setdefault(e.request_id, step)
    assert first["b"] <= 100 // 16 + 1 < first["a"]  # b (fewer left) prefilled first, before a took its turn


def test_max_long_prefills_is_checked(plain):
    with pytest.raises(SpecDecodeError, match="max_long_prefills"):
        ServingEngine(plain.target, None, max_model_len=64, max_long_prefills=0)
