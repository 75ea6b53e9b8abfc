"""The verifier is lossless: every emitted token follows the target, whatever the drafter.

The statistical tests use a target p that does not depend on the history, so the exact
claim to check is: among rows that reached output position k, the token there is
distributed as p_k (and, given the token before it, still as p_k). Seeds are fixed; the
p-value thresholds are loose enough that a correct verifier passes for any seed, and
`test_the_checks_catch_a_wrong_recovery_distribution` shows they are tight enough to fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specdecode.core import verify
from specdecode.config import SamplingParams
from specdecode.core.sampling import logits_to_probs, make_generator, sampling_tensors
from specdecode.core.verify import greedy_verify, rejection_sample

SEED_P = torch.tensor([0.4, 0.4, 0.2])  # the spec's worked example (10.6.1)
SEED_Q = torch.tensor([0.6, 0.3, 0.1])
SEED_BONUS = torch.tensor([0.2, 0.3, 0.5])


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of tokens [N] to probs [V]; bins expecting < 5 counts are pooled."""
    counts = np.bincount(tokens.numpy(), minlength=probs.shape[0]).astype(np.float64)
    expected = probs.double().numpy() / probs.double().sum().item() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0  # a token the distribution cannot produce
    counts, expected = counts[expected > 0], expected[expected > 0]
    order = np.argsort(expected)
    counts, expected = counts[order], expected[order]
    while len(expected) > 1 and expected[0] < 5:  # pool the rarest bins until each expects >= 5
        counts = np.append(counts[0] + counts[1], counts[2:])
        expected = np.append(expected[0] + expected[1], expected[2:])
        order = np.argsort(expected)
        counts, expected = counts[order], expected[order]
    if len(expected) < 2:
        return 1.0
    return stats.chisquare(counts, expected).pvalue


def tv(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


def check_output_shape(out, num_accepted, draft_tokens, p):
    """Exact invariants: accepted prefix = drafts, one real token after it, -1 after that, p > 0."""
    B, width = out.shape
    num_drafts = (draft_tokens >= 0).cumprod(dim=1).sum(dim=1)
    assert ((0 <= num_accepted) & (num_accepted <= num_drafts)).all()
    positions = torch.arange(width)[None, :]
    accepted = positions < num_accepted[:, None]
    assert torch.equal(out[:, :-1][accepted[:, :-1]], draft_tokens[accepted[:, :-1]])
    assert (out[positions > num_accepted[:, None]] == -1).all()
    emitted = positions <= num_accepted[:, None]
    assert (out[emitted] >= 0).all()
    p_emitted = p.gather(2, out.clamp_min(0)[:, :, None])[:, :, 0]
    assert (p_emitted[emitted] > 0).all(), "emitted a token the target gives probability 0"


def seed_example(n: int, seed: int):
    """γ = 1, drafts sampled from q: (out, num_accepted, drafts)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(SEED_Q, n, replacement=True, generator=g)[:, None]  # [n, 1]
    p = torch.stack([SEED_P, SEED_BONUS])[None].expand(n, 2, 3).contiguous()
    q = SEED_Q[None, None].expand(n, 1, 3).contiguous()
    out, num_accepted = rejection_sample(p, q, drafts, generator=g)
    return out, num_accepted, drafts


def test_seed_example_acceptance_and_output_distribution():
    n = 200_000
    out, num_accepted, drafts = seed_example(n, seed=0)
    # acceptance rate = Σ min(p, q) = 0.8; per draft min(1, p/q) = [2/3, 1, 1]
    assert abs(num_accepted.double().mean().item() - 0.8) < 5 * (0.8 * 0.2 / n) ** 0.5
    assert (num_accepted[drafts[:, 0] != 0] == 1).all()  # p >= q there: always accepted
    rate_0 = num_accepted[drafts[:, 0] == 0].double().mean().item()
    assert abs(rate_0 - 2 / 3) < 5 * (2 / 9 / (0.6 * n)) ** 0.5
    # the first emitted token follows p, although the drafts follow q
    assert chi2_pvalue(out[:, 0], SEED_P) > 1e-4
    assert chi2_pvalue(drafts[:, 0], SEED_P) < 1e-12  # the check has the power to tell q from p
    # recovered tokens follow norm(max(0, p - q)) = [0, 0.5, 0.5]
    recovered = out[num_accepted == 0, 0]
    assert (recovered != 0).all()
    assert chi2_pvalue(recovered, torch.tensor([0.0, 0.5, 0.5])) > 1e-4
    # bonus tokens follow p_2
    assert chi2_pvalue(out[num_accepted == 1, 1], SEED_BONUS) > 1e-4


def test_seed_example_error_shrinks_with_samples():
    """As vLLM's sampler test: the distance to p must fall as the sample count grows."""
    errors = []
    for n in (100, 3_000, 100_000):  # expected TV error ~ 1 / sqrt(n): steps of ~5.5x
        errors.append(np.mean([tv(seed_example(n, seed)[0][:, 0], SEED_P) for seed in range(5)]))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.006, errors


def test_the_checks_catch_a_wrong_recovery_distribution(monkeypatch):
    """Recovering from p instead of the residual is a classic bug; the checks above must see it."""
    monkeypatch.setattr(verify, "RESIDUAL_EPS", 2.0)  # every rejection falls back to p
    out, _, _ = seed_example(200_000, seed=0)
    assert chi2_pvalue(out[:, 0], SEED_P) < 1e-12


def random_case(V: int, gamma: int, drafter: str, R: int, g: torch.Generator):
    """R distinct (p, q, draft distribution) triples: p [R, γ+1, V], q [R, γ, V] or None, r [R, γ, V]."""
    logits_p = torch.randn(R, gamma + 1, V, generator=g) * 1.5
    logits_q = logits_p[:, :gamma] + torch.randn(R, gamma, V, generator=g)  # related, so acceptance is mid-range
    if drafter == "filtered":  # temperature + top-k + top-p on both p and q, as the engine does
        params = [
            SamplingParams(temperature=0.8, top_k=max(2, V // 2), top_p=0.9),
            SamplingParams(temperature=1.2, top_p=0.7),
            SamplingParams(temperature=0.6, top_k=3),
        ][:R]
        p = logits_to_probs(logits_p, *sampling_tensors(params, "cpu"))
        q = logits_to_probs(logits_q, *sampling_tensors(params, "cpu"))
    else:
        p, q = torch.softmax(logits_p, -1), torch.softmax(logits_q, -1)
    if drafter == "one-hot":  # a deterministic drafter: tokens from some other distribution, q = None
        return p, None, torch.softmax(torch.randn(R, gamma, V, generator=g), -1)
    return p, q, q


def draw_drafts(r: torch.Tensor, n: int, g: torch.Generator):
    """n drafts per config from r [R, γ, V], with padding: [R*n, γ] and n_b [R*n]."""
    R, gamma, V = r.shape
    drafts = torch.stack(
        [
            torch.stack([torch.multinomial(r[i, k], n, replacement=True, generator=g) for k in range(gamma)], 1)
            for i in range(R)
        ]
    ).reshape(R * n, gamma)
    # half the rows propose all γ drafts, the rest a random number in [0, γ]
    some = torch.randint(0, gamma + 1, (R * n,), generator=g)
    num_drafts = torch.where(torch.rand(R * n, generator=g) < 0.5, gamma, some)
    positions = torch.arange(gamma)[None, :]
    drafts = torch.where(positions < num_drafts[:, None], drafts, -1)
    # junk after the first -1 must be ignored as padding too
    junk = (positions == num_drafts[:, None] + 1) & (torch.rand(R * n, 1, generator=g) < 0.5)
    drafts = torch.where(junk, torch.randint(0, V, (R * n, gamma), generator=g), drafts)
    return drafts, num_drafts


@pytest.mark.parametrize("drafter", ["q", "one-hot", "filtered"])
@pytest.mark.parametrize("V, gamma", [(2, 1), (7, 2), (7, 4), (50, 3)])
def test_every_emitted_token_follows_the_target(V, gamma, drafter):
    R, n = 3, 8_000
    g = torch.Generator().manual_seed(1000 * V + 10 * gamma + ["q", "one-hot", "filtered"].index(drafter))
    p, q, r = random_case(V, gamma, drafter, R, g)
    drafts, num_drafts = draw_drafts(r, n, g)
    config = torch.arange(R).repeat_interleave(n)
    p_rows = p[config]
    q_rows = None if q is None else q[config]
    out, num_accepted = rejection_sample(p_rows, q_rows, drafts, generator=make_generator(7, "cpu"))

    check_output_shape(out, num_accepted, drafts, p_rows)
    for i in range(R):
        mine = config == i
        for k in range(gamma + 1):
            reached = mine & (num_accepted >= k)
            if reached.sum() >= 200:
                assert chi2_pvalue(out[reached, k], p[i, k]) > 1e-5, (i, k)
            if k < gamma:  # acceptance of a real draft: Σ_x r(x) min(1, p(x)/q(x))
                tried = reached & (num_drafts > k)
                if tried.sum() < 200:
                    continue
                q_ik = q[i, k] if q is not None else None
                rate = (torch.minimum(p[i, k], q_ik).sum() if q_ik is not None else (r[i, k] * p[i, k]).sum()).item()
                observed = (num_accepted[tried] > k).double().mean().item()
                assert abs(observed - rate) < 5 * (rate * (1 - rate) / tried.sum().item()) ** 0.5 + 1e-3, (i, k)


def test_conditional_on_the_previous_token_still_follows_the_target():
    """Joint law, not just marginals: given the row reached k and y_{k-1} = a, y_k ~ p_k for every a."""
    V, gamma, n = 4, 2, 150_000
    g = torch.Generator().manual_seed(5)
    p, q, r = random_case(V, gamma, "q", 1, g)
    drafts, _ = draw_drafts(r, n, g)
    p_rows, q_rows = p.expand(n, -1, -1).contiguous(), q.expand(n, -1, -1).contiguous()
    out, num_accepted = rejection_sample(p_rows, q_rows, drafts, generator=g)
    for k in (1, 2):
        for a in range(V):
            rows = (num_accepted >= k) & (out[:, k - 1] == a)
            if rows.sum() >= 200:
                assert chi2_pvalue(out[rows, k], p[0, k]) > 1e-4, (k, a)


def test_acceptance_rate_is_one_minus_total_variation():
    g = torch.Generator().manual_seed(6)
    V, n = 20, 40_000
    base = torch.randn(V, generator=g)
    for spread in (0.1, 1.0, 3.0):  # q close to p ... far from it
        p = torch.softmax(base, -1)
        q = torch.softmax(base + spread * torch.randn(V, generator=g), -1)
        alpha = torch.minimum(p, q).sum().item()
        assert alpha == pytest.approx(1 - 0.5 * (p - q).abs().sum().item(), abs=1e-6)
        gamma = 3
        drafts = torch.multinomial(q, n * gamma, replacement=True, generator=g).reshape(n, gamma)
        p_rows = p.expand(n, gamma + 1, V).contiguous()
        q_rows = q.expand(n, gamma, V).contiguous()
        _, num_accepted = rejection_sample(p_rows, q_rows, drafts, generator=g)
        first = (num_accepted >= 1).double().mean().item()
        assert abs(first - alpha) < 5 * (alpha * (1 - alpha) / n) ** 0.5 + 1e-4
        # E[accepted] = α + α² + α³ when every position has the same α
        expected = alpha + alpha**2 + alpha**3
        tolerance = 5 * num_accepted.double().std().item() / n**0.5 + 1e-4
        assert num_accepted.double().mean().item() == pytest.approx(expected, abs=tolerance)


def naive_greedy(target_argmax: torch.Tensor, drafts: torch.Tensor):
    """The rule written as a loop: accept while the draft equals the argmax."""
    B, gamma = drafts.shape
    out = torch.full((B, gamma + 1), -1)
    num_accepted = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        k = 0
        while k < gamma and drafts[b, k] >= 0 and drafts[b, k] == target_argmax[b, k]:
            out[b, k] = drafts[b, k]
            k += 1
        out[b, k] = target_argmax[b, k]
        num_accepted[b] = k
    return out, num_accepted


@pytest.mark.parametrize("B, V, gamma", [(64, 10, 4), (32, 3, 1), (16, 100, 6)])
def test_temperature_zero_is_exact_and_greedy_verify_agrees(B, V, gamma):
    g = torch.Generator().manual_seed(B + V + gamma)
    logits = torch.randn(B, gamma + 1, V, generator=g)
    logits[0, 0, :2] = 5.0  # a tie: argmax takes the first index
    p = logits_to_probs(logits, *sampling_tensors([SamplingParams(temperature=0.0)] * B, "cpu"))
    target_argmax = logits.argmax(-1)
    other = torch.randint(0, V, (B, gamma), generator=g)
    drafts = torch.where(torch.rand(B, gamma, generator=g) < 0.7, target_argmax[:, :gamma], other)
    drafts[torch.rand(B, gamma, generator=g) < 0.15] = -1  # padding (and junk after it)
    expected = naive_greedy(target_argmax, drafts)

    q_one_hot = torch.nn.functional.one_hot(drafts.clamp_min(0), V).float()
    q_spread = torch.softmax(torch.randn(B, gamma, V, generator=g), -1)  # even a sampling drafter is judged exactly
    for q in (None, q_one_hot, q_spread):
        for seed in (0, 1):
            out, num_accepted = rejection_sample(p, q, drafts, generator=make_generator(seed, "cpu"))
            assert torch.equal(out, expected[0]) and torch.equal(num_accepted, expected[1])
    out, num_accepted = greedy_verify(target_argmax, drafts)
    assert torch.equal(out, expected[0]) and torch.equal(num_accepted, expected[1])


def test_docstring_example():
    p = torch.tensor([[[0, 1, 0], [0, 0, 1], [1, 0, 0]], [[0, 1, 0], [1, 0, 0], [0, 0, 1]]], dtype=torch.float32)
    drafts = torch.tensor([[1, 0], [1, -1]])
    out, num_accepted = rejection_sample(p, None, drafts)
    assert out.tolist() == [[1, 2, -1], [1, 0, -1]] and num_accepted.tolist() == [1, 1]


def test_edge_cases_without_nan_or_zero_probability_tokens():
    n = 2_000
    g = torch.Generator().manual_seed(8)

    def run(p, q, d):
        B = n
        p_rows = torch.tensor(p).expand(B, len(p), -1).contiguous()
        q_rows = None if q is None else torch.tensor(q).reshape(len(q), len(p[0])).expand(B, -1, -1).contiguous()
        drafts = torch.tensor(d, dtype=torch.int64).expand(B, -1).contiguous()
        out, num_accepted = rejection_sample(p_rows, q_rows, drafts, generator=g)
        check_output_shape(out, num_accepted, drafts, p_rows)
        return out, num_accepted

    # the drafter proposed a token it gives q = 0: accepted whenever p > 0
    _, acc = run([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0]], [[1]])
    assert (acc == 1).all()
    # p(d) = 0: never accepted, whatever q says (even q(d) = 0)
    for q in ([[0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0]], None):
        out, acc = run([[0.3, 0.7, 0.0], [1.0, 0.0, 0.0]], q, [[2]])
        assert (acc == 0).all() and (out[:, 0] != 2).all()
    # greedy p, greedy q, but the draft is not q's argmax: residual max(0, p - q) = 0 -> p's argmax
    out, acc = run([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [[1.0, 0.0, 0.0]], [[2]])
    assert (acc == 0).all() and (out[:, 0] == 0).all()
    # q above p everywhere (float error in q): the residual is all zero -> sample from p, no NaN
    out, acc = run([[0.5, 0.5], [0.5, 0.5]], [[0.6, 0.5]], [[0]])
    assert 0 < (acc == 0).sum() < n
    assert set(out[acc == 0, 0].tolist()) <= {0, 1}
    # p == q: every draft is accepted
    p = torch.softmax(torch.randn(3, 6, generator=g), -1)
    _, acc = run(p.tolist(), p[:2].tolist(), [[1, 4]])
    assert (acc == 2).all()
    # γ = 0 and all-padding rows: just a bonus token from p_1
    out, acc = run([[0.0, 0.25, 0.75]], [], [[]])
    assert (acc == 0).all() and out.shape == (n, 1) and chi2_pvalue(out[:, 0], torch.tensor([0.0, 0.25, 0.75])) > 1e-4
    out, acc = run([[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]], None, [[-1]])
    assert (acc == 0).all() and (out[:, 1] == -1).all() and (out[:, 0] > 0).all()


def test_certain_accepts_do_not_depend_on_the_uniform(monkeypatch):
    """With p(d) >= q(d) > 0 the draft is accepted even if the RNG returns u = 1 (some GPU RNGs draw from (0, 1])."""
    real_fill = verify.fill_per_row

    def uniform_is_one(out, generators, fill, counts=None):
        return out.fill_(1.0) if fill is torch.Tensor.uniform_ else real_fill(out, generators, fill, counts)

    monkeypatch.setattr(verify, "fill_per_row", uniform_is_one)
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.3, 0.3, 0.4]]])
    out, num_accepted = rejection_sample(p, None, torch.tensor([[1, 2]]))  # greedy target, matching drafts
    assert out.tolist()[0][:2] == [1, 2] and num_accepted.tolist() == [2]
    q = torch.tensor([[[0.1, 0.9, 0.0], [0.0, 0.5, 0.5]]])
    _, num_accepted = rejection_sample(p, q, torch.tensor([[1, 2]]))
    assert num_accepted.tolist() == [2]
    _, num_accepted = rejection_sample(p, q, torch.tensor([[0, 2]]))  # p(d) = 0 still never accepted
    assert num_accepted.tolist() == [0]


@pytest.mark.parametrize("own", [3, 1])
def test_rows_are_reproducible_whatever_the_batch(own):
    """Row 0 with the same seed gives the same tokens alone (its own width) or next to other
    rows, also when they pad the batch wider than its own drafts."""
    g = torch.Generator().manual_seed(9)
    V, gamma = 30, 3
    p = torch.softmax(torch.randn(4, gamma + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(4, gamma, V, generator=g), -1)
    drafts = torch.randint(0, V, (4, gamma), generator=g)
    drafts[2, 1:] = -1
    drafts[0, own:] = -1
    alone_gen = [make_generator(1234, "cpu")]
    batch_gens = [make_generator(1234, "cpu"), make_generator(1, "cpu"), None, make_generator(3, "cpu")]
    alone, together = [], []
    for _ in range(30):
        out, acc = rejection_sample(p[:1, : own + 1], q[:1, :own], drafts[:1, :own], generator=alone_gen)
        alone.append((out[0].tolist() + [-1] * (gamma - own), acc[0].item()))
        out, acc = rejection_sample(p, q, drafts, generator=batch_gens)
        together.append((out[0].tolist(), acc[0].item()))
    assert alone == together
    assert len({tuple(tokens) for tokens, _ in alone}) > 1  # the row does consume randomness
    # a single generator for all rows is reproducible from its seed
    first = rejection_sample(p, q, drafts, generator=make_generator(5, "cpu"))
    again = rejection_sample(p, q, drafts, generator=make_generator(5, "cpu"))
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_bad_shapes_are_rejected():
    p = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="draft_tokens"):
        rejection_sample(p, None, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="q must be"):
        rejection_sample(p, torch.full((2, 3, 4), 0.25), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="one generator per row"):
        rejection_sample(p, None, torch.zeros(2, 2, dtype=torch.int64), generator=[None])
    with pytest.raises(ValueError, match="draft_tokens"):
        greedy_verify(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64))
