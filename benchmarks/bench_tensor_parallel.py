"""Tensor parallelism against one process: tokens/s of plain and speculative decoding, side by side.

The same model whole in this process and split over N ranks (the others spawned: gloo on
CPU, NCCL with one GPU each on CUDA), run in alternating order on the same prompts; greedy
outputs are checked identical. On a CPU with few cores the split model is expected to be
slower (each rank gets a share of the cores and every layer waits on two all-reduces); the
figure that matters there is correctness, speed on GPUs.

    python benchmarks/bench_tensor_parallel.py [--size 3] [--device cpu] [--results docs/results.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

from args import device, out_path, positive_int, run, write_results

from specdecode import LLM, SamplingParams

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Repeat this list back, one item per line: apples, pears, plums, cherries, figs, dates.",
    "Explain in three sentences what a hash table is.",
]


def tokens_per_s(llm: LLM, prompt: list[int], params: SamplingParams, speculative: bool) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = llm.generate([prompt], params, speculative=speculative)[0]
    return len(out.token_ids) / (time.perf_counter() - start), out.token_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or alias (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--size", type=positive_int, default=3, help="ranks of the split model (default 3: it must divide the heads, 9 and 3 kv on the default model)")
    parser.add_argument("--device", type=device, default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--results", type=out_path, default=None, help="write the table into this results page")
    args = parser.parse_args()
    common = dict(model=args.model, dtype=args.dtype, device=args.device, quantization="none",
                  speculative_config={"method": "ngram"})  # a split model cuts float weights: both run them
    llms = {1: LLM(**common), args.size: LLM(**common, tensor_parallel_size=args.size)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = [llms[1].encode_chat(p) for p in PROMPTS]
    for llm in llms.values():  # the first passes of a process are cold
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8))
    rates: dict[tuple[int, bool], list[float]] = {(n, s): [] for n in llms for s in (False, True)}
    outputs: dict[tuple[int, bool], list] = {key: [] for key in rates}
    for r in range(args.repeats):
        for prompt in prompts:
            order = list(rates) if r % 2 == 0 else list(reversed(rates))
            for n, spec in order:
                rate, tokens = tokens_per_s(llms[n], prompt, params, spec)
                rates[(n, spec)].append(rate)
                if r == 0:
                    outputs[(n, spec)].append(tokens)
    identical = all(v == outputs[(1, False)] for v in outputs.values())
    base = statistics.median(rates[(1, False)])
    rows = ["| ranks | decoding | tokens/s (median) | vs one process, plain |", "|---|---|---|---|"]
    for (n, spec), values in rates.items():
        rows.append(f"| {n} | {'ngram' if spec else 'plain'} | {statistics.median(values):.1f} | "
                    f"{statistics.median(values) / base:.2f}× |")  # fmt: skip
    body = "\n".join(rows) + f"\n\nGreedy outputs identical across all four: {'yes' if identical else 'NO'}."
    print(body)
    if args.results:
        note = (f"Default model, {args.dtype}, {args.device}, greedy, {args.max_tokens} new tokens, "
                f"{len(prompts)} chat prompts × {args.repeats} runs in alternating order; the split model's ranks "
                "share the machine's cores.")  # fmt: skip
        write_results(args.results, "tensor-parallel", f"## Tensor parallelism\n\n{note}\n\n{body}\n")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(run(main))
