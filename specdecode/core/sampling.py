"""Logits -> probabilities, and seeded sampling from them.

Owns: the one place temperature / min-p / top-k / top-p are applied (`logits_to_probs`), used
for the target's p and every drafter's q alike, so both see the same transforms; the
per-row seeded sampler (`sample`); building the batched sampling tensors from
`SamplingParams` (`sampling_tensors`); per-request generators (`make_generator`).
Does not own: accepting or rejecting drafts (verify.py), or which rows share a batch
(engine/).

Randomness is per row: row b draws only from its own generator, and always the same
amount per call, so a request's seed gives the same tokens whatever else is batched
with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from specdecode.config import SamplingParams
from specdecode.model.cpu_int4 import cpu_argmax

Generators = Sequence[torch.Generator | None]


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(-1)``, faster: on CPU torch's argmax is slower than ``max``'s indices over a
    large vocabulary, so those are used, and bf16 logits (a greedy verify pass's) go to our
    kernel, which reads them without converting to fp32 (kernels/argmax.c).
    All return the first index on ties, and NaN wins as in argmax."""
    ids = cpu_argmax(x)
    if ids is not None:
        return ids
    return (x.float() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else x).max(dim=-1).indices


def logits_to_probs(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor | None = None
) -> Tensor:
    """Turn logits into the distribution tokens are sampled from, per row.

    logits [B, T, V] (any float dtype); temperature [B] float, 0 = greedy; top_k [B] int64,
    <= 0 (or >= V) = off; top_p [B] float in (0, 1], 1 = off; min_p [B] float in [0, 1],
    0 = off (None: off for all). Returns float32 [B, T, V].

    Order as in vLLM: divide by temperature, drop tokens whose probability is below min_p
    times the likeliest's, keep the top-k logits (ties with the k-th
    value are kept, as vLLM and HF do), then keep the smallest set of tokens whose mass is
    >= top_p (the top token always survives), then softmax over what is left. A greedy row
    is one-hot at ``argmax(logits)`` (the first index on ties, as ``torch.argmax``) and
    ignores the filters. Cost: no sort when no sampled row filters, one ``topk`` when rows
    use only top-k, one full sort when any row uses top-p.
    """
    B, T, V = logits.shape
    logits = logits.float()
    greedy = temperature == 0  # [B]
    use_k = (top_k > 0) & (top_k < V) & ~greedy  # [B] a greedy row's top token survives any filter
    use_p = (top_p < 1) & ~greedy  # [B]
    max_k = torch.where(use_k, top_k, torch.zeros_like(top_k)).max()
    any_greedy, all_greedy, any_p, max_k = torch.stack(
        [greedy.any().long(), greedy.all().long(), use_p.any().long(), max_k.long()]
    ).tolist()  # the one host sync: decides which work is needed at all

    if any_greedy:
        one_hot = torch.zeros_like(logits).scatter_(-1, argmax(logits)[..., None], 1.0)  # [B, T, V]
        if all_greedy:
            return one_hot

    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()  # [B], greedy rows: 1
    scaled = logits / temp[:, None, None]  # [B, T, V]
    if min_p is not None and bool(((min_p > 0) & ~greedy).any()):
        probs = torch.softmax(scaled, dim=-1)  # [B, T, V]
        floor = min_p.float()[:, None, None] * probs.amax(dim=-1, keepdim=True)  # [B, T, 1]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if any_p:
        scaled = _top_k_top_p(scaled, use_k, top_k, use_p, top_p)
    elif max_k > 0:
        scaled = _top_k(scaled, use_k, top_k, max_k)
    probs = torch.softmax(scaled, dim=-1)  # [B, T, V]
    if any_greedy:
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def _top_k(scaled: Tensor, use_k: Tensor, top_k: Tensor, max_k: int) -> Tensor:
    """Top-k alone: mask logits below each row's k-th largest to -inf. No full sort, one topk."""
    B, T, V = scaled.shape
    largest = torch.topk(scaled, max_k, dim=-1).values  # [B, T, max_k], descending
    k = torch.where(use_k, top_k, torch.ones_like(top_k))  # [B]
    kth = largest.gather(-1, (k - 1)[:, None, None].expand(B, T, 1))  # [B, T, 1]
    kth = torch.where(use_k[:, None, None], kth, float("-inf"))
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _top_k_top_p(scaled: Tensor, use_k: Tensor, top_k: Tensor, use_p: Tensor, top_p: Tensor) -> Tensor:
    """Mask filtered-out logits to -inf. scaled [B, T, V]; per-row settings [B]; one sort."""
    B, T, V = scaled.shape
    # descending, tied logits by falling index: HF's and vLLM's top-p sort ascending and drop from
    # the bottom, so of tokens tied at the boundary they keep the higher indices (a stable
    # descending sort would keep the lower ones: the same mass, another support)
    ascending, order = torch.sort(scaled, dim=-1, stable=True)  # [B, T, V] each
    sorted_logits, order = ascending.flip(-1), order.flip(-1)

    k = torch.where(use_k, top_k, torch.full_like(top_k, V)).clamp(1, V)  # [B]
    kth = sorted_logits.gather(-1, (k - 1)[:, None, None].expand(B, T, 1))  # [B, T, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))

    # Token i (in sorted order) survives top-p iff the mass strictly before it is < top_p:
    # that is the smallest prefix with mass >= top_p, and the top token always survives.
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [B, T, V]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [B, T, V]
    threshold = torch.where(use_p, top_p.float(), torch.full_like(top_p, 2.0, dtype=torch.float32))  # [B]
    drop = mass_before >= threshold[:, None, None]
    drop[..., 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample(probs: Tensor, generators: Generators) -> Tensor:
    """Draw one token per row. probs [B, V] (rows need not be normalised; zeros allowed) -> [B] int64.

    Exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token x with
    probability probs[x] / sum(probs), and can never pick a zero-probability token.
    Row b draws its V exponentials from ``generators[b]`` (None = the default RNG).
    """
    race = fill_per_row(torch.empty_like(probs, dtype=torch.float32), generators, Tensor.exponential_)  # [B, V]
    # Exp(1) can round to 0; the clamp keeps 0 / 0 (a NaN that argmax would pick) out.
    return argmax(probs.float() / race.clamp_min_(torch.finfo(torch.float32).tiny))


def fill_per_row(
    out: Tensor, generators: Generators, fill: Callable[..., Tensor], counts: Sequence[int] | None = None
) -> Tensor:
    """Fill row b of ``out`` [B, ...] in place with ``fill(row, generator=generators[b])``;
    with ``counts``, only the first ``counts[b]`` entries of row b (the rest is left as it is).

    One call for the whole tensor when every row uses the same generator (or all None) and
    fills all of its row; otherwise one call per row. Row b consumes the same amount of its
    generator's stream either way: with ``counts`` it draws for what it has, not for the
    width other rows padded the batch to, so its numbers do not depend on the other rows.
    """
    if len(generators) != out.shape[0]:
        raise ValueError(f"need one generator per row: {out.shape[0]} rows, {len(generators)} generators")
    full = counts is None or all(n == out.shape[1] for n in counts)
    if full and len(generators) > 0 and all(g is generators[0] for g in generators):
        fill(out, generator=generators[0])
        return out
    for b, (row, g) in enumerate(zip(out, generators)):
        fill(row if counts is None else row[: counts[b]], generator=g)
    return out


def sampling_tensors(
    params: Sequence[SamplingParams], device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Batch the per-request settings: temperature [B] float32, top_k [B] int64, top_p [B]
    float32, min_p [B] float32 (the arguments of `logits_to_probs` after the logits)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    return temperature, top_k, top_p, min_p


@dataclass(frozen=True)
class Logprob:
    """An output token's log-probability under the target (per its ``logprobs_mode``), and the
    ``top`` k likeliest tokens' (token id, logprob), likeliest first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logprobs: Tensor, tokens: Sequence[int], k: int) -> list[Logprob]:
    """logprobs [n, V] (log-probabilities, -inf allowed), the token chosen at each of the n
    positions, and how many alternatives to list -> one `Logprob` per position."""
    chosen = logprobs.gather(1, torch.tensor(list(tokens), device=logprobs.device)[:, None])[:, 0].tolist()
    if k > 0:
        top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        alts = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        alts = [()] * len(chosen)
    return [Logprob(t, lp, a) for t, lp, a in zip(tokens, chosen, alts)]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``; ``None`` draws a random seed."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
