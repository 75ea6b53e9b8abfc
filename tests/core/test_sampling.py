"""logits_to_probs against a float64 reference, the seeded sampler, and the small helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats

from specdecode.core import sampling
from specdecode.config import SamplingParams
from specdecode.core.sampling import logits_to_probs, make_generator, sample, sampling_tensors


def settings_for(B: int, temperature=1.0, top_k=0, top_p=1.0):
    """[B] sampling tensors with one setting for every row."""
    return sampling_tensors([SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * B, "cpu")


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """One row [V], written the obvious way in float64."""
    V = logits.shape[0]
    if temperature == 0:
        out = np.zeros(V)
        out[np.argmax(logits)] = 1.0
        return out
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < V:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        order = np.argsort(probs, kind="stable")[::-1]  # ties: the higher index first, as HF / vLLM
        kept_mass = 0.0
        keep = np.zeros(V, dtype=bool)
        for i in order:  # add tokens from the top until the kept mass reaches top_p
            keep[i] = True
            kept_mass += probs[i]
            if kept_mass >= top_p:
                break
        x = np.where(keep, x, -np.inf)
    probs = np.exp(x - x.max())
    return probs / probs.sum()


def test_temperature_only_is_softmax_of_scaled_logits():
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([1.0, 0.5, 2.0])
    probs = logits_to_probs(logits, temperature, torch.zeros(3, dtype=torch.int64), torch.ones(3))
    assert probs.dtype == torch.float32 and probs.shape == (3, 4, 11)
    torch.testing.assert_close(probs, torch.softmax(logits / temperature[:, None, None], dim=-1))


def test_greedy_is_one_hot_at_first_argmax():
    logits = torch.tensor(
        [[[1.0, 3.0, 3.0, -2.0], [5.0, 0.0, 5.0, 5.0]], [[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0]]]
    )
    temperature = torch.tensor([0.0, 1.0])
    probs = logits_to_probs(logits, temperature, torch.tensor([2, 0]), torch.tensor([0.5, 1.0]))
    assert probs[0].tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]  # exact, ties -> first index
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], dim=-1))  # the other row is untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 7), (9, 4099), (2, 3, 257)])
def test_argmax_is_torch_argmax_with_ties_and_nan(dtype, shape):
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        x = torch.randint(0, 3, shape, generator=g).to(dtype)  # many ties for the maximum
        if trial % 2:
            x.view(-1, shape[-1])[0, int(torch.randint(0, shape[-1], (1,), generator=g))] = float("nan")
        if trial % 5 == 0:
            x = torch.randn(shape, generator=g).to(dtype)
        assert torch.equal(sampling.argmax(x), x.argmax(dim=-1)), (trial, dtype, shape)


def test_top_k_keeps_the_k_largest():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, 50, generator=g)
    top_k = torch.tensor([1, 5, 49, 0])
    probs = logits_to_probs(logits, torch.ones(4), top_k, torch.ones(4))
    for b, k in enumerate([1, 5, 49, 50]):
        for t in range(3):
            kept = set(torch.nonzero(probs[b, t]).flatten().tolist())
            assert kept == set(logits[b, t].topk(k).indices.tolist())
            expected = torch.softmax(logits[b, t, sorted(kept)], dim=-1)
            torch.testing.assert_close(probs[b, t, sorted(kept)], expected)


def test_top_k_keeps_ties_with_the_kth_value():
    logits = torch.tensor([[[4.0, 2.0, 2.0, 1.0, 2.0]]])
    probs = logits_to_probs(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))
    assert (probs[0, 0] > 0).tolist() == [True, True, True, False, True]


def test_top_p_keeps_the_smallest_nucleus():
    # Softmax of log-probabilities gives these exactly enough to stay off the boundaries.
    p = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    logits = p.log()[None, None].expand(4, 1, 5)
    top_p = torch.tensor([0.45, 0.75, 0.85, 0.99])
    probs = logits_to_probs(logits, torch.ones(4), torch.zeros(4, dtype=torch.int64), top_p)[:, 0]
    assert (probs > 0).tolist() == [
        [False, True, False, False, False],  # 0.5 >= 0.45 already: the top token alone
        [False, True, False, True, False],  # 0.8
        [False, True, True, True, False],  # 0.9
        [True, True, True, True, True],  # all five; ties at 0.05 do not matter here
    ]
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.625, 0.0, 0.375, 0.0]))


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0]]])  # every token has mass 0.25 > top_p
    probs = logits_to_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.tensor([0.1]))
    assert probs[0, 0].tolist() == [0.0, 0.0, 0.0, 1.0]  # of tied tokens, the last (as HF)


@pytest.mark.parametrize("row, top_p", [([0.0] * 8, 0.5), ([2.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], 0.6),
                                        ([1.0, 3.0, 1.0, 3.0, 1.0, 0.5], 0.7), ([0.0] * 5, 0.1)])  # fmt: skip
def test_top_p_keeps_the_tied_tokens_transformers_keeps(row, top_p):
    """At the top-p boundary HF (and vLLM) keep the higher-index tokens of a tie: the same mass as
    the lower ones, but another support, so another output distribution."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.tensor(row)
    ours = logits_to_probs(logits[None, None], torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.tensor([top_p]))
    hf = torch.softmax(TopPLogitsWarper(top_p)(None, logits[None].clone()), dim=-1)
    assert torch.equal(ours[0, 0] > 0, hf[0] > 0)
    torch.testing.assert_close(ours[0, 0], hf[0])


def test_top_p_boundary_is_inclusive():
    """Mass exactly top_p is enough: four tokens of 0.25 (exact in float32) and top_p = 0.5 keep two."""
    logits = torch.zeros(1, 1, 4)
    probs = logits_to_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.tensor([0.5]))
    assert sorted(probs[0, 0].tolist()) == [0.0, 0.0, 0.5, 0.5]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    V=st.integers(1, 40),
    scale=st.floats(0.1, 8.0),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.integers(-1, 45),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
)
def test_matches_reference(seed, V, scale, temperature, top_k, top_p):
    logits = torch.randn(1, 2, V, generator=torch.Generator().manual_seed(seed)) * scale
    if temperature > 0 and top_p < 1:  # keep away from the top-p boundary, where float32 rounding may go either way
        for row in logits[0].double().numpy():
            x = reference_probs(row, temperature, top_k, 1.0)
            cumulative = np.cumsum(np.sort(x)[::-1])
            assume(np.abs(cumulative - top_p).min() > 1e-4)
    temperature_t, top_k_t, top_p_t, _ = settings_for(1, temperature, top_k, top_p)
    probs = logits_to_probs(logits, temperature_t, top_k_t, top_p_t)
    for t in range(2):
        expected = reference_probs(logits[0, t].double().numpy(), temperature, top_k, top_p)
        got = probs[0, t].double().numpy()
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert (got[expected == 0] == 0).all()  # what top-k / top-p / greedy cut stays cut
        # ... and what they keep stays possible, unless float32's exp underflows (below ~1e-38)
        assert (got[expected > 1e-30] > 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2))


def test_rows_use_their_own_settings():
    """A mixed batch gives each row what it would get alone."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 3, 30, generator=g)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.8),
    ]
    batched = logits_to_probs(logits, *sampling_tensors(params, "cpu"))
    for b, params_b in enumerate(params):
        alone = logits_to_probs(logits[b : b + 1], *sampling_tensors([params_b], "cpu"))
        torch.testing.assert_close(batched[b : b + 1], alone, atol=1e-6, rtol=0)


def test_half_precision_logits_give_float32_probabilities():
    logits = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    probs = logits_to_probs(logits, *settings_for(2, temperature=0.8, top_k=20, top_p=0.9))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))


def test_no_sort_unless_a_row_uses_top_p(monkeypatch):
    def no_sort(*args, **kwargs):
        raise AssertionError("sorted although no row uses top-k or top-p")

    monkeypatch.setattr(torch, "sort", no_sort)
    logits = torch.randn(3, 2, 20)
    # greedy rows ignore filters, and k = V is off
    params = [SamplingParams(), SamplingParams(temperature=0.0, top_k=3), SamplingParams(top_k=20)]
    probs = logits_to_probs(logits, *sampling_tensors(params, "cpu"))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 2))
    top_k_only = logits_to_probs(logits, *sampling_tensors([SamplingParams(top_k=k) for k in (0, 3, 19)], "cpu"))
    assert ((top_k_only > 0).sum(-1) == torch.tensor([[20], [3], [19]])).all()  # top-k alone needs topk, not sort
    with pytest.raises(AssertionError, match="sorted although"):
        logits_to_probs(logits, *sampling_tensors([SamplingParams(top_p=0.5)] * 3, "cpu"))


def test_sample_follows_probs_and_never_picks_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    n = 40_000
    g = make_generator(11, "cpu")
    tokens = sample(probs.expand(n, 6).contiguous(), [g] * n)
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert stats.chisquare(counts[[1, 3, 4]], n * probs[[1, 3, 4]].double().numpy()).pvalue > 1e-4
    # Unnormalised weights are fine: the exponential race only compares ratios.
    scaled = sample((probs * 7).expand(n, 6).contiguous(), [make_generator(11, "cpu")] * n)
    assert torch.equal(scaled, tokens)


def test_sample_survives_an_exponential_of_zero(monkeypatch):
    """Exp(1) draws can round to 0 (0 / 0 would be a NaN that argmax picks): still never a zero-probability token."""
    monkeypatch.setattr(sampling, "fill_per_row", lambda out, generators, fill: out.zero_())
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.7], [0.0, 1.0, 0.0, 0.0]])
    tokens = sample(probs, [None, None])
    assert (probs.gather(1, tokens[:, None]) > 0).all()


def test_sample_rows_are_reproducible_whatever_the_batch():
    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(4, 100, generator=g), dim=-1)
    alone = [sample(probs[:1], [make_generator(1234, "cpu")]) for _ in range(1)]
    batched_gens = [make_generator(1234, "cpu"), make_generator(5, "cpu"), None, make_generator(6, "cpu")]
    together = sample(probs, batched_gens)
    assert together[0] == alone[0][0]
    # and stays in step over several calls
    g_alone, g_batched = make_generator(99, "cpu"), make_generator(99, "cpu")
    seq_alone = [sample(probs[:1], [g_alone]).item() for _ in range(20)]
    seq_batched = [sample(probs, [g_batched, None, make_generator(7, "cpu"), None])[0].item() for _ in range(20)]
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1


def test_sample_needs_one_generator_per_row():
    with pytest.raises(ValueError, match="one generator per row"):
        sample(torch.ones(3, 4) / 4, [None, None])


def test_sampling_tensors_and_generators():
    params = [SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1)]
    temperature, top_k, top_p, min_p = sampling_tensors(params, "cpu")
    assert min_p.tolist() == pytest.approx([0.0, 0.1])
    assert temperature.dtype == torch.float32 and top_k.dtype == torch.int64 and top_p.dtype == torch.float32
    assert temperature.tolist() == pytest.approx([0.0, 0.7])
    assert top_k.tolist() == [5, 0]
    assert top_p.tolist() == pytest.approx([1.0, 0.9])
    a, b = make_generator(3, "cpu"), make_generator(3, "cpu")
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert make_generator(None, "cpu").initial_seed() != make_generator(None, "cpu").initial_seed()
