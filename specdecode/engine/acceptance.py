"""Online acceptance estimates: how likely each request's next draft tokens are to survive.

Owns: the counts of rounds that reached and accepted each draft position, per request and
shared by all, by the request's state; shadow rounds; the rounds recorded for Sequential
Temperature Scaling, and its refits. Does not own: turning the estimates into budgets
(engine/adaptive.py plans with them).

c_k is conditioned on the request's last round: acceptance comes in runs (with ngram on
input-reuse prompts, the first token after a fully accepted round is nearly always
accepted; after a round where ngram found nothing, far less often). A lookup drafter's
proposal right after it found nothing is a fresh match, a copy of text the row was not
following; one after a rejection continues a source the row was just copying, so the two
are counted apart (the first survives far more often after a rejection). Rows that
verify no drafts still teach it through shadow rounds: when a row's proposal is cut to
0, the tokens it then generates show whether the proposal would have been accepted. For
a one-hot q (ngram, suffix, any greedy row) the target generates d_k with probability
p(d_k), exactly the chance that d_k is accepted: a shadow round is distributed as a real one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from specdecode.engine.calibration import Rounds, SequentialTemperatureScaling

PRIOR_STRENGTH = 4.0  # pseudo-rounds of the shared estimate behind a request's own counts
SHARED_PRIOR = 1.0  # pseudo-rounds behind a shared estimate: position 1's at 1/2, position k's at k - 1's
EVIDENCE_PRIOR = 4.0  # pseudo-rounds of a state's shared estimate behind its counts with one evidence
FOUND_DECAY = 1 / 32  # weight of each proposal in the running means of how often one finds a draft
# A request's state: its drafter found nothing last step, or it has had no round yet
# (AFTER_NOTHING); its last round rejected a token (AFTER_MISS); or its last round accepted
# every draft token, or its shadow round has matched every token so far (AFTER_FULL).
AFTER_NOTHING, AFTER_MISS, AFTER_FULL = 0, 1, 2
STATES = 3
NOT_SHADOWED = -2  # a proposal row whose matching is not acceptance (see budget.shadow_chains)


@dataclasses.dataclass
class _RequestRounds:
    """One request's rounds (real and shadow) by state and position, its state, and the
    shadow round it has in flight: (tokens before it, its draft tokens, state, evidence and raw c)."""

    reached: list[list[float]]  # [state][k]: rounds that reached draft position k
    accepted: list[list[float]]  # [state][k]: ... and accepted it
    state: int = AFTER_NOTHING
    shadow: tuple[int, list[int], int, int | None, torch.Tensor] | None = None

    @staticmethod
    def empty(gamma: int) -> _RequestRounds:
        return _RequestRounds([[0.0] * gamma for _ in range(STATES)], [[0.0] * gamma for _ in range(STATES)])


class AcceptanceStats:
    """Raw confidences c_k from acceptance statistics (a request's own counts by state and
    position, shrunk towards the counts shared by all requests in that state; real and
    shadow rounds alike), and their calibration: STS refitted on the most recent ``window``
    rounds, every ``refit_every`` steps that learned from a round once an eighth of them is new."""

    def __init__(self, max_gamma: int, refit_every: int = 64, window: int = 2048) -> None:
        self._shared: list[list[float]] | None = None  # _shared_rows until a round changes the counts
        self.version = 0  # rounds recorded and calibrations fitted: what changes the estimates but states
        # by state, running means of whether a row's proposal held any draft token: c_k is the chance
        # of a token given a proposal, and a lookup drafter finds none on most steps of new text
        self.found = [1.0] * STATES
        # shared counts by state and position: rounds that reached position k, and accepted it
        self._reached = torch.zeros(STATES, max_gamma)
        self._accepted = torch.zeros(STATES, max_gamma)
        # shared counts by state and the drafter's evidence (Draft.evidence): (reached, accepted) by k
        self.by_evidence: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
        self.per_request: dict[str, _RequestRounds] = {}
        self.sts = SequentialTemperatureScaling(max_gamma)
        self.refit_every, self.window = refit_every, window
        self.records: list[tuple[list[float], int, int]] = []  # (raw [γ], drafted, accepted)
        self._since_fit = 0  # steps that learned from a round since the last fit
        self._new_records = 0  # rounds recorded since the last fit
        self._raw: dict[str, list[float]] = {}  # the raw confidences each row was planned with
        self._lengths: dict[str, int] = {}  # tokens each row held when it was last planned
        self._evidence: dict[str, int] = {}  # the evidence each row was planned with, where it had one

    @property
    def reached(self) -> torch.Tensor:
        return self._reached

    @reached.setter
    def reached(self, counts: torch.Tensor) -> None:
        self._reached, self._shared, self.version = counts, None, self.version + 1

    @property
    def accepted(self) -> torch.Tensor:
        return self._accepted

    @accepted.setter
    def accepted(self, counts: torch.Tensor) -> None:
        self._accepted, self._shared, self.version = counts, None, self.version + 1

    @property
    def gamma(self) -> int:
        return self.reached.shape[1]

    def confidence(self, request_id: str) -> torch.Tensor:
        """[γ] raw c_k: the estimated chance draft token k survives given tokens 1..k-1 did."""
        return self.confidences([request_id])[0]

    def shared(self) -> torch.Tensor:
        """[STATES, γ] c_k shared by all requests, by state. Each position's counts are shrunk towards
        the estimate of the position before it (the first towards 1/2): c_k is conditional on
        the earlier tokens surviving and changes slowly with k, so a position no round has
        reached yet gets its predecessor's estimate, not a flat 1/2. Budgets can then grow past
        the depth first tried: with a flat prior, a row whose first tokens nearly always survive
        stays at the depth it reached, as the next position's 1/2 never pays."""
        return torch.tensor(self._shared_rows())

    def _shared_rows(self) -> list[list[float]]:
        if self._shared is not None:  # planning reads it up to twice a step; most steps record no round
            return self._shared
        rows = []  # in Python floats: tensor ops per position would dominate the planning
        for accepted, reached in zip(self.accepted.tolist(), self.reached.tolist()):
            prior, row = 0.5, []
            for a, r in zip(accepted, reached):
                prior = (a + SHARED_PRIOR * prior) / (r + SHARED_PRIOR)
                row.append(prior)
            rows.append(row)
        self._shared = rows
        return rows

    def confidences(self, request_ids: list[str], own: bool = True, evidence: list[int] | None = None) -> torch.Tensor:
        """[B, γ] raw c_k (`confidence_rows`, as a tensor)."""
        return torch.tensor(self.confidence_rows(request_ids, own, evidence)).reshape(len(request_ids), self.gamma)

    def confidence_rows(
        self, request_ids: list[str], own: bool = True, evidence: list[int] | None = None
    ) -> list[list[float]]:
        """[B, γ] raw c_k for several requests at once, each in its state: its own counts shrunk
        to the shared ones (``own=False``: the shared ones alone). With the drafter's
        ``evidence`` for each row's proposal, the shared estimate is first refined by the rounds
        that had the same state and evidence (shrunk to the state's estimate: a pair few rounds
        had keeps it). Own counts are by state alone: a request has too few rounds to split. In
        Python floats, as `shared`: at one client the tensor version was a third of the planning."""
        shared = self._shared_rows()
        rows = []
        for b, rid in enumerate(request_ids):
            mine = self.per_request.get(rid)
            state = mine.state if mine is not None else AFTER_NOTHING
            prior = shared[state]
            counts = self.by_evidence.get((state, evidence[b])) if evidence is not None else None
            if counts is not None:
                prior = [(a + EVIDENCE_PRIOR * c) / (r + EVIDENCE_PRIOR) for r, a, c in zip(*counts, prior)]
            if mine is None or not own:  # no round yet: its own counts are zeros
                rows.append(prior)
                continue
            own_counts = zip(mine.accepted[state], mine.reached[state], prior)
            rows.append([(a + PRIOR_STRENGTH * c) / (r + PRIOR_STRENGTH) for a, r, c in own_counts])
        return rows

    def found_rates(self, request_ids: list[str]) -> list[float]:
        """For each request, how often a proposal in its state has held any draft token."""
        return [self.found[state] for state in self.states(request_ids)]

    def states(self, request_ids: list[str]) -> tuple[int, ...]:
        """Each request's state (AFTER_NOTHING before its first round)."""
        rounds = self.per_request
        return tuple(rounds[i].state if i in rounds else AFTER_NOTHING for i in request_ids)

    def planned(self, reqs: list[Any], raw: list[list[float]], evidence: list[int] | None = None) -> None:
        """Remember what each row was planned with (raw, B rows of γ, the drafter's evidence)
        and its length then: the step's rounds are recorded against them, and a shadow round
        starts after that length."""
        ids = [r.request_id for r in reqs]
        self._raw = dict(zip(ids, raw))
        self._lengths = {r.request_id: len(r.seq.token_ids) for r in reqs}
        self._evidence = dict(zip(ids, evidence)) if evidence is not None else {}

    def observe(
        self, reqs: list[Any], num_accepted: list[int], num_draft: list[int], proposal: list[list[int]] | None
    ) -> None:
        """Record the step's real rounds, settle and start shadow rounds, forget finished
        requests and refit STS when due (counted in steps that recorded a round, real or
        shadow). ``proposal``: the rows' proposed chains (see BudgetPolicy.observe)."""
        rows = proposal if proposal is not None else [None] * len(reqs)
        learned = False
        for req, a, d, row in zip(reqs, num_accepted, num_draft, rows):
            rid = req.request_id
            mine = self.per_request.get(rid)
            if mine is None:  # not setdefault: that would build an empty record per row per step
                mine = self.per_request[rid] = _RequestRounds.empty(self.gamma)
            pending, state = mine.shadow is not None, mine.state
            learned |= self._settle_shadow(req, mine, verified=d > 0)
            if row is not None and (not row or row[0] != NOT_SHADOWED):
                self.found[state] += FOUND_DECAY * ((bool(row) and row[0] >= 0) - self.found[state])
            if d > 0:
                drafted, accepted = self._extended(req, row, d, a)
                self._record(mine, mine.state, self._evidence.get(rid), self._raw.get(rid), drafted, accepted)
                mine.state, learned = AFTER_FULL if accepted == drafted else AFTER_MISS, True
            elif row is not None and (not row or row[0] != NOT_SHADOWED):  # [] when no row found a draft
                chain = row[: row.index(-1)] if -1 in row else row
                if not chain:
                    mine.state = AFTER_NOTHING  # the drafter found nothing: a run of copied text, if any, ended
                elif not pending and rid in self._raw:  # one at a time, none reusing a settled one's tokens
                    mine.shadow = (self._lengths[rid], chain, mine.state, self._evidence.get(rid), self._raw[rid])
        live = {r.request_id for r in reqs if r.seq.finish_reason is None}
        if len(self.per_request) > len(live):  # finished or cancelled
            self.per_request = {k: v for k, v in self.per_request.items() if k in live}
        del self.records[: -self.window]
        # Refit every refit_every steps, not rows: with 32 rows a row count would refit every
        # other step, and the fit costs about as much as the planning itself. And only once an
        # eighth of the window is new: a fit runs over the full window, so at one row (a round a
        # step) refitting on a step count alone would refit on mostly the same rounds.
        self._since_fit += learned
        if self._since_fit >= self.refit_every and self._new_records >= len(self.records) // 8:
            self.sts = SequentialTemperatureScaling(self.gamma).fit(self.rounds())
            self.version += 1
            self._since_fit = self._new_records = 0

    def _extended(self, req: Any, row: list[int] | None, d: int, a: int) -> tuple[int, int]:
        """A real round of ``a`` accepted of ``d`` drafts as (drafted, accepted), one position
        longer where the step shows it: if every draft was accepted and the proposal went on
        past the budget, the token the target generated next (the bonus) is the one a round of
        d + 1 drafts would have accepted or not (one-hot q, or a greedy row: the same event)."""
        if a < d or d >= self.gamma or row is None or row[0] == NOT_SHADOWED or len(row) <= d or row[d] < 0:
            return d, a
        at = self._lengths.get(req.request_id, -1) + d  # the bonus token's index
        tokens = req.seq.token_ids
        if not 0 <= at < len(tokens):  # the row stopped before a bonus token
            return d, a
        return d + 1, d + int(tokens[at] == row[d])

    def _settle_shadow(self, req: Any, mine: _RequestRounds, verified: bool) -> bool:
        """Record ``mine``'s shadow round once the tokens its row generated show a miss or the
        whole chain, or the row finished or verified drafts this step (a round cut short, at
        the tokens generated before this step's pass: the real round covers the rest), and set
        the request's state from it. While every token so far matched, the request is as after
        a fully accepted round: a row copying text its shadow followed stayed 'after nothing'
        for up to γ steps (c_1 0.44 against 0.96; at 4 clients, 0.62 drafts a row where
        γ = 2 drafted 0.76, kept at the same rate). True if a round was recorded."""
        if mine.shadow is None:
            return False
        start, chain, state, evidence, raw = mine.shadow
        end = self._lengths.get(req.request_id, start) if verified else len(req.seq.token_ids)
        made = req.seq.token_ids[start : min(start + len(chain), end)]
        n = next((k for k, (t, m) in enumerate(zip(chain, made)) if t != m), len(made))
        settled = n < len(made) or len(made) == len(chain)  # a miss, or the whole chain generated
        if not (settled or verified or req.seq.finish_reason is not None):
            if n > 0:
                mine.state = AFTER_FULL
            return False
        mine.shadow = None
        if not made:
            return False
        self._record(mine, state, evidence, raw, len(chain) if settled else len(made), n)
        if not verified:  # a real round sets it from its own tokens
            mine.state = AFTER_FULL if n == len(made) else AFTER_MISS
        return True

    def _record(
        self, mine: _RequestRounds, state: int, evidence: int | None, raw: list[float] | None, drafted: int,
        accepted: int,
    ) -> None:  # fmt: skip
        """One round (real or shadow): ``accepted`` of ``drafted`` tokens, from ``state``, its
        proposal found with ``evidence`` (None: the drafter gave none)."""
        if raw is not None:
            self.records.append((raw, drafted, accepted))
            self._new_records += 1
        reached = min(accepted + 1, drafted)  # positions 1..a were accepted; a+1 was tried and rejected
        for k in range(reached):
            mine.reached[state][k] += 1
        for k in range(accepted):
            mine.accepted[state][k] += 1
        self._reached[state, :reached] += 1
        self._accepted[state, :accepted] += 1
        self._shared = None
        self.version += 1
        if evidence is not None:
            counts = self.by_evidence.setdefault((state, evidence), ([0.0] * self.gamma, [0.0] * self.gamma))
            for k in range(reached):
                counts[0][k] += 1
            for k in range(accepted):
                counts[1][k] += 1

    def rounds(self) -> Rounds:
        """The recorded rounds, as STS fits them."""
        if not self.records:
            return Rounds(torch.empty(0, self.gamma), torch.empty(0, dtype=torch.long), torch.empty(0))
        raw, drafted, accepted = zip(*self.records)
        return Rounds(torch.tensor(raw).reshape(-1, self.gamma), torch.tensor(drafted), torch.tensor(accepted))

    def calibration_error(self) -> tuple[float, float]:
        """ECE of block survival before and after STS: fitted on the older half of the recorded
        rounds, measured on the newer half (held out)."""
        rounds = self.rounds()
        half = rounds.raw.shape[0] // 2
        fit = Rounds(rounds.raw[:half], rounds.drafted[:half], rounds.accepted[:half])
        test = Rounds(rounds.raw[half:], rounds.drafted[half:], rounds.accepted[half:])
        sts = SequentialTemperatureScaling(self.gamma).fit(fit)
        return sts.survival_ece(test, calibrated=False), sts.survival_ece(test)
