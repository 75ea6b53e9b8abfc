"""The search the adaptive budget (engine/adaptive.py) plans a step with: which draft positions
to verify, most likely to survive first, while each pays for its time.

Owns: `Plan`, MIN_GAIN and `PositionSearch`, the adaptive budget's base: the widths and
attention modes tried, the positions taken, the floor that cuts the least likely ones, and
the bound that skips the search where no draft can pay. It prices passes with the policy's
cost model (its ``cost``, ``attention_cost``, ``context``, ``draft_cost`` and
``draft_overhead``, `pass_time`); the estimates and the bookkeeping are the policy's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from specdecode.model.masks import attention_queries

if TYPE_CHECKING:
    from specdecode.engine.cost import VerifyCost

# A step carries drafts only if the model predicts at least this much more expected tokens
# per second of pass than without any: what the cost model leaves out (sampling and
# bookkeeping per draft, the prefill that a closed loop brings in sooner) costs a few
# percent, so a smaller predicted gain is within that error and may well be a loss.
MIN_GAIN = 0.02


class Plan(NamedTuple):
    """Budgets for a step, their expected tokens (rows + Σ survival) and predicted pass seconds."""

    budgets: list[int]
    expected: float
    seconds: float

    def rate(self, prefill: float) -> float:
        """Expected tokens per second of a step that also runs ``prefill`` seconds of prompt chunks."""
        return self.expected / (self.seconds + prefill)


class PositionSearch:
    """The budgets search, a base of `AdaptiveBudget`, which holds the cost model it reads
    (these fields) and prices a whole pass (`pass_time`)."""

    cost: VerifyCost  # t(P) over the linears, fitted from the engine's passes
    attention_cost: float  # seconds per attention query and context token
    context: int  # the longest row's tokens: attention's length
    draft_cost: float  # seconds proposing costs per draft depth
    draft_overhead: float  # seconds a pass that carries drafts pays beyond its positions

    def _plan(
        self, survival: list[list[float]], cap: list[int], B: int, fused: bool, limit: int | None, prefill: float,
        allowed: float, baseline: Plan,
    ) -> Plan:
        """The budgets whose step (its pass and ``prefill`` seconds) yields the most expected
        tokens per second within the floor (``allowed``, see `_fill`), beating ``baseline``,
        or MIN_GAIN over it where it has no drafts. Proposing costs by depth, and the torch blocks pad every
        row's attention to the widest draft (or, when few rows draft, compute only their extra
        queries), so the widest draft is chosen first: for each width w and each way attention
        may run, positions of depth <= w are taken most likely first while they pay."""
        # Candidate positions (row b's k-th draft token), most likely to survive first; survival
        # falls with k, so a row's positions come in order.
        ranked = sorted(
            ((survival[b][k - 1], k, b) for b in range(B) for k in range(1, cap[b] + 1)), key=lambda c: (-c[0], c[1])
        )
        best = baseline
        best_rate = best.rate(prefill) * (1 if any(best.budgets) else 1 + MIN_GAIN)  # what drafts must beat
        for w in range(1, max(cap, default=0) + 1):
            if fused:
                modes: tuple[str, ...] = ("fused",)
            else:  # splitting applies only if one drafting row keeps attention within a third of padded
                modes = ("padded", "split") if attention_queries(B, 1, 1 + w) < B * (1 + w) else ("padded",)
            for mode in modes:
                plan = self._fill(ranked, B, w, self.draft_cost * w, mode, limit, prefill, allowed)  # w deep
                rate = plan.rate(prefill)
                if rate > best_rate:
                    best, best_rate = plan, rate
        return best

    def _fill(
        self, ranked: list[tuple[float, int, int]], B: int, width: int, drafting: float, mode: str, limit: int | None,
        prefill: float, allowed: float,
    ) -> Plan:
        """Budgets from ``ranked`` (survival, depth, row) positions of depth <= ``width``, taken
        while each pays for its time (plus ``drafting`` seconds) and the pass stays within
        ``limit`` positions, with their expected tokens and predicted pass seconds. A position
        pays if it raises the expected tokens per second of the step: the pass and ``prefill``
        seconds (the step's prefill chunk, or 0 for the pass alone). Attention is priced as
        the pass will run it (``mode``): for the real queries only ("fused"), padded to
        ``width`` for every row ("padded", paid up front), or ``width`` queries for each row
        that drafts ("split"). The fixed cost of carrying drafts is paid up front too (width >
        0): no single position need cover it alone, and the returned figures, of the budgets as
        taken, say whether they did. Then the least likely positions go until the pass costs at
        most ``allowed`` seconds per expected token (the throughput floor,
        `_allowed_seconds_per_token`; inf for none)."""
        out, positions, expected = [0] * B, B, float(B)  # every row verifies its root and gains one token
        rows = 0  # rows drafting
        # `_seconds` unrolled, its terms that do not change with the positions taken summed once:
        # this runs for every position tried, in 9-16 widths and modes, twice a step
        attention, cost = self.attention_cost * self.context, self.cost
        fixed = drafting + (self.draft_overhead if width > 0 else 0.0)

        def pass_time(positions: int, rows: int) -> float:
            if mode == "fused":
                queries = positions
            elif mode == "split":
                queries = B + rows * width
            else:  # padded
                queries = B * (1 + width)
            return cost(positions) + attention * queries + fixed

        rate = expected / (pass_time(positions, rows) + prefill)
        taken: list[tuple[int, int]] = []  # (depth, row) in the order taken
        keep, kept = 0, (positions, expected, rows)  # the longest prefix of taken within the floor
        for s, k, b in ranked:
            if limit is not None and positions >= limit:
                break
            if k > width or k != out[b] + 1:
                continue
            seconds = pass_time(positions + 1, rows + (k == 1))
            new_rate = (expected + s) / (seconds + prefill)  # the whole step's
            if new_rate < rate:
                break  # the most likely remaining position no longer pays for its time
            out[b], positions, expected, rows, rate = k, positions + 1, expected + s, rows + (k == 1), new_rate
            taken.append((k, b))
            if seconds <= expected * allowed:
                keep, kept = len(taken), (positions, expected, rows)
        positions, expected, rows = kept  # the least likely positions past it go
        for k, b in taken[keep:]:
            out[b] = min(out[b], k - 1)
        return Plan(out, expected, self.pass_time(B, positions, rows, max(out, default=0), drafting))

    def _floor_reachable(
        self, B: int, survival: list[list[float]], cap: list[int], allowed: float, plain: float
    ) -> bool:
        """Whether any drafts could keep the pass within ``allowed`` seconds per expected token. A
        pass with n drafts costs at least no drafts' pass (B · ``plain``) + δ + proposing one deep
        + n · m, m being the curve's least slope past B plus one attention query (every mode runs
        at least one a draft), and yields B + the n drafts' survivals: the margin is largest with
        every draft whose survival s beats m / ``allowed``, each adding s · ``allowed`` − m.
        Where even that fails no width can keep a draft, and `_plan` (9-16 `_fill` runs) is
        skipped."""
        m = self.cost.min_slope(B) + self.attention_cost * self.context  # [s] the least a draft adds
        margin = B * (allowed - plain) - self.draft_overhead - self.draft_cost
        for b in range(B):
            for s in survival[b][: cap[b]]:
                if s * allowed <= m:
                    break  # a row's survival falls with depth
                margin += s * allowed - m
        return margin >= 0
