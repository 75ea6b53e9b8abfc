"""Suffix decoding behind Ray Serve replicas, with and without session affinity.

Agents repeat their work (the same prompts, over and over: bench_suffix.py's workload), and a
suffix drafter drafts from what its own replica has answered before. One server, then 2
replicas with session affinity, then 2 without (each request to the less loaded of two at
random), on a local Ray cluster; each configuration answers every prompt ``--reps`` times in
turn. Printed per configuration: acceptance α (accepted / reached draft tokens over all
requests), τ, and tokens/s (sequential requests, end to end through HTTP).

    python benchmarks/bench_replicas.py [--reps 4] [--prompts 10] [--max-tokens 64] [--results docs/results.md]
"""

from __future__ import annotations

import argparse
import socket
import time

import httpx
from args import out_path, positive_int, run, write_results
from bench_suffix import PROMPTS

from specdecode.entrypoints.deploy import build_app as build

CONFIGS = {"1 replica": (1, True), "2 replicas, affinity": (2, True), "2 replicas, no affinity": (2, False)}


def measure(base: str, reps: int, prompts: list[str], max_tokens: int) -> dict:
    reached = accepted = drafts = tokens = 0
    seconds = 0.0
    model = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
    for _ in range(reps):
        for prompt in prompts:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0}  # fmt: skip
            start = time.perf_counter()
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
            seconds += time.perf_counter() - start
            r.raise_for_status()
            u = r.json()["usage"]
            reached, accepted = reached + u["num_reached_tokens"], accepted + u["num_accepted_tokens"]
            drafts, tokens = drafts + u["num_drafts"], tokens + u["completion_tokens"]
    return {"alpha": accepted / max(reached, 1), "tau": 1 + accepted / max(drafts, 1), "tokens_per_s": tokens / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=positive_int, default=4)
    parser.add_argument("--prompts", type=positive_int, default=10)
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--results", type=out_path, default=None, help="write the table into this results page")
    args = parser.parse_args()
    apps = {label: build(dict(speculative_config={"method": "suffix"}, threads=1, replicas=replicas,
                              session_affinity=affinity)) for label, (replicas, affinity) in CONFIGS.items()}  # fmt: skip
    import ray
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = ["| configuration | α | τ | tokens/s |", "|---|---|---|---|"]
    try:
        for label, app in apps.items():
            serve.run(app, name="bench", route_prefix="/")
            r = measure(f"http://127.0.0.1:{port}", args.reps, PROMPTS[: args.prompts], args.max_tokens)
            rows.append(f"| {label} | {r['alpha']:.2f} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} |")
            print(rows[-1], flush=True)
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    body = "\n".join(rows)
    print(body)
    if args.results:
        note = (f"Default model, suffix decoding, greedy, {args.prompts} chat prompts answered {args.reps} times in "
                f"turn, {args.max_tokens} new tokens, one request at a time through HTTP; each replica 1 thread, on a "
                "local Ray cluster (Ray Serve). Without affinity a prompt's repeats land on either replica.")  # fmt: skip
        write_results(args.results, "replicas", f"## Replicas on Ray Serve\n\n{note}\n\n{body}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
