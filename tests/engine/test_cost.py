"""What a step costs (engine/cost.py): the verify-cost curve, interpolated and kept monotone,
refitted from the engine's own passes, and attention's cost measured at load."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdecode.drafters.registry import parse_spec
from specdecode.engine.adaptive import AdaptiveBudget
from specdecode.engine.cost import VerifyCost
from specdecode.model.masks import attention_queries
from tests.engine.test_adaptive import req, roofline


def test_cost_curve_is_monotone_and_refits_from_real_passes():
    """The line in P is refitted from the engine's passes once their attention (c measured at
    load) is taken out: a wrong split between the two would miss cost(100)."""
    noisy = VerifyCost([(1, 0.115), (2, 0.089), (4, 0.133), (8, 0.084), (16, 0.2)])
    assert [t for _, t in noisy.points] == [0.115, 0.115, 0.133, 0.133, 0.2]  # a dip cannot stop the planner
    line = VerifyCost.fit_line([(p, 0.05 + 0.002 * p) for p in (10, 20, 40, 80)])
    assert line(30) == pytest.approx(0.11) and line(160) == pytest.approx(0.37)
    assert VerifyCost.fit_line([(10, 1.0), (10, 2.0)]) is None  # one size: no slope to fit
    through_zero = VerifyCost.fit_line([(0, 0.1), (10, 0.2)])  # its grid started at 0 and never grew (a hang)
    assert through_zero(0) == pytest.approx(0.1) and through_zero(5) == pytest.approx(0.15)
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4, attention_cost=1e-5)  # c as measured at load
    g = torch.Generator().manual_seed(3)
    # passes of 2-8 rows with random drafts and contexts: t = 50 ms + 2 ms·P + 10 µs·queries·context
    for _ in range(32):
        rows, context = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(10, 200, (1,), generator=g))
        drafts = torch.randint(0, 5, (rows,), generator=g) * (_ % 3 != 0)  # a third of the passes draft nothing
        reqs = [req(f"x{i}", context if i == 0 else 5) for i in range(rows)]
        policy.budgets(reqs, drafts)  # planning reads the longest context
        P = rows + int(drafts.sum())
        Q = attention_queries(rows, int((drafts > 0).sum()), 1 + int(drafts.max())) * context
        overhead = 0.008 if int(drafts.sum()) else 0.0  # a pass carrying drafts pays 8 ms more
        policy.observe(reqs, torch.zeros(rows, dtype=torch.long), drafts, 0.05 + 0.002 * P + 1e-5 * Q + overhead, 0.0)
    assert policy.cost(100) == pytest.approx(0.25)  # now the engine's own passes price the linears
    assert policy.draft_overhead == pytest.approx(0.008)  # and the fixed cost of drafting at all


def test_one_odd_pass_does_not_set_the_slope_at_one_client():
    """At one client the passes that carry drafts nearly all have 2 positions: the fixed cost
    of drafting and the slope are not told apart, and a single 3-position pass must not set
    the slope alone (2 positions would then be priced well above what they measured)."""
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4)
    r = [req("a", 300)]
    times = [(0, 0.0156)] * 200 + [(1, 0.0204)] * 90 + [(2, 0.0270)]  # (draft tokens, seconds): P = 1, 2, 3
    for i in range(len(times)):
        drafts, seconds = times[(i * 7) % len(times)]  # interleaved, as they come
        policy.observe(r, torch.zeros(1, dtype=torch.long), torch.tensor([drafts]), seconds, 0.0)
    assert policy.pass_time(1, 1, 0, 0, 0.0) == pytest.approx(0.0156, abs=2e-4)
    assert policy.pass_time(1, 2, 1, 1, 0.0) == pytest.approx(0.0204, abs=5e-4)  # as measured
    # with drafting passes of several sizes, the fixed cost of drafting is fitted apart again
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4)
    for i in range(160):
        drafts = 0 if i % 8 < 5 else 1 + i % 3  # t = 11.6 ms + 4 ms·P + 3 ms if drafts
        seconds = 0.0156 + 0.004 * drafts + 0.003 * (drafts > 0)
        policy.observe(r, torch.zeros(1, dtype=torch.long), torch.tensor([drafts]), seconds, 0.0)
    assert policy.draft_overhead == pytest.approx(0.003) and policy.cost(3) == pytest.approx(0.0236)


def test_the_engine_prices_attention_with_the_cost_measured_at_load(monkeypatch, tmp_path):
    """The adaptive policy's attention cost comes from `measure_attention_cost` at load (a fit
    from the engine's own passes could not tell it from the linears' cost)."""
    from specdecode.engine import serving
    from specdecode.model.loader import load_model
    from tests.tiny import make_tiny_checkpoint

    target = load_model(str(make_tiny_checkpoint(tmp_path, "llama", seed=0)), dtype="float32", device="cpu",
                        progress=False)  # fmt: skip
    monkeypatch.setattr(serving, "measure_attention_cost", lambda engine: 3.5e-7)
    spec = parse_spec({"method": "ngram", "num_speculative_tokens": 4, "verify_budget": "adaptive"})
    engine = serving.ServingEngine(target, spec, max_model_len=64)
    assert isinstance(engine.budget, AdaptiveBudget) and engine.budget.attention_cost == 3.5e-7


def test_a_full_window_of_passes_is_refitted_now_and_then_not_on_every_pass():
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4, window=64)
    for i in range(64 + 16):  # the window fills, then holds 64 passes
        policy._observe_cost(4, [i % 3, 0, 0, 0], 0.01 + 0.001 * (i % 3) + 0.0001 * (i % 7))
    fitted = policy.cost
    for i in range(15):
        policy._observe_cost(4, [i % 3, 0, 0, 0], 0.01 + 0.001 * (i % 3))
        assert policy.cost is fitted  # refitted once 16 new passes are in
    policy._observe_cost(4, [0, 0, 0, 0], 0.01)
    assert policy.cost is not fitted


def test_a_pass_cost_that_bends_is_priced_by_its_local_slope():
    """Positions cost less in a bigger pass: passes at every load, t = 4 ms + 2 ms·P − 0.01 ms·P²
    (1.04 ms a position at P = 48, where a line through all of them says ~1.4), refitted from
    the window: a draft at 48 positions is priced as the curve, not the line."""
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4)
    g = torch.Generator().manual_seed(0)
    for i in range(400):
        rows = [1, 4, 16, 32][i % 4]
        drafts = torch.randint(0, 3, (rows,), generator=g) * (i % 3 != 0)
        P = rows + int(drafts.sum())
        policy.observe([req(f"x{j}") for j in range(rows)], torch.zeros(rows, dtype=torch.long), drafts,
                       0.004 + 0.002 * P - 0.00001 * P * P, 0.0)  # fmt: skip
    assert policy.cost(49) - policy.cost(48) == pytest.approx(0.00104, rel=0.05)
    assert policy.cost(2) - policy.cost(1) == pytest.approx(0.00197, rel=0.05)


def test_verify_cost_interpolates_and_extrapolates():
    cost = VerifyCost([(1, 2.0), (5, 2.0), (9, 4.0)])
    assert cost(1) == cost(3) == 2.0
    assert cost(7) == pytest.approx(3.0)
    assert cost(13) == pytest.approx(6.0)
    # a refitted curve's grid ends close to its last size: past it, the line's own slope
    line = VerifyCost.fit_line([(3, 1.3), (7, 1.7)] * 4)  # t = 1 + 0.1 P exactly
    assert line(20) == pytest.approx(3.0) and line(15.5) == pytest.approx(2.55)


@pytest.mark.parametrize(
    "points",
    [
        [(3, 0.5)],
        [(1, 2.0), (5, 2.0), (9, 4.0)],
        [(0.5, 0.1), (1.75, 0.2), (40.25, 0.9)],
        [(2, 0.1), (7, 0.3), (7, 0.4)],
    ],
)
def test_verify_cost_table_is_the_curve_at_every_whole_size(points):
    # the table is built in one go; it must hold what interpolating each size alone gives,
    # before the first point, between points, at repeated sizes and past the last
    cost = VerifyCost(points)
    assert cost._table == pytest.approx([_reference(cost.points, p) for p in range(len(cost._table))], abs=1e-12)
    assert cost(2000.5) == pytest.approx(_reference(cost.points, 2000.5))  # past the table


def _reference(pts: list[tuple[float, float]], x: float) -> float:
    """The curve at one size, the plain way: flat before the first point, linear between
    points, the last segment's slope past the last."""
    if x <= pts[0][0] or len(pts) == 1:
        return pts[0][1]
    for (p0, t0), (p1, t1) in itertools.pairwise(pts):
        if x <= p1:
            return t0 + (t1 - t0) * (x - p0) / (p1 - p0)
    return t1 + (t1 - t0) / (p1 - p0) * (x - p1)


def test_clock_waits_for_cuda_work(monkeypatch):
    """The budget's timers (prefill, draft, verify, planning) read `clock`: on CUDA it first waits
    for the queued work, else a timer stops before the pass it times."""
    import torch

    from specdecode.engine.cost import clock

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    clock(torch.device("cpu"))
    assert waited == []
    clock(torch.device("cuda", 0))
    assert waited == [torch.device("cuda", 0)]
    clock(torch.device("cuda", 0), wait=False)  # a fixed budget reads no times: no sync
    assert len(waited) == 1
