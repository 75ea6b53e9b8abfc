"""What a step costs where the engine runs: the measured verify-cost curve t(P) of the target's
passes, and what attention costs per query and context token.

Owns: `VerifyCost` (measured at load, refitted from the engine's own passes by
`fit_passes`, which `PassLog` keeps and says when to refit from), `measure_attention_cost`,
and the least-squares line the benchmark uses.
Does not own what the costs are spent on (engine/adaptive.py).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from specdecode.engine.serving import ServingEngine


def clock(device: torch.device, wait: bool = True) -> float:
    """``time.perf_counter()`` once ``device`` has run what was queued on it (``wait``): CUDA runs
    asynchronously, so without the sync a timer stops before the work it times."""
    if wait and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def least_squares_line(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b·x through (x, y) samples spanning two x."""
    x = torch.tensor([p for p, _ in samples], dtype=torch.float64)
    y = torch.tensor([t for _, t in samples], dtype=torch.float64)
    b = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    return float(y.mean()) - b * float(x.mean()), b


TABLE_POSITIONS = 1024  # pass sizes t(P) is tabulated for (the engine's passes stay within 512)


class VerifyCost:
    """t(P): the measured time of one target pass over P positions, interpolated.

    Timings are noisy (a shared CPU), and a curve that dips makes the planner stop early,
    so the points are made non-decreasing (running max) before use.
    """

    def __init__(self, points: list[tuple[int, float]]) -> None:
        if not points:
            raise ValueError("a verify-cost curve needs at least one point")
        pts, top = [], 0.0
        for p, t in sorted(points):
            top = max(top, t)
            if pts and pts[-1][0] == p:  # a size measured twice: its dearer time
                pts.pop()
            pts.append((p, top))
        self.points = pts
        self._sizes = [p for p, _ in pts]
        # the planner prices thousands of positions a step: whole pass sizes are looked up, not
        # interpolated each time. Built in one go (one tensor call, not one per size): the
        # engine's passes are refitted into a new curve every few dozen steps.
        self._table = self._interpolate_all(torch.arange(TABLE_POSITIONS, dtype=torch.float64)).tolist()
        self._beyond: dict[float, float] = {}  # sizes past the table (or fractional) already asked

    @staticmethod
    def fit_line(samples: list[tuple[int, float]]) -> VerifyCost | None:
        """A least-squares line t = a + b·P through measured passes, as a curve; None if the
        samples do not span two sizes or the fit is not an increasing positive line."""
        p, t = torch.tensor(samples, dtype=torch.float64).reshape(-1, 2).unbind(1)  # [N] each
        fitted = _fit(p, t, None, False, float(p.min()), float(p.max())) if len(samples) else None
        return fitted[0] if fitted is not None else None

    def __call__(self, positions: int) -> float:
        if isinstance(positions, int) and 0 <= positions < TABLE_POSITIONS:
            return self._table[positions]
        value = self._beyond.get(positions)
        if value is None:  # past the table, once (a tensor call per ask adds up: the planner asks thousands)
            if len(self._beyond) >= TABLE_POSITIONS:
                self._beyond.clear()
            x = torch.tensor([float(positions)], dtype=torch.float64)
            value = self._beyond[positions] = float(self._interpolate_all(x)[0])
        return value

    def _interpolate_all(self, x: torch.Tensor) -> torch.Tensor:
        """The curve at every size in ``x`` [N]: linear between points, flat before the first,
        the last slope extrapolated past the last."""
        if len(self.points) == 1:
            return torch.full_like(x, self.points[0][1])
        p = torch.tensor(self._sizes, dtype=torch.float64)  # [n]
        t = torch.tensor([t for _, t in self.points], dtype=torch.float64)
        i = torch.searchsorted(p, x).clamp(1, len(p) - 1)  # the segment [i - 1, i] each size falls in or past
        p0, p1, t0, t1 = p[i - 1], p[i], t[i - 1], t[i]
        inside = t0 + (t1 - t0) * (x - p0) / (p1 - p0)
        past = t1 + (t1 - t0) / (p1 - p0) * (x - p1)  # the last slope, extrapolated
        return torch.where(x <= p[0], t[0], torch.where(x > p[-1], past, inside))

    def min_slope(self, positions: int) -> float:
        """The least seconds an extra position adds anywhere past ``positions``: the smallest
        slope of the curve's segments there (0 where the curve is flat before its first point)."""
        pts = self.points
        if len(pts) < 2 or positions < pts[0][0]:
            return 0.0
        slopes = [(t1 - t0) / (p1 - p0) for (p0, t0), (p1, t1) in itertools.pairwise(pts) if p1 > positions]
        return min(slopes) if slopes else (pts[-1][1] - pts[-2][1]) / (pts[-1][0] - pts[-2][0])

    @staticmethod
    def measure(engine: ServingEngine, max_positions: int, repeats: int = 3) -> VerifyCost:
        """Time passes of 1, 2, 4, … positions (one row, the longest under ``max_positions``)
        through the engine's own model and cache; the slowest of the repeats is dropped."""
        sizes, p = [], 1
        while p < max_positions:
            sizes.append(p)
            p *= 2
        sizes.append(max_positions)
        cache, model, device = engine.cache, engine.model, engine.device
        sid = ("__verify_cost__",)
        cache.add_sequence(sid)
        points = []
        try:
            cache.set_batch([sid])
            cache.reserve([max_positions])
            with torch.inference_mode():
                for size in sizes:
                    tokens = torch.zeros(1, size, dtype=torch.long, device=device)
                    positions = torch.arange(size, device=device)[None, :]
                    times = []
                    for _ in range(repeats + 1):
                        start = clock(device)
                        model(tokens, positions, cache, batch_invariant=engine.batch_invariant)
                        times.append(clock(device) - start)
                    points.append((size, sorted(times)[len(times) // 2]))
        finally:
            cache.free_sequence(sid)
        return VerifyCost(points)


def measure_attention_cost(engine: ServingEngine, rows: int = 16, width: int = 9, context: int = 256) -> float:
    """Seconds per attention query and context token, all layers together: SDPA on the target's
    head shapes (a kv head's G query heads folded, a boolean mask, as the model runs it), timed
    for ``rows`` queries and for ``rows · width``; the fastest of 10 after a warm-up. (The
    fastest, not a median: taken once at load, a median caught in a noisy moment would
    misprice attention for the whole run, and noise only ever adds time.)"""
    cfg, device = engine.target.config, engine.device
    dtype = engine.model.embed.weight.dtype
    Hkv, G, D = engine.model.kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim  # this rank's heads
    k, v = (torch.randn(rows, Hkv, context, D, dtype=dtype, device=device) for _ in range(2))

    def seconds(T: int) -> float:
        q = torch.randn(rows, Hkv, G * T, D, dtype=dtype, device=device)
        mask = torch.ones(rows, 1, G * T, context, dtype=torch.bool, device=device)
        times = []
        for _ in range(11):
            start = clock(device)
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            times.append(clock(device) - start)
        return min(times[1:])

    extra = max(0.0, seconds(width) - seconds(1))
    return extra * cfg.num_layers / (rows * (width - 1) * context)


# The passes the verify-cost curve is fitted from: the latest this many. One curve through
# passes from several loads bent where the loads met (the machine's speed drifts between
# them, and a pass costs more when prompt chunks run between passes): a long window kept
# pricing drafts at the old loads' cost, well above what the current passes took, and the
# budgets stayed at ~0.
PASS_WINDOW = 512


class PassLog:
    """The engine's latest PASS_WINDOW passes (positions, attention queries · context, whether
    it carried drafts, seconds), and when they are due to be refitted into a curve."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, int, bool, float]] = []
        self.since_refit = 0

    @property
    def last_seconds(self) -> float | None:
        return self.passes[-1][3] if self.passes else None

    def add(
        self, one: tuple[int, int, bool, float], attention_cost: float
    ) -> tuple[VerifyCost | None, float | None] | None:
        """Log a pass; `fit_passes` over the window when a refit is due, else None. Due once an
        eighth of the window is new (at least 16 passes), counted: by the window's length, a
        full window would be refitted on every pass, a noticeable share of a step; a fixed
        count keeps the refits' cost a small, steady share at any load."""
        self.passes.append(one)
        del self.passes[:-PASS_WINDOW]
        self.since_refit += 1
        if len(self.passes) < 32 or self.since_refit < max(16, len(self.passes) // 8):
            return None
        self.since_refit = 0
        return fit_passes(self.passes, attention_cost)


def fit_passes(
    passes: list[tuple[int, int, bool, float]], attention_cost: float
) -> tuple[VerifyCost | None, float | None]:
    """t(P), and δ (None: keep the last), from the engine's own passes (positions, attention
    queries · context, whether it carried drafts, seconds), which carry real batch sizes and
    contexts (the start-up curve has one row and an empty context): t = a + b·P + e·P² + c·Q,
    P the real positions (linears) and Q = attention queries · context (the queries of the
    batch padded to its widest draft, or split, each over the longest context). c is the
    cost measured at load; a, b and e are fitted, and with them δ, the fixed cost of a pass
    that carries any draft (+ δ·[drafts]), once passes of both kinds, and drafting passes of
    two sizes, are in the window and δ comes out ≥ 0; else without it, δ = 0. (c is not
    fitted: Q rises with P, so a fit from real passes moves attention's cost into the slope,
    prices c far below what SDPA alone costs, and makes deep drafts in busy batches look cheap.)

    The bend e: a position costs less in a bigger pass, so a line through a window of passes
    from every load overprices a draft in a big batch, and only the likeliest tokens pay. It is
    fitted only where passes of three sizes, each at least 8 times, are in the window (a
    single odd pass would set it), and kept only where the curve rises over the window's
    sizes; else the line. The curve is None where neither fits."""
    passes = _without_stalls(passes, attention_cost)
    p, q, d, t = torch.tensor(passes, dtype=torch.float64).unbind(1)  # [N] each
    y = t - attention_cost * q
    lo = float(p.min())
    hi = max(float(p.max()), lo + 1)
    shapes = (True, False) if sum(n >= 8 for n in Counter(p.tolist()).values()) >= 3 else (False,)
    delta = None
    if 8 <= int(d.sum()) <= len(passes) - 8:
        # δ and the slope are told apart only by drafting passes of several sizes: at one
        # client nearly every drafting pass has 2 positions, and a single 3-position pass
        # would set the slope
        if _spread(p[d > 0].tolist()):
            for bend in shapes:
                fitted = _fit(p, y, d, bend, lo, hi)
                if fitted is not None:
                    return fitted
        # a curve through all passes then holds what drafting costs in its slope (a negative
        # δ is the curve bending upwards: AVX2's 1-2 row tiles, then octets)
        delta = 0.0
    for bend in shapes:
        fitted = _fit(p, y, None, bend, lo, hi)
        if fitted is not None:
            return fitted[0], delta
    return None, delta


# A pass this many times its size's median time is a stall (the OS, the allocator, another job),
# not what its positions cost: one such pass can bend the curve enough that the budgets drop to
# 1 per row and, every later pass then having that one size, no refit comes to mend it.
STALL = 4.0


def _without_stalls(
    passes: list[tuple[int, int, bool, float]], attention_cost: float
) -> list[tuple[int, int, bool, float]]:
    """The passes less those over STALL times the median of their size (sizes seen 3+ times), in
    time less attention's (a pass at a long context is not a stall)."""

    def linears(one: tuple[int, int, bool, float]) -> float:
        return one[3] - attention_cost * one[1]

    times: dict[int, list[float]] = {}
    for one in passes:
        times.setdefault(one[0], []).append(linears(one))
    medians = {size: statistics.median(ts) for size, ts in times.items() if len(ts) >= 3}
    limit = {size: STALL * m for size, m in medians.items() if m > 0}  # (a clock that ran backwards: kept)
    return [one for one in passes if linears(one) <= limit.get(one[0], math.inf)]


def _fit(
    p: torch.Tensor, y: torch.Tensor, d: torch.Tensor | None, bend: bool, lo: float, hi: float
) -> tuple[VerifyCost, float] | None:
    """Least squares y = a + b·P (+ e·P² if ``bend``) (+ δ·d if ``d``), as a curve through
    sizes lo..hi (each 1.5× the last) and δ; None where the columns are not independent,
    a ≤ 0, δ < 0, or the curve falls somewhere in [lo, hi]."""
    columns = [torch.ones_like(p), p] + ([p * p] if bend else []) + ([d] if d is not None else [])
    X = torch.stack(columns, dim=1)  # [N, 2-4]
    if int(torch.linalg.matrix_rank(X)) < X.shape[1]:
        return None
    fit = torch.linalg.lstsq(X, y[:, None]).solution[:, 0].tolist()
    a, b, e = fit[0], fit[1], fit[2] if bend else 0.0
    delta = fit[-1] if d is not None else 0.0
    if a <= 0 or delta < 0 or b + 2 * e * lo < 0 or b + 2 * e * hi < 0:
        return None
    sizes, size = [], lo
    while size < hi:
        sizes.append(size)
        size = size * 1.5 if size > 0 else size + 1  # a size of 0 (fit_line's caller's) would never grow
    return VerifyCost([(x, a + b * x + e * x * x) for x in [*sizes, hi]]), delta


def _spread(sizes: list[float], others: int = 8) -> bool:
    """Whether at least ``others`` of the passes' ``sizes`` differ from the commonest one."""
    commonest = Counter(sizes).most_common(1)
    return len(sizes) - (commonest[0][1] if commonest else 0) >= others
