"""Probes: how the adaptive budget (engine/adaptive.py) keeps speculation from switching off.

Owns: when a step that would verify no drafts drafts one token on a few rows instead, and
which rows. Estimates move only when drafts are tried, and the verify-cost curve is refitted
only from passes that carry drafts, so a budget stopped by a few early rejections, or by a
curve that priced drafts too high, would otherwise stay stopped for good.
"""

from __future__ import annotations

# After this many steps in a row without drafts, one step drafts a token on a few rows.
PROBE_EVERY = 16
# A probe drafts on one row in this many (at least one): the rows probed longest ago, likeliest
# first, so that successive probes reach every row (never past max_verify_tokens). It also shows what a
# bigger pass costs (the curve is fitted from the engine's passes): probes on too few rows
# leave a curve fitted on small passes only, which overprices drafts in a big batch, and the
# budgets stay at ~0.
PROBE_SHARE = 2
# Each probe after which the plans still find no drafts doubles the wait for the next, up to
# this many steps: under load, where no draft pays, frequent probes are a cost with nothing
# to show for it; a plan that drafts again brings the wait back to PROBE_EVERY.
PROBE_MAX = 128


class Probes:
    """The probe schedule and the rows each probe drafts on (by request id)."""

    def __init__(self, max_verify_tokens: int | None = None) -> None:
        self.max_verify_tokens = max_verify_tokens
        self.steps_without_drafts = 0
        self.every = PROBE_EVERY  # steps without drafts before the next probe
        self.probed = False  # whether the last planning was a probe
        self.last: dict[str, int] = {}  # request id -> the probe (count) that last drafted on it
        self.pick: set[str] | None = None  # this step's probe rows, chosen before the proposal

    def due(self, planned_drafts: bool) -> bool:
        """Whether this planning is a probe: its plan drafts nothing and the wait is over."""
        self.probed = not planned_drafts and self.steps_without_drafts >= self.every
        return self.probed

    def rows(self, ids: list[str], cap: list[int], survival: list[list[float]], final: bool) -> list[int]:
        """One row in PROBE_SHARE (at least one; a token on every row would double the pass, and never
        past max_verify_tokens): those probed longest ago, likeliest first. Chosen once a step: the
        planning on the proposal (``final``) keeps the rows the planning before it proposed for, and
        records them."""
        if self.pick is None:
            last = {i: self.last.get(i, -1) for i in ids}
            order = sorted((b for b in range(len(ids)) if cap[b] > 0), key=lambda b: (last[ids[b]], -survival[b][0]))
            room = len(ids) if self.max_verify_tokens is None else max(0, self.max_verify_tokens - len(ids))
            self.pick = {ids[b] for b in order[: min(max(1, len(ids) // PROBE_SHARE), room)]}
        rows = [b for b, i in enumerate(ids) if i in self.pick and cap[b] > 0]
        if final:  # finished requests are forgotten here
            count = 1 + max(self.last.values(), default=-1)
            self.last = {i: count if i in self.pick else self.last.get(i, -1) for i in ids}
            self.pick = None
        return rows

    def observe(self, drafted: bool) -> None:
        """After a step's pass: a probe that found no drafts paying doubles the wait; a plan that
        drafts resets it. Steps without drafts count even while shadow rounds teach acceptance:
        only a pass that carries drafts shows what drafting costs, and a verify-cost curve measured
        at load in a noisy moment (t(2) priced at 2 t(1)) otherwise kept a request from ever drafting."""
        self.pick = None
        if drafted:
            self.every = min(2 * self.every, PROBE_MAX) if self.probed else PROBE_EVERY
        self.steps_without_drafts = 0 if drafted else self.steps_without_drafts + 1
