"""The adaptive verification budget: per-request draft lengths that shrink smoothly with load.

Owns: the adaptive policy (engine/budget.py's protocol) and the measured verify-cost curve
it plans with. It follows the seed's last section (DSpark's design). Each request keeps
an estimate c_k of the chance that its k-th draft token survives given that the ones
before it did; a block of k tokens survives with probability s_k = c_1 · … · c_k, and
a step that verifies P positions costs t(P), measured on the hardware it runs on. Starting from no
drafts at all, the scheduler adds draft positions in order of s (the most likely to
survive first) while the expected tokens per second of pass, (B + Σ s) / t(P), still rise:
the throughput optimum, taken if it beats no drafts by MIN_GAIN. Below the compute/bandwidth
threshold t(P) is flat and every useful position is kept; past it each extra position must
pay for itself, so budgets shrink smoothly, per request, down to 0; speculation is never
switched off wholesale. A ``throughput_floor`` φ below 1 then trades throughput for
per-user speed: positions go on being added while the step's own rate, (B + Σ s) / (t(P) + f),
still rises, f being the prefill the step carries (it runs a chunk of a joining request's
prompt just before its decode round), as long as the rows keep φ of the optimum's
predicted throughput. Where c_k comes from (acceptance counts by request state, shadow
rounds, their calibration) is engine/acceptance.py's.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from specdecode.config import BudgetOptions
from specdecode.drafters.base import Draft
from specdecode.engine.acceptance import AcceptanceStats
from specdecode.engine.cost import PassLog, VerifyCost, clock
from specdecode.engine.planner import MIN_GAIN, Plan, PositionSearch
from specdecode.engine.probes import Probes, Rest
from specdecode.model.masks import attention_queries


# Steps where no row drafts still propose, for shadow rounds, while proposing them and
# planning on the proposal cost at most this share of the time spent in verify passes that
# carried drafts, and this share over the rows of those that did not (proposing for a busy
# batch is a few percent of its pass, and the second planning costs as much again). Under
# load no draft pays and shadows change no budget, so a share of every pass would be paid for
# nothing; charged to the rows that did not draft, they stay cheap there. At one row the
# shares are equal, and there a shadow step also saves the planning before the proposal.
SHADOW_SHARE = 0.01
# Proposals whose median cost per depth is the drafter's: a change of cost shows after half of
# them, a stall not at all (a running mean that took in one stalled proposal would stop
# drafting for a long time: with drafting off it is barely updated).
DRAFT_COST_WINDOW = 15
# Weight of each step in the running mean of the prefill seconds a step carries (about the
# last 32 steps): chunks come in bursts as requests join. Also the weight of each proposal
# made before planning in the running means of what planning on it saved and what it cost.
PREFILL_DECAY = 1 / 32


class AdaptiveBudget(PositionSearch):
    """Per-request budgets that maximise expected accepted tokens per unit of step time.

    Raw confidences come from ``self.acceptance`` (engine/acceptance.py: online estimates,
    calibrated by Sequential Temperature Scaling), or, for greedy rows and deterministic
    drafters, from the drafter's own estimates where its proposal carries them.
    """

    plan_caps_proposal = False  # a proposal's evidence may earn a row more than its plan

    def __init__(
        self,
        cost: VerifyCost,
        max_gamma: int,
        max_verify_tokens: int | None = None,
        refit_every: int = 64,
        window: int = 2048,  # rounds STS is fitted from (the cost curve's passes: cost.PASS_WINDOW)
        attention_cost: float = 0.0,
        fused_positions: int = 0,
        throughput_floor: float = BudgetOptions.throughput_floor,
    ) -> None:
        self.cost = cost
        self.throughput_floor = throughput_floor  # share of the throughput optimum's throughput the budgets keep
        self.max_verify_tokens = max_verify_tokens
        self.acceptance = AcceptanceStats(max_gamma, refit_every, window)
        # seconds of shadow proposing earned (SHADOW_SHARE of each pass, see there) less spent; never above 0,
        # so time unused while rows drafted is not spent all at once later
        self.shadow_allowance = 0.0
        # A step plans without a proposal and proposes only if drafts would pay, unless it
        # proposes first (`shadow`). But a proposal shows evidence (an ngram's match length)
        # that planning without one averages over: planned that way, most steps can plan no
        # drafts and so never propose. These running means, over the steps that
        # proposed first (an unbiased sample), compare the pass seconds planning on the proposal
        # saved (its expected tokens at no drafts' cost a token, less its predicted pass) with
        # what proposing and that planning cost; while savings win, every step proposes first.
        self.proposal_saved = 0.0
        self.proposal_cost = 0.0
        self.proposing_first = False  # this step proposes first because proposals pay (not charged to shadows)
        self.planned_first = False  # this step planned before proposing (its proposal is no sample)
        self.passes = PassLog()  # the engine's latest passes, which the curve is refitted from
        # seconds per attention query and context token (measured at load, see
        # measure_attention_cost), each query priced at the longest context. The torch blocks
        # pad attention to the widest draft (or split it, model.masks.attention_queries); the
        # fused CPU block (passes of at most ``fused_positions``, model/cpu_block.py; 0 where it
        # does not run) computes the real queries only. A batch that fits is planned to stay
        # within it: in the torch blocks every row pays attention for the widest row's drafts.
        self.attention_cost = attention_cost
        self.fused_positions = fused_positions
        # seconds any pass that carries drafts pays beyond its positions (packing the linears'
        # rows, the masks, verifying): fitted from the engine's passes, drafting or not
        self.draft_overhead = 0.0
        self.context = 1  # the longest row's tokens at the last planning: attention's length
        self.draft_cost = 0.0  # seconds proposing costs per draft depth (the drafter's c, in seconds)
        self.draft_costs: list[float] = []  # the latest DRAFT_COST_WINDOW of them, measured
        self.probes = Probes(max_verify_tokens)  # drafts on a few rows after steps without any (never off)
        self.rest = Rest()  # steps that reuse a plan made before proposing which found no drafts
        self.plan_seconds = 0.0  # the last planning on a proposal: a shadow step's cost with its proposing
        # seconds of prefill the step being planned carries: its chunk ran just before its
        # decode round. Below a floor of 1 it is part of the step time the budgets maximise
        # tokens per unit of (`_plan`): under load a step is mostly other requests' prompts,
        # so a likely draft token costs a small
        # share of the step and shortens its request's life. Prefill work per output token is
        # fixed, though, so throughput is set by the pass alone, and the floor is a share of the
        # throughput optimum's. The step's own chunk, not a running mean: prompts come in bursts
        # as requests join, and at one client a decode step carries none.
        # Neither extreme works: with no floor the step drafts deep and gives up throughput to
        # per-user speed; held to no drafts' throughput, it spends the likely tokens' surplus on
        # unlikely ones.
        self.step_prefill = 0.0
        # the prefill a step carries, a running mean over steps (about the last 32): with
        # `tokens_per_step`, the prefill work per output token the throughput floor charges
        self.prefill_seconds = 0.0
        # tokens the steps emit, a running mean with the same weights: prefill per output token is
        # their ratio. Per row instead, it grew as rows drafted (the same prompts spread over fewer
        # steps), and so did the pass time the floor allowed a token: below a floor of 1 the
        # budgets fed their own allowance.
        self.tokens_per_step = 0.0

    def propose_first(self) -> bool:
        # kept for `observe`: a step proposing first because proposals pay is not charged to shadows
        self.proposing_first = self.proposal_saved > self.proposal_cost
        return self.proposing_first or self.shadow_allowance >= 0

    def forget(self, request_id: str) -> None:
        self.acceptance.per_request.pop(request_id, None)  # its counts, state and any shadow in flight
        self.probes.last.pop(request_id, None)

    def observe_prefill(self, seconds: float) -> None:
        if not math.isfinite(seconds):  # a broken clock
            return
        self.step_prefill = seconds
        self.prefill_seconds += PREFILL_DECAY * (seconds - self.prefill_seconds)

    def lookahead(self) -> int:
        """One token past the budgets while proposing a token costs at most SHADOW_SHARE of the
        last pass (ngram, suffix; not a learned drafter's extra step): without it, a depth the
        budgets never reach is never learned, and a request copying its input for hundreds of
        tokens kept its first depth (engine/acceptance.py `_extended`)."""
        last = self.passes.last_seconds
        return int(last is not None and self.draft_cost <= SHADOW_SHARE * last)

    def budgets(
        self, reqs: list[Any], limits: torch.Tensor, proposal: Draft | None = None
    ) -> torch.Tensor:
        start = clock(limits.device)
        B = len(reqs)
        if B == 0:
            return limits.new_zeros(0)
        cap = limits.tolist()
        rest = self._rest_key(reqs, cap) if proposal is None else None
        if self.rest.skip(rest):  # the step's bookkeeping as its plan would have done it
            self.acceptance.planned(reqs, self.rest.raw, None)
            self._planned(None, 0.0, start, limits.device)
            return limits.new_zeros(B)
        self.context = max((len(r.seq.token_ids) for r in reqs), default=1)
        evidence = proposal.evidence if proposal is not None else None
        if not any(cap):  # no row may draft (nothing was proposed): no plan to search
            return self._no_plan(reqs, limits, proposal, start)
        raw = self.acceptance.confidence_rows([r.request_id for r in reqs], evidence=evidence)  # B rows of γ
        confidence = proposal.confidence if proposal is not None else None
        if confidence is not None:  # the drafter's own estimates (a head's, or its draft probabilities)
            w = min(self.acceptance.gamma, confidence.shape[1])
            head = confidence[:, :w].float().cpu().clamp(1e-4, 1 - 1e-4).tolist()
            # Only where the drafts are a function of the context (greedy rows, or a drafter with a
            # one-hot q): a sampled row's confidences follow its sampled drafts (q(d_k) itself, or a
            # head fed d_<k), and a plan that keeps d_j by them verifies a token no longer drawn
            # from q_j, which the rejection rule assumes (lossy). Those rows plan on the online estimates.
            drawn = proposal.q is not None
            raw = [row if drawn and r.seq.params.temperature > 0  # NaN: the drafter has no estimate of that token
                   else [e if math.isnan(c) else c for c, e in zip(h, row)] + row[w:]
                   for h, row, r in zip(head, raw, reqs)]  # fmt: skip
        self.acceptance.planned(reqs, raw, evidence)
        survival = self.acceptance.sts.survival_rows(raw)
        if proposal is None:  # before proposing: a draft token survives only where a proposal holds one
            found = self.acceptance.found_rates([r.request_id for r in reqs])
            survival = [[f * x for x in row] for f, row in zip(found, survival)]
        fused = B <= self.fused_positions
        limit = self.max_verify_tokens
        if fused:
            limit = self.fused_positions if limit is None else min(limit, self.fused_positions)
        plain = self._seconds(B, B, 0.0, carries_drafts=False) / max(1, B)  # no drafts' pass seconds a token
        # First the throughput optimum: the most expected tokens per second of pass, by MIN_GAIN
        # over no drafts (every prompt is prefilled once whatever the budgets, so the pass alone
        # sets throughput). Under load most steps skip the search: no draft can meet the margin.
        best = Plan([0] * B, float(B), B * plain)
        if self._floor_reachable(B, survival, cap, plain / (1 + MIN_GAIN), plain):
            best = self._plan(survival, cap, B, fused, limit, 0.0, math.inf, best)
        out = best.budgets
        if self.throughput_floor < 1:  # then trade from it for the step's own rate (per-user speed)
            allowed = self._allowed_seconds_per_token(best.seconds / best.expected)
            if self._floor_reachable(B, survival, cap, allowed, plain):
                out = self._plan(survival, cap, B, fused, limit, self.step_prefill, allowed, best).budgets
        if proposal is None:
            self.rest.planned(rest, any(out), raw)
        if self.probes.due(any(out)):  # a probe: see whether drafts pay again, one token on a few rows
            for b in self.probes.rows([r.request_id for r in reqs], cap, survival, final=proposal is not None):
                out[b] = 1
        self._planned(proposal, best.expected * plain - best.seconds, start, limits.device)  # 0 for no drafts
        return torch.tensor(out, dtype=torch.long, device=limits.device)

    def _rest_key(self, reqs: list[Any], cap: list[int]) -> tuple | None:
        """What a plan before proposing for ``reqs`` within ``cap`` reads, but the context and
        the running means (see Rest); None where the step must plan: a probe is due, or the step
        carries a prefill chunk."""
        if self.probes.steps_without_drafts >= self.probes.every or self.step_prefill > 0:
            return None
        ids = [r.request_id for r in reqs]
        settings = (self.attention_cost, self.fused_positions, self.max_verify_tokens, self.throughput_floor)
        # the draft cost by its power of 2: a median of the latest proposals moves at every one
        draft_cost = math.floor(math.log2(self.draft_cost)) if self.draft_cost > 0 else None
        learned = (self.acceptance.version, self.cost, self.draft_overhead, draft_cost)
        return (*ids, *cap, *self.acceptance.states(ids), *learned, *settings)

    def _no_plan(self, reqs: list[Any], limits: torch.Tensor, proposal: Draft | None, start: float) -> torch.Tensor:
        """`budgets` where no row may draft: no plan to search, only the step's bookkeeping. The
        raw confidences are recorded only if a row's proposal may start a shadow round (rows
        whose γ is 0); a round needs drafts."""
        evidence = proposal.evidence if proposal is not None else None
        found = proposal is not None and bool((proposal.tokens >= 0).any())
        ids = [r.request_id for r in reqs]
        raw = self.acceptance.confidence_rows(ids, evidence=evidence) if found else [[] for _ in reqs]
        self.acceptance.planned(reqs, raw, evidence)
        if self.probes.due(False):  # no row to probe, but the step's probe pick is settled
            self.probes.rows(ids, [0] * len(reqs), [], final=proposal is not None)
        self._planned(proposal, 0.0, start, limits.device)
        return limits.new_zeros(len(reqs))

    def _planned(self, proposal: Draft | None, saved: float, start: float, device: torch.device) -> None:
        """After planning: whether the step planned before proposing, or (on a proposal) the
        planning's seconds and the running mean of what planning on proposals saved."""
        if proposal is None:
            self.planned_first = True
            return
        self.plan_seconds = clock(device) - start
        if not self.planned_first:  # proposed first: what planning on the proposal saved
            self.proposal_saved += PREFILL_DECAY * (saved - self.proposal_saved)

    def _allowed_seconds_per_token(self, best: float) -> float:
        """Pass seconds an expected token may cost so that the rows keep ``throughput_floor`` of
        the throughput optimum's throughput (``best``: its pass seconds per expected token).
        Prefill work per output token is fixed (every prompt is prefilled once), so a token's
        share of the wall time is that plus its share of the pass; likely positions pay for
        less likely ones."""
        prefill = self.prefill_seconds / self.tokens_per_step if self.tokens_per_step > 0 else 0.0
        return (prefill + best) / self.throughput_floor - prefill

    def pass_time(self, B: int, positions: int, rows: int, widest: int, drafting: float) -> float:
        """Predicted seconds of a step's pass: over ``positions`` (linears), attention for B rows
        of which ``rows`` draft up to ``widest`` deep, and ``drafting``."""
        queries = self._queries(B, rows, widest, positions)
        return self._seconds(positions, queries, drafting, carries_drafts=rows > 0)

    def _queries(self, B: int, rows: int, widest: int, positions: int) -> int:
        """The attention queries of a pass as it will run: each real one in the fused CPU block,
        else the batch padded to its widest draft, or split (model.masks.attention_queries)."""
        return positions if positions <= self.fused_positions else attention_queries(B, rows, 1 + widest)

    def _seconds(self, positions: int, queries: int, drafting: float, carries_drafts: bool) -> float:
        """The cost model: linears by positions, attention by queries × the longest context,
        proposing, and the fixed cost of a pass that carries drafts (the step's prefill aside)."""
        overhead = self.draft_overhead if carries_drafts else 0.0
        return self.cost(positions) + self.attention_cost * queries * self.context + drafting + overhead

    def observe(
        self, reqs: list[Any], num_accepted: torch.Tensor, num_draft: torch.Tensor, seconds: float, draft_seconds: float,
        draft_depth: int = 1, proposal: torch.Tensor | None = None, positions: int | None = None,
    ) -> None:  # fmt: skip
        timed = math.isfinite(seconds) and math.isfinite(draft_seconds)  # else a broken clock: no times learnt
        accepted, drafts = num_accepted.tolist(), num_draft.tolist()  # one device read each
        if timed:
            self._observe_cost(len(reqs), drafts, seconds, positions)
        tokens = len(reqs) + sum(accepted)  # each row's accepted drafts and its one new token
        self.tokens_per_step += PREFILL_DECAY * (tokens - self.tokens_per_step)
        drafted = any(drafts)
        if timed and draft_seconds > 0 and not self.planned_first:  # proposed first: what that cost
            cost = draft_seconds + self.plan_seconds
            self.proposal_cost += PREFILL_DECAY * (cost - self.proposal_cost)
        if timed:  # proposing, and planning on the proposal, on a step that verified nothing: shadows
            shadows = not (drafted or draft_seconds == 0 or self.proposing_first)
            spent = draft_seconds + self.plan_seconds if shadows else 0.0
            earned = SHADOW_SHARE * seconds / (1 if drafted else max(1, len(reqs)))
            self.shadow_allowance = min(0.0, self.shadow_allowance + earned - spent)
        self.plan_seconds, self.planned_first, self.proposing_first = 0.0, False, False
        self.probes.observe(drafted)
        if timed and draft_seconds > 0:  # what proposing costs per draft depth (DRAFT_COST_WINDOW)
            self.draft_costs.append(draft_seconds / max(1, draft_depth))
            del self.draft_costs[:-DRAFT_COST_WINDOW]
            self.draft_cost = statistics.median(self.draft_costs)
        rows = proposal.tolist() if proposal is not None else None
        self.acceptance.observe(reqs, accepted, drafts, rows)

    def _observe_cost(self, rows: int, num_draft: list[int], seconds: float, positions: int | None = None) -> None:
        """Log the pass (positions, attention queries · context, whether it carried drafts, its
        seconds) and refit the step time from the window of them (engine/cost.py `fit_passes`).
        ``positions``: a tree pass's nodes (and aux branch); by default rows + drafts."""
        drafting, widest = sum(d > 0 for d in num_draft), max(num_draft, default=0)
        if positions is None:
            positions = rows + sum(num_draft)
        else:  # a tree: its rows are padded to their widest node count, at least this
            widest = max(widest, -(-positions // max(1, rows)) - 1)
        padded = self._queries(rows, drafting, widest, positions) * self.context
        fit = self.passes.add((positions, padded, drafting > 0, seconds), self.attention_cost)
        if fit is None:  # no refit due
            return
        cost, overhead = fit
        self.cost = cost or self.cost
        if overhead is not None:
            self.draft_overhead = overhead
