"""Continuous batching: requests join and leave between steps, over a paged KV cache.

Owns: the request queue, admission, chunked prefill, preemption by recompute, each
request's verification budget, and the step. Reuses the round itself (verify, commit,
stop rules) from engine/step.py, so a request decodes exactly as it would alone.
Does not own: who gets how many draft tokens under load (engine/budget.py and
engine/adaptive.py), the records it keeps and reports (engine/requests.py), or HTTP.

One step::

    admit waiting requests while rows and blocks allow (FIFO)
    prefill one chunk (the step's token budget less the decode round's positions; the request
        with the fewest prompt tokens left first, at most max_long_prefills long ones);
        a request whose prompt is done samples its first token and joins the decode batch
    one speculative round over the decode batch: propose → per-row budgets → one target
        pass → verify → commit (rejected slots' blocks go back to the pool)

With prefix caching (on by default), a request starts from the longest run of full blocks
that earlier requests computed for the same tokens (engine/prefix.py).

When the pool runs dry the newest running request is preempted: its blocks are freed
and it waits at the head of the queue to be recomputed from its tokens (vLLM's policy).
Nothing is failed for lack of blocks; a request that could never fit is refused at
`add_request`.
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from specdecode.cache.block_pool import OutOfBlocks
from specdecode.config import AutoSpec, SamplingParams, SpecConfig, SpecDecodeError, is_int
from specdecode.drafters.base import Draft, Drafter
from specdecode.engine.adaptive import AdaptiveBudget
from specdecode.core.batch import Batch
from specdecode.engine import prefix, processing
from specdecode.engine.budget import BudgetPolicy, FixedBudget, apply_budgets, shadow_chains
from specdecode.engine.cost import VerifyCost, clock, measure_attention_cost
from specdecode.engine.requests import EngineStats, Request, RequestEvent, check_prompt, parse_override
from specdecode.engine.prefill import Prefill
from specdecode.engine.step import Engine
from specdecode.engine.threads import ThreadTuner
from specdecode.model.cpu_block import MAX_POSITIONS
from specdecode.model.loader import LoadedModel
from specdecode.cache.paged_cache import PagedKVCache
from specdecode.cache.prefix_cache import PrefixCachingKVCache

DEFAULT_KV_BYTES = 256 << 20  # KV pool size when num_blocks is not given (at least one full sequence)


class ServingEngine(Prefill, Engine):
    """Requests join with `add_request`, leave when finished or on `abort`; `step` advances all."""

    def __init__(
        self,
        target: LoadedModel,
        spec: SpecConfig | AutoSpec | None,
        *,
        max_model_len: int,
        max_num_seqs: int = 8,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_batched_tokens: int = 256,
        max_long_prefills: int = 1,
        quantization: str | None = None,
        batch_invariant: bool | None = None,
        drafter: Drafter | None = None,
        budget: BudgetPolicy | None = None,
        enable_prefix_caching: bool = True,
        threads: int | None = None,
    ) -> None:
        super().__init__(target, spec, max_model_len, drafter, quantization, batch_invariant)
        if max_num_seqs < 1 or block_size < 1 or max_num_batched_tokens < 1 or max_long_prefills < 1:
            raise SpecDecodeError("max_num_seqs, block_size, max_num_batched_tokens and max_long_prefills must be >= 1")
        self.max_long_prefills = max_long_prefills
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A prefill chunk runs as passes of at most MAX_POSITIONS where the fused CPU block or our
        # row-invariant kernels run (model/cpu_block.py, model/invariant.py): they compute every
        # token alone, so a prompt's K/V do not depend on where chunks split it (a request resumed
        # after preemption recomputes exactly what it decoded), and the fused block beats the
        # torch blocks on passes that short.
        invariant = self.batch_invariant or self.model.fused_positions() > 0
        self.prefill_pass = min(MAX_POSITIONS, max_num_batched_tokens) if invariant else max_num_batched_tokens
        per_seq = -(-(max_model_len + self.round_room) // block_size)  # blocks one full sequence needs
        if num_blocks is None:
            cfg = target.config
            itemsize = self.model.embed.weight.element_size()
            block_bytes = 2 * cfg.num_layers * self.model.kv_heads * cfg.head_dim * block_size * itemsize
            num_blocks = max(per_seq, min(max_num_seqs * per_seq, DEFAULT_KV_BYTES // block_bytes))
        if num_blocks < per_seq:
            raise SpecDecodeError(
                f"{num_blocks} KV blocks of {block_size} cannot hold one sequence of max_model_len "
                f"{max_model_len} (+{self.round_room} for drafts): need {per_seq}"
            )
        self.prefix_caching = enable_prefix_caching
        cache_cls = PrefixCachingKVCache if enable_prefix_caching else PagedKVCache
        self.cache: PagedKVCache = self.model.new_paged_cache(num_blocks, block_size, cls=cache_cls)
        self.budget = budget or self._default_budget()
        self._shadows = True  # whether this drafter's proposals give shadow rounds (chains do)
        self.batch = Batch([], capacity=max_model_len, device=self.device)  # the decoding rows
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: dict[str, Request] = {}  # in batch row order
        self.num_preempted = 0
        self._arrivals = itertools.count()
        self.threads = self._thread_tuner(threads)

    def _default_budget(self) -> BudgetPolicy:
        opts = self.spec.budget if self.spec is not None else None
        if opts is None or not opts.adaptive:
            return FixedBudget(opts.max_verify_tokens if opts is not None else None)
        most = min(opts.max_verify_tokens or self.max_num_seqs * self.round_room, 512)
        most = min(most, self.cache.pool.num_free * self.cache.block_size)
        cost = VerifyCost.measure(self, max_positions=most)
        attention = measure_attention_cost(self)
        fused = self.model.fused_positions(self.batch_invariant)
        return AdaptiveBudget(cost, max(1, self.gamma), opts.max_verify_tokens, attention_cost=attention,
                              fused_positions=fused, throughput_floor=opts.throughput_floor)  # fmt: skip

    # ---- requests ----------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, spec_override: dict | None = None
    ) -> None:
        """Queue a request. Bad input raises `SpecDecodeError` (one line) and changes nothing."""
        if self._find(request_id) is not None:
            raise SpecDecodeError(f"request id {request_id!r} is already in use")
        vocab = self.target.config.vocab_size
        check_prompt(prompt_ids, params, vocab, self.max_model_len)
        gamma = parse_override(spec_override, self.gamma)
        seq = Batch.new_sequence(request_id, prompt_ids, params, self.device)
        processing.setup_sequence(seq, self.tokenizer, vocab, self.eos_ids)
        self.budget.forget(request_id)  # an id an ended request had: nothing of it carries over
        self.waiting.append(Request(request_id, seq, gamma, next(self._arrivals)))

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; its blocks go back at once. Unknown ids are ignored."""
        req = self._find(request_id)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.prefilling:
            self.prefilling.remove(req)
            self.cache.free_sequence(request_id)
        else:
            self._remove_running([request_id])

    def reset(self) -> None:
        """Drop every request and hand every block back, whatever state a failed step left the
        rows in (a drafter that raised while rows left the batch kept a row the engine had
        dropped, and every later step failed): the answer to an exception from `step`."""
        self.cache.free_all()  # also a sequence a step failed to register as prefilling
        self.running.clear()
        self.prefilling.clear()
        self.waiting.clear()
        self.batch.select_rows([])
        if self.drafter is not None:
            self.drafter.select_rows([])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def stats(self) -> EngineStats:
        pool, cache = self.cache.pool, self.cache
        return EngineStats(
            len(self.running), len(self.waiting), len(self.prefilling), self.num_preempted, pool.num_used,
            pool.num_blocks, getattr(cache, "queries", 0), getattr(cache, "hits", 0),
        )  # fmt: skip

    def _find(self, request_id: str) -> Request | None:
        if request_id in self.running:
            return self.running[request_id]
        return next((r for r in itertools.chain(self.prefilling, self.waiting) if r.request_id == request_id), None)

    # ---- the step ----------------------------------------------------------------------

    def _thread_tuner(self, threads: int | None) -> ThreadTuner | None:
        """``threads`` fixed, or None: where every pass runs our row-invariant kernels (whose
        outputs do not depend on the count), chosen step by step up to torch's count, the cores
        the process may use unless it set another (engine/threads.py); elsewhere torch's count."""
        if threads is not None:
            if not is_int(threads) or threads < 1:
                raise SpecDecodeError(f"threads must be an integer >= 1, got {threads!r}")
            torch.set_num_threads(threads)
            return None
        most = torch.get_num_threads()  # the cores allowed (torch's default), or what the process set
        return ThreadTuner(most) if self.device.type == "cpu" and self.batch_invariant and most > 1 else None

    @torch.inference_mode()
    def step(self) -> list[RequestEvent]:
        """Admit, prefill one chunk, run one round over the decode batch. Returns what changed."""
        if self.threads is not None:
            self.threads.apply()
        self._admit()
        if self.prefilling:
            wait = self._timed()
            start = clock(self.device, wait)
            events = self._prefill_chunk()
            self.budget.observe_prefill(clock(self.device, wait) - start)
        else:  # nothing to prefill: 0 s exactly (a timed no-op added the OS's pauses to the mean)
            events = []
            self.budget.observe_prefill(0.0)
        if self.running:
            if self.threads is not None:
                self.threads.begin()
            events += self._decode_round()
            if self.threads is not None:
                self.threads.end()
        return events

    def _timed(self) -> bool:
        """Whether the budget reads step times (a fixed one does not): on CUDA a timer then waits."""
        return not isinstance(self.budget, FixedBudget)

    def _decode_round(self) -> list[RequestEvent]:
        """One round over the decode batch: propose within the budgets → one target pass →
        verify → commit / roll back → the drafter's feedback → the budget observes."""
        ids = list(self.running)
        self.cache.set_batch(ids)
        self._reserve([self.round_room] * len(ids))  # may preempt rows of the batch
        if not self.running:
            return []
        reqs = list(self.running.values())
        wait = self._timed()  # on CUDA the timers wait for the device only if the budget reads them
        draft, draft_seconds, depth, shadow = self._propose(reqs, wait)
        start = clock(self.device, wait)
        v = self._verify_round(self.batch, self.cache, draft)  # target pass, verify, commit / roll back
        seconds = clock(self.device, wait) - start
        step_events = self._append_tokens(self.batch, v.out, v.num_accepted, v.num_draft, v.logprobs)
        if self.drafter is not None:
            self.drafter.on_verified(self.batch, v.num_accepted, v.aux_logits, v.hidden)
        self.budget.observe(reqs, v.num_accepted, v.num_draft, seconds, draft_seconds, depth, shadow, v.num_positions)
        events = [self._event(self.running[e.request_id], e.new_token_ids) for e in step_events]
        for req in reqs if self.prefix_caching else ():
            prefix.publish(self.cache, req)
        self._remove_running([r.request_id for r in reqs if r.seq.finish_reason is not None])
        return events

    def _propose(self, reqs: list[Request], wait: bool) -> tuple[Draft | None, float, int, torch.Tensor | None]:
        """The drafts each row verifies this step (None: none), the seconds proposing took, the
        depth proposed, and the chains for the budget's shadow rounds.

        Propose only if the budget would use drafts at all, were every row to find its γ, and no
        deeper than the longest budget (the model's depth: copies beside a model drafter go up to
        γ whatever it is, lookup.look_up). Where proposing is cheap (the budget looks past its
        budgets) and the step proposes for shadow rounds anyway, it proposes γ deep and plans
        once, on what it found (rather than planning before proposing too)."""
        gammas = torch.tensor([r.gamma for r in reqs], device=self.device)
        shadowing = self.drafter is not None and self._shadows and self.budget.propose_first()
        cheap = shadowing and self.budget.lookahead() > 0
        planned = None if cheap or self.drafter is None else self.budget.budgets(reqs, gammas)  # [B]
        want = self.gamma if cheap else int(planned.max()) if planned is not None else 0
        if not (want > 0 or shadowing):
            return None, 0.0, 0, None
        depth = min(want + self.budget.lookahead() if want else self.gamma, self.gamma)
        # drafts past a row's own plan come from scratch: its stream follows its own γ (Batch.draft_generators)
        capped = planned is not None and self.budget.plan_caps_proposal
        self.batch.draft_limits = planned.tolist() if capped else None
        start = clock(self.device, wait)
        proposed = self.drafter.propose(self.batch, depth)
        draft_seconds = clock(self.device, wait) - start
        # Plan again over what was actually proposed: a row that found nothing costs nothing, and
        # the drafter's evidence and confidences refine the estimates. Also where it proposed only
        # for the budget's shadow rounds: a proposal found with strong evidence may pay where the
        # estimate without it did not.
        limits = torch.minimum(proposed.num_tokens, gammas)
        if proposed.q is not None:  # a sampled row's length may follow its drafts (a confidence stop reads
            # q(d_k)): planned on it, d_k would be verified by its own q (lossy). Its plan takes γ; the stop,
            # which reads only earlier drafts, then cuts what is verified.
            limits = torch.where(self.batch.temperature > 0, gammas, limits)
        budgets = self.budget.budgets(reqs, limits, proposed)  # [B] >= 0
        draft = None
        if int(budgets.max()) > 0 or (want > 0 and not cheap and proposed.aux is not None):
            draft = apply_budgets(proposed, budgets)
        shadow = shadow_chains(proposed, self.batch)
        self._shadows = self._shadows and shadow is not None  # trees and a drafter's own acceptance rule give none
        return draft, draft_seconds, depth, shadow

    def _reserve(self, room: list[int], prefill: bool = False) -> None:
        """Reserve ``room`` past each current row's length, preempting the newest running
        requests until it fits (``prefill``: the current row is a prefilling request)."""
        while True:
            try:
                self.cache.reserve(room)
                return
            except OutOfBlocks:
                if not self.running:
                    raise  # admission keeps one full sequence's blocks free for the prefill
                self._preempt(max(self.running.values(), key=lambda r: r.arrival))
                if not prefill:  # the victim was a row of this batch
                    room = room[: len(self.running)]

    def _preempt(self, req: Request) -> None:
        self._remove_running([req.request_id])
        req.cached, req.features = 0, []
        self.waiting.appendleft(req)
        self.num_preempted += 1

    def _remove_running(self, request_ids: list[str]) -> None:
        """Finished, cancelled or preempted rows leave the batch, the drafter and the cache."""
        if not request_ids:
            return
        gone = set(request_ids)
        keep = [i for i, rid in enumerate(self.running) if rid not in gone]
        for rid in request_ids:
            self.cache.free_sequence(rid)
            del self.running[rid]
        if self.drafter is not None:
            self.drafter.select_rows(keep)
        self.batch.select_rows(keep)

    def _event(self, req: Request, new: list[int]) -> RequestEvent:
        seq = req.seq
        logprobs = seq.logprobs[len(seq.logprobs) - len(new) :] if seq.params.logprobs is not None else None
        first = len(seq.token_ids) - seq.num_prompt == len(new)  # the event of its first token
        prompt = (seq.prompt_logprobs or [None]) if first and seq.params.prompt_logprobs is not None else None
        return RequestEvent(  # the stats as of this event: a prefill's event comes before its step's decode round
            req.request_id, new, seq.finish_reason, seq.stats.snapshot(), seq.num_prompt,
            len(seq.token_ids) - seq.num_prompt, logprobs=logprobs, prompt_logprobs=prompt,
            num_cached_tokens=req.num_cached_tokens or 0,
        )  # fmt: skip
