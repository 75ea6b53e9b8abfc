"""Prometheus metrics of the server, under vLLM's names so its dashboards work unchanged.

Owns: one `ServerMetrics` per app on its own `CollectorRegistry` (several apps can live in
one process, as in the tests), and what is recorded when: speculation counters and engine
gauges after each engine step (engine thread), request latency, time to first token and
finish reasons when a request ends (event loop). prometheus-client is thread-safe.
Does not own: serving the text (entrypoints/server.py) or computing the statistics.

Names: vLLM v1's, with its ``vllm:`` prefix and ``model_name`` label, e.g.
``vllm:spec_decode_num_drafts_total`` and ``vllm:spec_decode_num_accepted_tokens_per_pos_total
{position="0"}``; ours, with no vLLM counterpart, take ``specdecode:``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
RATE_WINDOW_S = 1.0  # the tokens/s gauge is refreshed at most this often


class ServerMetrics:
    """Every metric of one server. Call `observe_step` from the engine thread only."""

    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, label = self.registry, ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, label, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, label, registry=r).labels(model_name)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Verification rounds that checked at least one draft token.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
            ["model_name", "position"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.lossy_requests = counter("specdecode:lossy_requests",
                                      "Requests decoded with a lossy opt-in (typical acceptance).")  # fmt: skip
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted (to be recomputed) for lack of KV blocks.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=r)  # fmt: skip
        self.e2e_latency = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                                     label, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token.",
                              label, buckets=TTFT_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.running = gauge("vllm:num_requests_running", "Requests being prefilled or decoded.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued for admission (the queue length).")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.kv_blocks_used = gauge("specdecode:kv_blocks_used", "KV-cache blocks in use.")
        self.kv_blocks_total = gauge("specdecode:kv_blocks_total", "KV-cache blocks in the pool.")
        self.tokens_per_s = gauge("specdecode:generation_tokens_per_second",
                                  f"Generated tokens per second over the last ~{RATE_WINDOW_S:g} s.")  # fmt: skip
        self.model_name = model_name
        self._last_preempted = self._last_queries = self._last_hits = 0
        self.clock = clock  # the tokens/s window's (injectable: tests count steps, not seconds)
        self._rate_start, self._rate_tokens = clock(), 0

    # -- engine thread --------------------------------------------------------------------

    def observe_step(self, stats: Any, spec_deltas: list[tuple[int, int, int, list[int]]], new_tokens: int) -> None:
        """After a step: engine gauges, and what the step added to the speculation counters.

        ``spec_deltas`` holds (drafts, draft tokens, accepted tokens, accepted by position)
        per request that changed; ``stats`` is the engine's `EngineStats`.
        """
        for drafts, draft_tokens, accepted, per_pos in spec_deltas:
            self.num_drafts.inc(drafts)
            self.num_draft_tokens.inc(draft_tokens)
            self.num_accepted_tokens.inc(accepted)
            for pos, n in enumerate(per_pos):
                if n:
                    self._per_pos.labels(self.model_name, str(pos)).inc(n)
        self.generation_tokens.inc(new_tokens)
        self.observe_engine(stats, new_tokens)

    def observe_engine(self, stats: Any, new_tokens: int = 0) -> None:
        self.running.set(stats.num_running + stats.num_prefilling)  # as vLLM: prefilling requests run too
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        if stats.num_preempted_total > self._last_preempted:
            self.preemptions.inc(stats.num_preempted_total - self._last_preempted)
            self._last_preempted = stats.num_preempted_total
        queries, hits = getattr(stats, "prefix_cache_queries", 0), getattr(stats, "prefix_cache_hits", 0)
        if queries > self._last_queries:
            self.prefix_queries.inc(queries - self._last_queries)
            self.prefix_hits.inc(hits - self._last_hits)
            self._last_queries, self._last_hits = queries, hits
        self._rate_tokens += new_tokens
        now = self.clock()
        if now - self._rate_start >= RATE_WINDOW_S:
            self.tokens_per_s.set(self._rate_tokens / (now - self._rate_start))
            self._rate_start, self._rate_tokens = now, 0

    # -- event loop -----------------------------------------------------------------------

    def observe_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_finished(self, finish_reason: str, latency_s: float, lossy: bool = False) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        if lossy:
            self.lossy_requests.inc()
        self.e2e_latency.observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
