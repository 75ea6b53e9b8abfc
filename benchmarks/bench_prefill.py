"""Prefill under load and alone: fair chunked prefill against first-come-first-served, and
prefill tokens/s against llama.cpp.

**Mixed load.** Closed loops of C clients (``--clients``) on the default model, greedy,
``--max-tokens`` new tokens, one request in four with a long prompt (``--long-tokens``, from
standard-library source text) and the others short chat questions; prefix caching off, so
every prompt is computed. Two engines over one loaded model, stepped in turns so that the
machine's noise falls on both alike (load.py), each with a KV pool that holds every client's
request (so no request waits for blocks): *first come* prefills the oldest prompt first,
in chunks of the step's token budget, so a short prompt that arrives behind a long one waits
for all of its chunks; *fair* (the engine's policy) gives the budget to the prompts with
the fewest tokens left first, at most one long prompt at a time. Reported: p50 and p99 time
to first token of the short prompts, of the long ones, and output throughput.

**Prefill alone.** A ``--prompt-tokens`` prompt, time to its first token (max_tokens 1, so
almost all of it prefill), ours against llama.cpp (llama-cpp-python, when installed) on the
same GGUF file, alternated ``--repeats`` times; prefix caching off for ours, and llama.cpp's
own cache reset before each run.

    python benchmarks/bench_prefill.py [--threads 2] [--clients 4 16] [--results docs/results.md]
"""

from __future__ import annotations

import inspect
import json
import statistics
import time

import torch
from args import out_path, positive_int, run, write_results
from load import ClosedLoop, Recording, run_loads

from specdecode import LLM, SamplingParams
from specdecode.engine.serving import ServingEngine
from specdecode.entrypoints.cli import OneLineParser
from specdecode.model.packaged import default_model_path

SHORT = [
    "What is the capital of France?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Name a prime number larger than 10.",
    "What colour is the sky on a clear day?",
    "Translate 'good morning' into Spanish.",
]


class FirstCome(ServingEngine):
    """Prefill in arrival order: the oldest prompt takes the step's budget first."""

    def _prefill_order(self):
        return list(self.prefilling)


def source_tokens(llm: LLM, n: int, offset: int = 0) -> list[int]:
    """``n`` tokens of standard-library source (a different stretch for each ``offset``)."""
    import argparse
    import email.message
    import json.decoder

    text = "\n".join(inspect.getsource(m) for m in (argparse, email.message, json.decoder))
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    start = (offset * 997) % max(1, len(ids) - n)
    return ids[start : start + n]


def mix(llm: LLM, long_tokens: int) -> list[tuple[str, list[int]]]:
    out = []
    for i in range(12):
        if i % 4 == 0:
            text = "Summarize what this code does:\n\n"
            prompt = llm.tokenize(text) + source_tokens(llm, long_tokens, i)
            out.append(("long", prompt))
        else:
            out.append(("short", llm.encode_chat(SHORT[i % len(SHORT)])))
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def mixed_load(llm: LLM, clients: int, requests: int, max_tokens: int, long_tokens: int) -> dict:
    loops = {}
    for name, cls in (("first come", FirstCome), ("fair", ServingEngine)):
        # a KV pool that holds every client's request: admission never waits for blocks, so the
        # short prompts' wait is the prefill order's alone
        blocks = clients * -(-(long_tokens + 64 + 64) // 16)
        engine = cls(llm.target, None, max_model_len=long_tokens + 64, max_num_seqs=clients, num_blocks=blocks,
                     max_long_prefills=clients if cls is FirstCome else 1, enable_prefix_caching=False)  # fmt: skip
        engine.budget = Recording(engine.budget)
        loops[name] = ClosedLoop(engine, mix(llm, long_tokens), clients, requests, max_tokens)
    results = dict(zip(loops, run_loads(list(loops.values()))))
    out = {}
    for name, loop in loops.items():
        ttft = {k: [loop.first[r] - loop.submit[r] for r in loop.first if loop.kind[r] == k] for k in ("short", "long")}
        out[name] = {
            "ttft_short_p50": percentile(ttft["short"], 0.5), "ttft_short_p99": percentile(ttft["short"], 0.99),
            "ttft_long_p50": percentile(ttft["long"], 0.5), "ttft_long_p99": percentile(ttft["long"], 0.99),
            "throughput": results[name]["throughput"], "preempted": loop.engine.stats().num_preempted_total,
        }  # fmt: skip
    return out


def prefill_alone(llm: LLM, n: int, threads: int, repeats: int) -> dict:
    prompt = source_tokens(llm, n, 7)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    ours: list[float] = []
    theirs: list[float] = []
    try:
        from llama_cpp import Llama

        cpp = Llama(model_path=str(default_model_path()), n_ctx=n + 64, n_threads=threads, n_threads_batch=threads,
                    n_batch=512, verbose=False)  # fmt: skip
    except ImportError:
        cpp = None
        print("llama-cpp-python is not installed: llama.cpp is left out", flush=True)
    llm.generate([prompt[:64]], params)  # warm
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], params)
        ours.append(n / (time.perf_counter() - start))
        if cpp is not None:
            cpp.reset()
            start = time.perf_counter()
            cpp.eval(prompt)
            theirs.append(n / (time.perf_counter() - start))
    out = {"prompt_tokens": n, "ours": statistics.median(ours), "ours_all": ours}
    if theirs:
        out |= {"llama.cpp": statistics.median(theirs), "llama.cpp_all": theirs}
    return out


def main() -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--clients", type=positive_int, nargs="+", default=[4, 16])
    parser.add_argument("--requests-per-client", type=positive_int, default=3)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--long-tokens", type=positive_int, default=2000)
    parser.add_argument("--prompt-tokens", type=positive_int, default=1700)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--json", type=out_path, default=None)
    parser.add_argument("--results", type=out_path, default=None, help="write the tables into this results page")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(enable_prefix_caching=False, max_model_len=max(args.long_tokens, args.prompt_tokens) + 64)
    loads = {}
    for clients in args.clients:
        requests = max(8, args.requests_per_client * clients)
        loads[clients] = mixed_load(llm, clients, requests, args.max_tokens, args.long_tokens)
        print(json.dumps({clients: loads[clients]}), flush=True)
    alone = prefill_alone(llm, args.prompt_tokens, args.threads, args.repeats)
    print(json.dumps(alone), flush=True)
    lines = ["| clients | prefill order | short TTFT p50 (s) | short TTFT p99 (s) | long TTFT p50 (s) | "
             "long TTFT p99 (s) | throughput (tok/s) | preempted |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for clients, rows in loads.items():
        for name, r in rows.items():
            lines.append(f"| {clients} | {name} | {r['ttft_short_p50']:.2f} | {r['ttft_short_p99']:.2f} | "
                         f"{r['ttft_long_p50']:.2f} | {r['ttft_long_p99']:.2f} | {r['throughput']:.1f} | "
                         f"{r['preempted']} |")  # fmt: skip
        ratio = rows["fair"]["throughput"] / rows["first come"]["throughput"]
        lines.append(f"| {clients} | fair / first come | | | | | {ratio:.2f}× | |")
    prefill = [f"Prefill of a {alone['prompt_tokens']}-token prompt (median of {args.repeats}, {args.threads} "
               f"threads): ours {alone['ours']:.0f} tokens/s"]  # fmt: skip
    if "llama.cpp" in alone:
        prefill.append(f"llama.cpp {alone['llama.cpp']:.0f} tokens/s ({alone['ours'] / alone['llama.cpp']:.2f}×)")
    body = "\n".join(lines) + "\n\n" + ", ".join(prefill) + "."
    print(body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loads": loads, "prefill": alone}, f, indent=1)
    if args.results:
        note = (f"Closed loops, default model, greedy, {args.max_tokens} new tokens, one request in four with a "
                f"{args.long_tokens}-token prompt, prefix caching off; time to first token (TTFT) per prompt kind.")  # fmt: skip
        write_results(args.results, "prefill", f"## Fair chunked prefill\n\n{note}\n\n{body}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
