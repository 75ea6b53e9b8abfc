"""The server's Prometheus metrics under vLLM's names: speculation counters by the deltas
each step adds, engine gauges, counters fed from the engine's running totals (preemptions,
prefix cache) by their increase only, the tokens/s window on an injected clock, finish reasons
and lossy requests, and separate registries for separate apps."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from specdecode.entrypoints.metrics import ServerMetrics


def samples(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def engine_stats(**kw) -> SimpleNamespace:
    base = dict(num_running=2, num_prefilling=1, num_waiting=4, kv_blocks_used=3, kv_blocks_total=12,
                num_preempted_total=0, prefix_cache_queries=0, prefix_cache_hits=0)  # fmt: skip
    return SimpleNamespace(**(base | kw))


def test_steps_add_their_deltas_and_gauges_follow_the_engine():
    now = [0.0]
    m = ServerMetrics("tiny", clock=lambda: now[0])
    m.observe_step(engine_stats(), [(1, 4, 3, [1, 1, 1, 0]), (2, 6, 1, [1])], new_tokens=6)
    now[0] = 2.0  # the window closes: 6 + 4 tokens over 2 s
    m.observe_step(engine_stats(num_preempted_total=2, prefix_cache_queries=10, prefix_cache_hits=8), [], 4)
    m.observe_step(engine_stats(num_preempted_total=3, prefix_cache_queries=10, prefix_cache_hits=8), [], 0)
    got = samples(m)
    assert got[("vllm:spec_decode_num_drafts_total", ())] == 3
    assert got[("vllm:spec_decode_num_draft_tokens_total", ())] == 10
    assert got[("vllm:spec_decode_num_accepted_tokens_total", ())] == 4
    per_pos = {k[1][0][1]: v for k, v in got.items() if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 2, "1": 1, "2": 1}  # a position with nothing accepted has no sample
    assert got[("vllm:generation_tokens_total", ())] == 10
    assert got[("vllm:num_requests_running", ())] == 3 and got[("vllm:num_requests_waiting", ())] == 4
    assert got[("vllm:kv_cache_usage_perc", ())] == 0.25
    assert got[("vllm:num_preemptions_total", ())] == 3  # running totals 2 then 3: counted once each
    assert (got[("vllm:prefix_cache_queries_total", ())], got[("vllm:prefix_cache_hits_total", ())]) == (10, 8)
    assert got[("specdecode:generation_tokens_per_second", ())] == 5.0


def test_finished_requests_by_reason_and_lossy_ones_apart():
    m = ServerMetrics("tiny")
    m.observe_admitted(7)
    m.observe_finished("stop", 0.3)
    m.observe_finished("length", 1.2, lossy=True)
    m.observe_finished("stop", 0.1)
    got = samples(m)
    assert got[("vllm:prompt_tokens_total", ())] == 7
    assert got[("vllm:request_success_total", (("finished_reason", "stop"),))] == 2
    assert got[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert got[("specdecode:lossy_requests_total", ())] == 1
    assert got[("vllm:e2e_request_latency_seconds_count", ())] == 3


def test_two_apps_keep_their_own_counts():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.observe_admitted(5)
    assert samples(a)[("vllm:prompt_tokens_total", ())] == 5 and samples(b)[("vllm:prompt_tokens_total", ())] == 0
    assert 'model_name="a"' in a.render().decode()
