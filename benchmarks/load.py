"""The closed-loop load generator of benchmarks/bench_serving.py, and the policy recorder.

Owns: `Recording` (wraps an engine's budget policy: each step's budgets and outcome, and the
confidences an `AdaptiveBudget` planned with, for calibration), `ClosedLoop` (one
configuration's clients on its own clock) and `run_loads` (several loops stepped so that the
machine's noise falls on all of them alike), and merging repeated runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from specdecode.config import SamplingParams
from specdecode.engine.adaptive import AdaptiveBudget
from specdecode.engine.budget import BudgetPolicy
from specdecode.engine.serving import ServingEngine

# ---- recording the budget policy ---------------------------------------------------------


@dataclass
class StepRecord:
    rows: int
    budget: int  # Σ of the policy's per-row budgets (before the drafter)
    drafted: int  # Σ of the draft tokens actually verified
    width: int  # widest row's draft (the pass runs rows + their drafts through the linears)
    accepted: int


@dataclass
class Calibration:
    """(predicted, observed) pairs per drafted position, for the prior and the online estimate."""

    cond_prior: list[tuple[float, int]] = field(default_factory=list)  # c_k vs accepted given 1..k-1 were
    cond_online: list[tuple[float, int]] = field(default_factory=list)
    surv_prior: list[tuple[float, int]] = field(default_factory=list)  # s_k = c_1···c_k vs position k accepted
    surv_online: list[tuple[float, int]] = field(default_factory=list)
    # s_1 of rows that were given a budget but drafted nothing count as (s_1, 0): what planning sees
    plan_prior: list[tuple[float, int]] = field(default_factory=list)
    plan_online: list[tuple[float, int]] = field(default_factory=list)


CALIBRATION_EVERY = 4  # steps: the calibration pairs are a sample (recording every step would slow the run it measures)


class Recording:
    """Wraps the engine's budget policy: records each step's budgets and outcome, and for
    `AdaptiveBudget` the confidence it planned with (shared prior and per-request)."""

    def __init__(self, inner: BudgetPolicy) -> None:
        self.inner = inner
        self.steps: list[StepRecord] = []
        self.calib = Calibration()
        self.passes: list[tuple[int, float]] = []  # each verify pass: positions, seconds
        self._budgets: list[int] = []
        self._planned: dict[str, tuple[list[float], list[float]]] = {}
        self._evidence: list[int] | None = None  # the drafter's evidence the step was planned with

    def budgets(self, reqs, limits, proposal=None):
        out = self.inner.budgets(reqs, limits, proposal)
        self._budgets = out.tolist()
        self._evidence = proposal.evidence if proposal is not None else None
        return out

    def observe_prefill(self, seconds):
        self.inner.observe_prefill(seconds)

    def forget(self, request_id):
        self.inner.forget(request_id)

    @property
    def plan_caps_proposal(self) -> bool:
        return self.inner.plan_caps_proposal

    def propose_first(self):
        return self.inner.propose_first()

    def lookahead(self):
        return self.inner.lookahead()

    def observe(self, reqs, num_accepted, num_draft, seconds, draft_seconds, draft_depth=1, proposal=None,
                positions=None):  # fmt: skip
        drafting = len(self._budgets) == len(reqs) and (any(self._budgets) or int(num_draft.sum()) > 0)
        if isinstance(self.inner, AdaptiveBudget) and drafting and len(self.steps) % CALIBRATION_EVERY == 0:
            # the confidences the step was planned with (nothing has changed them since): read
            # once a step here, not on each of the engine's planning calls, only where a row
            # was given drafts (no other row makes a pair), and on one step in CALIBRATION_EVERY,
            # so that the recording costs the adaptive runs as little as it can
            ids = [r.request_id for r in reqs]
            acceptance, evidence = self.inner.acceptance, self._evidence
            prior = acceptance.confidences(ids, own=False, evidence=evidence).tolist()  # batched calls
            online = acceptance.confidences(ids, evidence=evidence).tolist()
            self._planned = {r.request_id: (p, c) for r, p, c in zip(reqs, prior, online)}
        self.passes.append((len(reqs) + int(num_draft.sum()) if positions is None else positions, seconds))
        acc, drafted = num_accepted.tolist(), num_draft.tolist()
        budget = sum(self._budgets) if len(self._budgets) == len(reqs) else 0
        self.steps.append(StepRecord(len(reqs), budget, sum(drafted), max(drafted, default=0), sum(acc)))
        budgets = self._budgets if len(self._budgets) == len(reqs) else [0] * len(reqs)
        for req, a, d, given in zip(reqs, acc, drafted, budgets):
            planned = self._planned.get(req.request_id)
            if planned is None or (d == 0 and given == 0):
                continue
            for conf, pairs_c, pairs_s, pairs_plan in (
                (planned[0], self.calib.cond_prior, self.calib.surv_prior, self.calib.plan_prior),
                (planned[1], self.calib.cond_online, self.calib.surv_online, self.calib.plan_online),
            ):
                if d == 0:
                    pairs_plan.append((conf[0], 0))
                s = 1.0
                for k in range(d):
                    s *= conf[k]
                    pairs_s.append((s, int(k < a)))
                    pairs_plan.append((s, int(k < a)))
                    if k <= a:  # position k+1 was reached: tokens 1..k were accepted
                        pairs_c.append((conf[k], int(k < a)))
        self._planned, self._budgets = {}, []
        self.inner.observe(reqs, num_accepted, num_draft, seconds, draft_seconds, draft_depth, proposal, positions)


def ece(pairs: list[tuple[float, int]], bins: int = 10) -> float:
    """Expected calibration error: Σ_bins (n_bin / n) · |mean predicted − mean observed|."""
    if not pairs:
        return float("nan")
    groups: dict[int, list[tuple[float, int]]] = {}
    for p, y in pairs:
        groups.setdefault(min(int(p * bins), bins - 1), []).append((p, y))
    return sum(len(g) * abs(statistics.fmean(p for p, _ in g) - statistics.fmean(y for _, y in g))
               for g in groups.values()) / len(pairs)  # fmt: skip


# ---- the load generator ----------------------------------------------------------------


class ClosedLoop:
    """One configuration's closed loop: ``clients`` requests in flight, each finished one
    replaced at once, timed on its own clock (the seconds spent in its own submissions and
    engine steps), so that several loops can be stepped in turn (`run_loads`)."""

    def __init__(self, engine: ServingEngine, mix, clients: int, num_requests: int, max_tokens: int) -> None:
        if clients < 1 or num_requests < 1:  # no client would submit, or no request would finish: no result
            raise ValueError(f"a closed loop needs clients >= 1 and num_requests >= 1, got {clients}, {num_requests}")
        self.engine, self.mix, self.clients, self.num_requests = engine, mix, clients, num_requests
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.policy: Recording = engine.budget
        self.first_step, self.first_pass = len(self.policy.steps), len(self.policy.passes)
        self.submit, self.first, self.finish, self.n_out, self.stats, self.kind = {}, {}, {}, {}, {}, {}
        self.next_req, self.in_flight, self.clock = 0, 0, 0.0

    def done(self) -> bool:
        return self.next_req >= self.num_requests and not self.engine.has_unfinished()

    def advance(self) -> None:
        """Top the clients up, then one engine step."""
        t0 = time.perf_counter()
        while self.in_flight < self.clients and self.next_req < self.num_requests:
            rid = f"r{self.next_req}"
            self.kind[rid], prompt = self.mix[self.next_req % len(self.mix)]
            self.engine.add_request(rid, prompt, self.params)
            self.submit[rid] = self.clock + time.perf_counter() - t0
            self.next_req += 1
            self.in_flight += 1
        start = self.clock
        events = self.engine.step()
        self.clock += time.perf_counter() - t0
        for e in events:
            if e.new_token_ids and e.request_id not in self.first:
                # when the event was made (e.at), on this loop's clock: a request's first token comes
                # out of the prefill, before the same step's decode round, whose tokens its decode
                # rate counts (timing it at the step's end credited that round to the prefill)
                self.first[e.request_id] = start + (e.at - t0)
            if e.finish_reason is not None:
                self.finish[e.request_id], self.n_out[e.request_id] = self.clock, e.num_output_tokens
                self.stats[e.request_id] = e.stats
                self.in_flight -= 1

    def result(self) -> dict:
        submit, first, finish, n_out, kind = self.submit, self.first, self.finish, self.n_out, self.kind
        stats = self.stats
        wall = self.clock
        steps = self.policy.steps[self.first_step :]
        drafts = sum(s.num_drafts for s in stats.values())
        accepted = sum(s.num_accepted_tokens for s in stats.values())
        reached = sum(s.num_reached_tokens for s in stats.values())  # α's denominator: drafts verification decided on
        rows = sum(s.rows for s in steps)
        passes = self.policy.passes[self.first_pass :]
        # per-user speed by prompt kind: speculation may speed one kind up and slow another down
        by_kind = {
            f"per_user[{k}]": statistics.fmean(n_out[r] / (finish[r] - submit[r]) for r in finish if kind[r] == k)
            for k in sorted(set(kind.values()))
        }
        return by_kind | {
            "clients": self.clients,
            "requests": self.num_requests,
            "output_tokens": sum(n_out.values()),
            "wall_s": wall,
            "throughput": sum(n_out.values()) / wall,
            "per_user_e2e": statistics.fmean(n_out[r] / (finish[r] - submit[r]) for r in finish),
            "per_user_decode": statistics.fmean(
                (n_out[r] - 1) / (finish[r] - first[r]) for r in finish if n_out[r] > 1 and finish[r] > first[r]
            ),
            "ttft_s": statistics.fmean(first[r] - submit[r] for r in first),
            "tau": 1 + accepted / drafts if drafts else 1.0,
            "alpha": accepted / reached if reached else 0.0,
            "budget_per_row": sum(s.budget for s in steps) / max(rows, 1),
            "drafted_per_row": sum(s.drafted for s in steps) / max(rows, 1),
            "positions_per_step": statistics.fmean(s.rows + s.drafted for s in steps) if steps else 0.0,
            "rows_per_step": rows / max(len(steps), 1),
            "decode_steps": len(steps),
            "pass_ms": 1e3 * statistics.fmean(t for _, t in passes) if passes else 0.0,
            "pass_share": sum(t for _, t in passes) / wall,  # of the wall time, in verify passes
            "passes": list(passes),
        }


def run_loads(loops: list[ClosedLoop], pair: str = "clock") -> list[dict]:
    """Run the loops together until all are done, one engine step at a time, each on its own
    clock, so that the machine's noise (which drifts over seconds: consecutive runs of one
    configuration alone can differ by a third) falls on all of them alike.
    ``pair="clock"``: the next step is the loop whose clock is behind, so every stretch of the
    run's wall time holds the same share of each loop's own time. ``"steps"``: the loops step
    in turn; one that needs fewer steps (speculation) then spends its time in the run's early
    part and finishes first, and the others run their last stretch without it."""
    while not all(loop.done() for loop in loops):
        if pair == "clock":
            min((loop for loop in loops if not loop.done()), key=lambda loop: loop.clock).advance()
            continue
        for loop in loops:
            if not loop.done():
                loop.advance()
    return [loop.result() for loop in loops]


def run_load(engine: ServingEngine, mix, clients: int, num_requests: int, max_tokens: int) -> dict:
    """One configuration's closed loop, alone."""
    return run_loads([ClosedLoop(engine, mix, clients, num_requests, max_tokens)])[0]


def merge_runs(runs: list[dict]) -> dict:
    """Repetitions of one configuration at one load as one: throughput over all their tokens
    and wall time, per-request and per-step figures averaged over the runs."""
    merged = {k: statistics.fmean(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, float)}
    tokens, wall = sum(r["output_tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    merged.update(clients=runs[0]["clients"], requests=sum(r["requests"] for r in runs), output_tokens=tokens,
                  wall_s=wall, throughput=tokens / wall, passes=[p for r in runs for p in r["passes"]],
                  decode_steps=sum(r["decode_steps"] for r in runs), repeats=len(runs))  # fmt: skip
    return merged
