"""The adaptive budget's probes (engine/probes.py) and shadow rounds (engine/adaptive.py): a budget that stopped
drafting tries again ever more rarely, shadow proposals teach it at a bounded share of the time,
and steps propose first while planning on proposals pays. (Its budgets: test_adaptive.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdecode.drafters.base import Draft
from specdecode.engine.acceptance import STATES, _RequestRounds
from specdecode.engine.adaptive import AdaptiveBudget
from specdecode.engine.cost import VerifyCost
from specdecode.engine.probes import PROBE_EVERY, PROBE_MAX, PROBE_SHARE
from specdecode.core.tree import TreeBatch
from tests.engine.test_adaptive import req, roofline


def test_a_budget_that_stopped_drafting_probes_again():
    """Estimates move only when drafts are tried: after PROBE_EVERY steps without any, one step
    verifies a token per row, and acceptances there bring the budget back (here after the
    second probe, which came twice as late as the first). Passes cost what the curve says."""
    policy = AdaptiveBudget(roofline(knee=1, slope=0.5), max_gamma=4)
    unlucky = req("unlucky")
    for _ in range(10):  # early rejections
        policy.observe([unlucky], torch.tensor([0]), torch.tensor([2]), 2.0, 0.0)
    seen = []
    for _ in range(4 * PROBE_EVERY):
        b = policy.budgets([unlucky], torch.tensor([4]))
        seen.append(int(b[0]))
        policy.observe([unlucky], b, b, 1.0 + 0.5 * int(b[0]), 0.0)  # every probed token is accepted
    second = 2 * PROBE_EVERY + PROBE_EVERY + 1
    assert seen[:PROBE_EVERY] == [0] * PROBE_EVERY and seen[PROBE_EVERY] == 1  # the probe
    assert seen[PROBE_EVERY + 1 : second] == [0] * (second - PROBE_EVERY - 1) and seen[second] == 1  # the next
    assert min(seen[second + 2 :]) >= 2  # accepted probes revived drafting


def test_probes_that_find_nothing_come_ever_more_rarely_and_never_stop():
    """Each probe after which no plan drafts doubles the wait for the next (up to PROBE_MAX
    steps): under load, where no draft pays, they cost less and less, but keep coming. A plan
    that drafts brings the wait back to PROBE_EVERY."""
    policy = AdaptiveBudget(roofline(knee=1, slope=0.5), max_gamma=4)
    r = req("r")
    probes = []
    for step in range(1200):
        b = policy.budgets([r], torch.tensor([4]))
        if int(b[0]):
            probes.append(step)
        policy.observe([r], torch.zeros(1, dtype=torch.long), b, 1.0 + 0.5 * int(b[0]), 0.0)  # each rejected
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    want = [PROBE_EVERY + 1] + [min(PROBE_EVERY * 2**k, PROBE_MAX) + 1 for k in range(1, len(gaps))]
    assert gaps == want and gaps[-1] == PROBE_MAX + 1 and len(gaps) > 8
    policy.probes.probed = False  # a plan that drafted, not a probe
    policy.observe([r], torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0, 0.0)
    assert policy.probes.every == PROBE_EVERY


def test_shadow_rounds_do_not_hold_off_probes_when_a_cost_curve_prices_drafts_out():
    """A verify-cost curve measured in a noisy moment (here t(2) = 2 t(1): no draft can pay)
    is corrected only by passes that carry drafts; shadow rounds that keep teaching acceptance
    must not hold off the probe, whose pass refits the curve (32+ passes of two sizes)."""
    policy = AdaptiveBudget(VerifyCost([(1, 1.0), (2, 2.0), (9, 9.0)]), max_gamma=4)
    r = req("r", length=4)
    seen = []
    for step in range(4 * PROBE_EVERY):
        b = policy.budgets([r], torch.tensor([4]))
        seen.append(int(b[0]))
        n = int(b[0])
        r.seq.token_ids += [7] * (n + 1)  # every draft is a 7 and is accepted
        policy.observe([r], b, b, 1.0 + 0.1 * n, 0.0, 4, torch.tensor([[7, 7, 7, 7]]))  # a pass of P costs 1 + 0.1 (P - 1)
    assert seen[:PROBE_EVERY] == [0] * PROBE_EVERY and seen[PROBE_EVERY] == 1  # shadows taught, yet the probe came
    assert policy.cost(2) < 1.5  # the curve was refitted from the passes
    assert sum(seen[-PROBE_EVERY:]) > PROBE_EVERY  # and drafting pays now


def test_a_probe_in_a_busy_batch_drafts_on_the_likeliest_rows():
    """A probe token on every one of 32 rows would double a compute-bound pass; it goes to one
    row in PROBE_SHARE (a share that still shows what a pass past the rows costs), those whose
    first token is likeliest to survive."""
    policy = AdaptiveBudget(roofline(knee=1, slope=0.5), max_gamma=4)
    reqs = [req(f"r{i}") for i in range(32)]
    for i, r in enumerate(reqs):  # row i accepted i of 31 first tokens: all too unlikely to draft
        policy.acceptance.per_request[r.request_id] = _RequestRounds([[31.0, 0, 0, 0], [0.0] * 4], [[0.3 * i / 31, 0, 0, 0], [0.0] * 4])
    policy.probes.steps_without_drafts = PROBE_EVERY
    probe = policy.budgets(reqs, torch.full((32,), 4))
    assert 1 < PROBE_SHARE < 32 and probe.tolist() == [0] * (32 - 32 // PROBE_SHARE) + [1] * (32 // PROBE_SHARE)


def test_successive_probes_reach_every_row_within_max_verify_tokens():
    """Probed tokens that are accepted make their rows likelier; the next probes still go to the
    rows probed longest ago, and no probe verifies more positions than max_verify_tokens."""
    policy = AdaptiveBudget(roofline(knee=1, slope=1.0), max_gamma=4)
    policy._observe_cost = lambda *a: None  # keep the compute-bound curve: no drafts pay
    reqs = [req(f"r{i}") for i in range(8)]
    drafted = torch.zeros(8, dtype=torch.long)
    for _ in range(1000):  # planned, proposed, planned again on the proposal: as the engine does
        planned = policy.budgets(reqs, torch.full((8,), 4))
        b = policy.budgets(reqs, torch.full((8,), 4), Draft(torch.full((8, 4), 5)))
        assert torch.equal(b, planned)  # the probe's rows are the ones it proposed for
        drafted += b
        policy.observe(reqs, b, b, 1.0, 0.0)  # every probed token accepted
    assert int(drafted.min()) >= 2 and int(drafted.max()) - int(drafted.min()) <= 1, drafted
    for limit, most in ((10, 2), (8, 0), (4, 0)):
        capped = AdaptiveBudget(roofline(knee=1, slope=1.0), max_gamma=4, max_verify_tokens=limit)
        capped.probes.steps_without_drafts = PROBE_EVERY
        assert int(capped.budgets(reqs, torch.full((8,), 4)).sum()) == most


def test_a_drafters_confidence_replaces_the_online_estimate():
    """Under a cost where each position must pay for itself, a head that is sure of its first
    two tokens gets them verified, and one that is not gets nothing; the online estimate (no
    rounds seen yet) sits in between."""
    policy = AdaptiveBudget(roofline(knee=1, slope=0.5), max_gamma=4)
    r = [req("r")]
    proposal = torch.tensor([[5, 6, 7, 8]])
    likely = torch.tensor([[0.99, 0.99, 0.05, 0.05]])
    sure = policy.budgets(r, torch.tensor([4]), Draft(proposal, confidence=likely))
    unsure = policy.budgets(r, torch.tensor([4]), Draft(proposal, confidence=torch.tensor([[0.05] * 4])))
    assert sure.tolist() == [2] and unsure.tolist() == [0]


def test_the_fixed_cost_of_drafting_is_paid_by_all_the_positions_together():
    """Carrying any draft costs a pass δ more. One position's 0.9 tokens cannot pay a δ of 10%
    of a 32-row step, but 32 such positions (below the threshold, where they are free) can."""
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4)
    policy.acceptance.reached, policy.acceptance.accepted = torch.full((STATES, 4), 100.0), torch.full((STATES, 4), 90.0)  # every token survives 90%
    policy.draft_overhead = 0.1  # seconds; a step without drafts takes 1 s
    reqs = [req(f"r{i}") for i in range(32)]
    assert policy.budgets(reqs, torch.full((32,), 4)).sum() >= 32
    policy.draft_overhead = 100.0  # far more than any gain: no drafts
    assert policy.budgets(reqs, torch.full((32,), 4)).sum() == 0


def test_drafts_must_beat_no_drafts_by_a_margin():
    """A plan with drafts is taken only if its predicted tokens per second beat the plan
    without any by MIN_GAIN: here one row, free verification, and a fixed drafting cost δ
    tuned so that the gain is just below, then just above, the margin."""
    from specdecode.engine.adaptive import MIN_GAIN

    policy = AdaptiveBudget(VerifyCost([(1, 1.0), (50, 1.0)]), max_gamma=1)  # verification free
    policy.acceptance.reached, policy.acceptance.accepted = torch.full((2, 1), 100.0), torch.full((2, 1), 50.0)
    s = float(policy.acceptance.sts(torch.tensor([[0.5]]))[0, 0])  # the calibrated survival the planner sees
    for gain, drafts in ((MIN_GAIN * 0.8, 0), (MIN_GAIN * 1.2, 1)):
        policy.draft_overhead = (1 + s) / (1 + gain) - 1.0  # rate with the draft = (1 + gain) x without
        assert policy.budgets([req("r")], torch.tensor([1])).tolist() == [drafts]


def test_shadow_chains_skip_rows_where_matching_is_not_acceptance():
    """A sampled row's draft with a non-one-hot q is accepted with min(1, p/q), not with the
    chance that the target generates it: its shadow row is dropped. Greedy rows and one-hot
    proposals keep theirs; trees give none."""
    from specdecode.engine.acceptance import NOT_SHADOWED
    from specdecode.engine.budget import shadow_chains

    batch = SimpleNamespace(temperature=torch.tensor([0.0, 0.7]))
    tokens = torch.tensor([[1, 2], [3, 4]])
    one_hot = shadow_chains(Draft(tokens=tokens), batch)
    sampled = shadow_chains(Draft(tokens=tokens, q=torch.full((2, 2, 5), 0.2)), batch)
    assert one_hot.tolist() == [[1, 2], [3, 4]] and sampled.tolist() == [[1, 2], [NOT_SHADOWED] * 2]
    tree = TreeBatch.from_parents(torch.tensor([[9, 1, 2]]), torch.tensor([[-1, 0, 0]]))
    assert shadow_chains(Draft.from_tree(tree), batch) is None


def test_shadow_proposals_cost_at_most_their_share_of_recent_time():
    """Proposing for shadows costs at most SHADOW_SHARE of the verify time, and of the recent
    time: a long phase of drafting steps (no shadow proposals) banks no allowance for later."""
    from specdecode.engine.adaptive import SHADOW_SHARE

    policy = AdaptiveBudget(roofline(knee=1, slope=1.0), max_gamma=3)
    r = req("r")
    zero, one = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    for _ in range(1000):  # drafting steps: their proposing is not for shadows
        policy.observe([r], one, one, 0.1, 0.002)
    shadows = []
    for _ in range(400):
        propose = policy.propose_first()
        shadows.append(propose)
        policy.observe([r], zero, zero, 0.1, 0.002 if propose else 0.0)
    assert sum(shadows[:20]) <= 11  # nothing banked from the drafting phase (banked: all 20)
    assert sum(shadows) == pytest.approx(400 * SHADOW_SHARE * 0.1 / 0.002, rel=0.05)  # every 2nd step: 2 ms per 200


def test_passes_without_drafts_earn_shadows_a_share_over_their_rows():
    """A pass that carried no drafts earns shadow proposing SHADOW_SHARE over its rows; one
    that carried drafts, the whole share. Under load, where no draft pays, shadows change no
    budget, so a share of every pass would cost throughput for nothing."""
    from specdecode.engine.adaptive import SHADOW_SHARE

    def shadows(rows: int, drafting: bool) -> int:
        policy = AdaptiveBudget(roofline(knee=1, slope=1.0), max_gamma=3)
        reqs = [req(str(i)) for i in range(rows)]
        drafts = torch.full((rows,), int(drafting), dtype=torch.long)
        count = 0
        for _ in range(800):
            propose = policy.propose_first()
            count += propose
            policy.observe(reqs, torch.zeros(rows, dtype=torch.long), drafts, 0.1, 0.002 if propose and not drafting else 0.0)
        return count

    assert shadows(8, drafting=False) == pytest.approx(800 * SHADOW_SHARE * 0.1 / 8 / 0.002, abs=2)  # one in 16 steps
    assert shadows(1, drafting=False) == pytest.approx(800 * SHADOW_SHARE * 0.1 / 0.002, rel=0.05)  # every 2nd step
    assert shadows(8, drafting=True) == 800  # proposing for real drafts spends nothing on shadows


def test_steps_propose_first_while_planning_on_proposals_saves_more_pass_time_than_it_costs():
    """A proposal made before planning (a shadow step's) is a sample of what planning on one
    saves: where its drafts save more pass seconds than proposing and planning cost, every step
    proposes first, uncharged to shadows; where they save nothing, only shadows do."""

    def run(curve: VerifyCost, confidence: float) -> tuple[list[bool], AdaptiveBudget]:
        policy = AdaptiveBudget(curve, max_gamma=4)
        reqs = [req(str(i)) for i in range(4)]
        proposal = Draft(torch.ones(4, 4, dtype=torch.long), confidence=torch.full((4, 4), confidence))
        first = []
        for _ in range(64):
            first.append(policy.propose_first())
            if first[-1]:  # propose, then plan on the proposal
                budgets = policy.budgets(reqs, torch.full((4,), 4), proposal)
                policy.observe(reqs, budgets, budgets, 0.01, 1e-3)
            else:  # plan first
                budgets = policy.budgets(reqs, torch.full((4,), 4))
                policy.observe(reqs, budgets, budgets, 0.01, 0.0)
        return first, policy

    first, policy = run(roofline(knee=64), confidence=0.9)  # drafts free: a plan of 4 rows x 4 saves ~2.4 passes
    assert all(first) and policy.proposal_saved > policy.proposal_cost > 0 and policy.shadow_allowance == 0
    first, policy = run(roofline(knee=1, slope=4.0), confidence=0.1)  # no draft pays
    assert first[0] and not all(first) and policy.proposal_saved == 0 < policy.proposal_cost
    assert sum(first) <= 1 + 64 * 0.01 * 0.01 / 1e-3  # shadows of 1 ms, at most their share of 64 passes of 10 ms
