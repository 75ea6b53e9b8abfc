"""Online acceptance estimates (engine/acceptance.py), driven through the adaptive policy
as the engine drives it: rounds recorded and calibrated, confidences by the request's last
round, and shadow rounds settled from the tokens a row generates."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters.base import Draft
from specdecode.engine.acceptance import AFTER_FULL, AFTER_MISS, AFTER_NOTHING, NOT_SHADOWED
from specdecode.engine.adaptive import AdaptiveBudget
from tests.engine.test_adaptive import req, roofline


def test_adaptive_policy_records_rounds_and_reports_calibration():
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4, refit_every=16)
    g = torch.Generator().manual_seed(1)
    for step in range(80):
        reqs = [req(f"r{step % 3}"), req("steady")]
        budgets = policy.budgets(reqs, torch.tensor([4, 4]))
        accepted = torch.tensor([int(torch.randint(0, 5, (1,), generator=g)), 4]).minimum(budgets)
        policy.observe(reqs, accepted, budgets, 1.0, 0.0)
    assert len(policy.acceptance.records) == 160
    before, after = policy.acceptance.calibration_error()
    assert 0 <= after <= 1 and 0 <= before <= 1
    assert policy.acceptance.confidence("steady")[0] > policy.acceptance.confidence("r0")[0]


def test_shadow_rounds_learn_from_the_tokens_a_row_generates():
    """A row whose proposal was cut to 0 still shows, from the tokens it then generates,
    how far the proposal would have been accepted: 2 of 3 here, then all 3 (and the row's
    state becomes 'after a full round')."""
    policy = AdaptiveBudget(roofline(knee=1, slope=1.0), max_gamma=3)  # no draft ever pays
    r = req("r", length=4)
    zero = torch.zeros(1, dtype=torch.long)

    def step(token: int, proposal: list[int] | None) -> None:
        assert policy.budgets([r], torch.tensor([3])).tolist() == [0]
        r.seq.token_ids.append(token)  # the step's one generated token
        policy.observe([r], zero, zero, 1.0, 0.001, 3, None if proposal is None else torch.tensor([proposal]))

    step(5, [5, 6, 7])  # the shadow starts; its first token was generated
    assert policy.acceptance.per_request["r"].state == AFTER_NOTHING  # not yet compared
    step(6, [6, 8, 9])  # matches again; one shadow at a time: this proposal is not kept
    assert policy.acceptance.per_request["r"].shadow is not None and policy.acceptance.records == []
    assert policy.acceptance.per_request["r"].state == AFTER_FULL  # every token so far matched
    step(9, None)  # 9 != 7: accepted 2 of 3, counted in the state it was proposed in (no round yet)
    mine = policy.acceptance.per_request["r"]
    assert (mine.reached[AFTER_NOTHING], mine.accepted[AFTER_NOTHING]) == ([1, 1, 1], [1, 1, 0])
    assert mine.state == AFTER_MISS and mine.shadow is None and policy.acceptance.records[-1][1:] == (3, 2)
    for t in (1, 2, 3):
        step(t, [1, 2, 3] if t == 1 else None)
    assert mine.state == AFTER_FULL and policy.acceptance.records[-1][1:] == (3, 3)
    assert mine.reached[AFTER_MISS] == [1, 1, 1] and mine.accepted[AFTER_MISS] == [1, 1, 1]
    step(4, [-1, -1, -1])  # the drafter found nothing: a copied run, if any, has ended
    assert mine.state == AFTER_NOTHING


def test_confidence_is_conditioned_on_the_last_round():
    """Acceptance comes in runs: a request whose full rounds are followed by accepted tokens
    and whose misses by rejected ones gets a high c_1 after a full round, a low one after a miss."""
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=2)
    r = req("r")
    for _ in range(5):
        for accepted in (2,) * 9 + (0,) * 9:  # runs: after a full round 8 in 9 are full, after a miss 1 in 9
            policy.budgets([r], torch.tensor([2]))
            policy.observe([r], torch.tensor([accepted]), torch.tensor([2]), 1.0, 0.0)
    after_miss = policy.acceptance.confidence("r")[0]
    assert policy.acceptance.per_request["r"].state == AFTER_MISS
    policy.acceptance.per_request["r"].state = AFTER_FULL
    after_full = policy.acceptance.confidence("r")[0]
    assert after_full > 0.8 and after_miss < 0.2


def test_a_fresh_match_is_counted_apart_from_a_rejected_copy():
    """A lookup drafter's proposal right after it found nothing (a fresh match) and one right
    after a rejection (a copy the row was following) are counted apart: here the first keeps
    its first token 1 time in 9, the second 8 in 9, and c_1 follows each."""
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=2)
    r = req("r")
    nothing = torch.tensor([[-1, -1]])

    def round_(accepted: int) -> None:
        policy.budgets([r], torch.tensor([2]))
        r.seq.token_ids += [1] * (accepted + 1)
        policy.observe([r], torch.tensor([accepted]), torch.tensor([2]), 1.0, 0.0, 2, torch.tensor([[1, 1]]))

    for i in range(9):
        policy.budgets([r], torch.tensor([2]))
        r.seq.token_ids.append(1)
        policy.observe([r], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1.0, 0.0, 2, nothing)
        assert policy.acceptance.per_request["r"].state == AFTER_NOTHING
        round_(1 if i == 0 else 0)  # a fresh match: rejected at once, but once
        assert policy.acceptance.per_request["r"].state == AFTER_MISS
        round_(0 if i == 0 else 1)  # the copy it then follows: its first token kept, but once
    mine = policy.acceptance.per_request["r"]
    assert mine.reached[AFTER_NOTHING][0] == 9 and mine.accepted[AFTER_NOTHING][0] == 1
    assert mine.reached[AFTER_MISS][0] == 9 and mine.accepted[AFTER_MISS][0] == 8
    after_miss = policy.acceptance.confidence("r")[0]
    mine.state = AFTER_NOTHING
    assert policy.acceptance.confidence("r")[0] < 0.25 < 0.75 < after_miss


def test_shadows_settle_when_a_row_finishes_or_drafts():
    """A shadow still matching when its row finishes is recorded cut short; so is one whose row
    verifies drafts for real, at the tokens generated before that pass (the real round covers
    the rest); a row whose proposal was masked (NOT_SHADOWED) keeps its state."""
    policy = AdaptiveBudget(roofline(knee=1, slope=1.0), max_gamma=3)
    zero = torch.zeros(1, dtype=torch.long)
    r = req("r", length=4)
    policy.budgets([r], torch.tensor([3]))
    r.seq.token_ids.append(5)
    policy.observe([r], zero, zero, 1.0, 0.0, 3, torch.tensor([[5, 6, 7]]))
    r.seq.token_ids.append(6)
    r.seq.finish_reason = "stop"
    policy.observe([r], zero, zero, 1.0, 0.0)
    assert policy.acceptance.records[-1][1:] == (2, 2) and "r" not in policy.acceptance.per_request  # 2 of 2 generated, matched

    s = req("s", length=4)
    policy.budgets([s], torch.tensor([3]))
    s.seq.token_ids.append(5)
    policy.observe([s], zero, zero, 1.0, 0.0, 3, torch.tensor([[5, 6, 7]]))
    policy.budgets([s], torch.tensor([3]))
    s.seq.token_ids += [6, 7]
    policy.observe([s], torch.tensor([1]), torch.tensor([1]), 1.0, 0.0)  # a real round: 1 of 1 accepted
    records = policy.acceptance.records
    assert len(records) == 3 and records[-2][1:] == (1, 1)  # the shadow, cut short at the 5 made before the pass
    assert records[-1][1:] == (1, 1)  # the real round: 6 accepted, 7 the bonus
    assert policy.acceptance.per_request["s"].shadow is None and policy.acceptance.per_request["s"].state == AFTER_FULL
    policy.budgets([s], torch.tensor([3]))
    s.seq.token_ids.append(8)
    policy.observe([s], zero, zero, 1.0, 0.0, 3, torch.tensor([[NOT_SHADOWED] * 3]))
    assert policy.acceptance.per_request["s"].state == AFTER_FULL and policy.acceptance.per_request["s"].shadow is None


def test_an_unreached_position_takes_the_estimate_of_the_one_before():
    """c_k is conditional on tokens 1..k-1 surviving: a depth no round has reached yet is
    estimated from the depth before it, not from a flat 1/2 that could keep budgets from ever
    growing past the first depths tried."""
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4)
    r = req("r")
    for _ in range(20):  # rounds of 2 drafts, all accepted
        policy.budgets([r], torch.tensor([2]))
        policy.observe([r], torch.tensor([2]), torch.tensor([2]), 1.0, 0.0)
    shared = policy.acceptance.shared()[AFTER_FULL]
    assert shared[0] > 0.9 and shared[2] == pytest.approx(shared[1]) and shared[3] == pytest.approx(shared[1])
    assert policy.acceptance.confidence("r")[2] > 0.9
    fresh = AdaptiveBudget(roofline(knee=64), max_gamma=4).acceptance
    assert fresh.confidence("r").tolist() == [0.5] * 4  # no rounds at all: 1/2 at every depth


@pytest.mark.parametrize("bonus, expected", [(7, (3, 3)), (9, (3, 2))])
def test_a_fully_accepted_round_is_extended_by_the_bonus_token(bonus, expected):
    """Where a row accepts all d of its drafts and its proposal went on, the bonus token the
    target generated shows whether draft d + 1 would have been accepted: the round is recorded
    as d + 1 drafts (and the state follows it)."""
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4)
    r = req("r", length=4)
    policy.budgets([r], torch.tensor([4]))
    r.seq.token_ids += [5, 6, bonus]  # drafts 5, 6 accepted, then the bonus token
    policy.observe([r], torch.tensor([2]), torch.tensor([2]), 1.0, 0.0, 3, torch.tensor([[5, 6, 7, -1]]))
    assert policy.acceptance.records[-1][1:] == expected
    assert policy.acceptance.per_request["r"].state == (AFTER_FULL if bonus == 7 else AFTER_MISS)
    # a rejection, a proposal that ended at the budget, or a row that stopped before its bonus: as verified
    for accepted, proposal, stop in ((1, [5, 6, 7, -1], False), (2, [5, 6, -1, -1], False), (2, [5, 6, 7, -1], True)):
        policy.budgets([r], torch.tensor([4]))
        r.seq.token_ids += [5, 6] if stop else [5, 6, 7][: accepted + 1]
        policy.observe([r], torch.tensor([accepted]), torch.tensor([2]), 1.0, 0.0, 3, torch.tensor([proposal]))
        assert policy.acceptance.records[-1][1:] == (2, accepted)


def test_the_engine_proposes_one_past_the_budget_only_for_cheap_drafters():
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=4)
    assert policy.lookahead() == 0  # no pass measured yet
    r = req("r")
    policy.budgets([r], torch.tensor([2]))
    policy.observe([r], torch.tensor([2]), torch.tensor([2]), 0.02, 0.0001, 2)  # proposing: 0.05 ms a token
    assert policy.lookahead() == 1
    policy.budgets([r], torch.tensor([2]))
    policy.observe([r], torch.tensor([2]), torch.tensor([2]), 0.02, 0.02, 2)  # a learned drafter's steps
    assert policy.lookahead() == 0


def test_rounds_are_counted_apart_by_the_drafters_evidence():
    """In one state, proposals found with different evidence (ngram: a 5-gram match, a
    2-gram one) survive at different rates; planning with a proposal's evidence uses its
    own rounds, and without evidence the state's pooled ones."""
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=3)  # drafts are free: every row drafts
    proposal = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for step in range(20):  # fresh requests: every round is in the state "no round yet"
        reqs = [req(f"long{step}"), req(f"short{step}")]
        budgets = policy.budgets(reqs, torch.tensor([3, 3]), Draft(proposal, evidence=[5, 2]))
        assert budgets.tolist() == [3, 3]
        policy.observe(reqs, torch.tensor([3, 0]), budgets, 1.0, 0.0)
    acceptance = policy.acceptance
    after_long, after_short = acceptance.confidences(["new", "new"], evidence=[5, 2])[:, 0].tolist()
    pooled = acceptance.confidence("new")[0]
    assert after_long > 0.8 > pooled > 0.2 > after_short
    assert acceptance.confidences(["new"], evidence=[3])[0, 0] == pooled  # no round had a 3-gram


def test_calibration_is_refitted_once_an_eighth_of_the_window_is_new(monkeypatch):
    """STS is refitted every ``refit_every`` steps that learned, but only once an eighth of
    the recorded rounds came after the last fit: a fit runs over the full window, so at one
    row (one round a step) a step count alone would refit on mostly the same rounds."""
    from specdecode.engine import acceptance

    fits, fit = [], acceptance.SequentialTemperatureScaling.fit
    monkeypatch.setattr(acceptance.SequentialTemperatureScaling, "fit",
                        lambda self, rounds, *a: fits.append(step) or fit(self, rounds, *a))  # fmt: skip
    policy = AdaptiveBudget(roofline(knee=64), max_gamma=2, refit_every=4, window=64)
    r = req("r")
    for step in range(1, 201):  # one round a step
        budgets = policy.budgets([r], torch.tensor([2]))
        policy.observe([r], budgets.clamp(max=1), budgets, 1.0, 0.0)
    gaps = [b - a for a, b in zip(fits, fits[1:])]
    # every 4 steps while 4 rounds are an eighth of the window or more (up to 39 recorded), then
    # wider, and every 8 once it holds 64
    assert fits[:9] == list(range(4, 37, 4)) and gaps[9:13] == [5, 6, 7, 8] and set(gaps[13:]) == {8}
