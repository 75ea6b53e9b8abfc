"""Probes and rests: when the adaptive budget (engine/adaptive.py) plans at all.

Owns: when a step that would verify no drafts drafts one token on a few rows instead, and
which rows (`Probes`). Estimates move only when drafts are tried, and the verify-cost curve is refitted
only from passes that carry drafts, so a budget stopped by a few early rejections, or by a
curve that priced drafts too high, would otherwise stay stopped for good. And when a step
may skip planning whether to propose (`Rest`): where nothing repeats, that planning finds
no drafts step after step, and its cost is most of what speculation adds to a plain step.
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
        # a probe whose proposal held no token has nothing to show: the next waits its turn (not
        # the next step: on text with nothing to copy that proposed on every step)
        self.steps_without_drafts = 0 if drafted or self.probed else self.steps_without_drafts + 1
        self.probed = False  # a step that does not plan (Rest) is no probe


# The longest run of steps that reuse a plan which found no drafts (see Rest).
REST_MAX = 8


class Rest:
    """Plans made before proposing that later steps may reuse. After one that found no drafts,
    the next 1, 2, 4, ... up to REST_MAX steps plan nothing and propose nothing, for as long
    as what the plan read is unchanged (``key``: the rows and their γ, their acceptance states
    and counts, the cost curve, the draft cost within a factor of 2). What the key leaves out
    moves the plan little in so few steps: the context grows by a token a row (each draft's
    attention costs more, so drafts pay less), running means move by 1/32 a step. A probe
    that falls due, or a prefill chunk in the step, plans as usual (the budget gives no key
    then)."""

    def __init__(self) -> None:
        self.key: tuple | None = None  # what the last plan that found no drafts read
        self.wait = 0  # steps it covers
        self.left = 0  # of which not yet used
        self.raw: list[list[float]] = []  # the raw confidences it planned with

    def skip(self, key: tuple | None) -> bool:
        """Whether this step reuses the last plan (and so drafts nothing, nor proposes)."""
        if key is None or key != self.key or self.left == 0:
            return False
        self.left -= 1
        return True

    def planned(self, key: tuple | None, drafts: bool, raw: list[list[float]]) -> None:
        """A plan was made on ``raw`` confidences (``drafts``: whether it drafts, probes aside);
        with no drafts under ``key``, the following steps may reuse it. A step that had to plan
        (no key: a probe, a prefill chunk) leaves the rest as it was."""
        if key is None and not drafts:
            return
        if drafts:
            self.key, self.wait, self.left = None, 0, 0
            return
        self.wait = min(2 * self.wait, REST_MAX) if key == self.key and self.wait else 1
        self.key, self.left, self.raw = key, self.wait, raw
