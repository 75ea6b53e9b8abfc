"""What computing every position alone costs: the default (row-invariant passes on CPU, so
speculative greedy equals plain greedy bit for bit) against the fastest path that is not
(``batch_invariant=False``: torch's SDPA and GEMMs, the fused CPU block only where it runs
anyway), measured in the same run, interleaved.

Default model, batch 1, greedy, 128 new tokens, `ngram` (γ = 8) on the input-reuse prompts of
prompts.json (long prompts, many verified positions), per activation dtype × weight format.
Each figure is the geometric mean of per-prompt time ratios over the repeats, with its 95%
interval.

    python benchmarks/bench_invariant.py --results docs/results.md
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from args import out_path, positive_int, run, write_results
from timing import paired_interval

from specdecode import LLM, SamplingParams
from specdecode.entrypoints.cli import OneLineParser

HERE = Path(__file__).resolve().parent
CONFIGS = {"bf16 gguf": ("bfloat16", "gguf"), "bf16 none": ("bfloat16", "none"), "fp32 gguf": ("float32", "gguf"),
           "fp32 none": ("float32", "none")}  # fmt: skip


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=positive_int, default=128)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--json", type=out_path, default=None)
    ap.add_argument("--results", type=out_path, default=None, help="the results page to write the table into")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = json.loads((HERE / "prompts.json").read_text())["input_reuse"]
    spec = {"method": "ngram", "num_speculative_tokens": 8}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for name in args.configs:
        dtype, quant = CONFIGS[name]
        llms = {inv: LLM(speculative_config=spec, dtype=dtype, device="cpu", quantization=quant, batch_invariant=inv)
                for inv in (False, None)}  # fmt: skip
        ids = [llms[None].encode_chat(t) for t in texts]
        for llm in llms.values():  # warm-up
            llm.generate([ids[0]], SamplingParams(temperature=0.0, max_tokens=8))
        seconds = {False: 0.0, None: 0.0}
        ratios, tokens, same = [], 0, 0
        for _ in range(args.repeats):
            for i in ids:
                took = {}
                for inv, llm in llms.items():
                    t0 = time.perf_counter()
                    out = llm.generate([i], params)[0]
                    took[inv] = time.perf_counter() - t0
                    seconds[inv] += took[inv]
                tokens += len(out.token_ids)
                ratios.append(took[None] / took[False])
        plain = llms[None].generate(ids, params, speculative=False)
        fast = llms[None].generate(ids, params)
        same = sum(a.token_ids == b.token_ids for a, b in zip(plain, fast))
        mean, lo, hi = paired_interval(ratios)
        rows.append({"config": name, "kernels": llms[None].kernels, "tok_s_fastest": tokens / seconds[False],
                     "tok_s_invariant": tokens / seconds[None], "time_ratio": mean, "ci95": [lo, hi],
                     "identical": f"{same}/{len(ids)}"})  # fmt: skip
        r = rows[-1]
        print(f"{name:10s} fastest {r['tok_s_fastest']:6.1f} tok/s  invariant {r['tok_s_invariant']:6.1f} tok/s  "
              f"cost {100 * (mean - 1):+.1f}% [{100 * (lo - 1):+.1f}, {100 * (hi - 1):+.1f}]", flush=True)  # fmt: skip
        del llms
    table = ["| weights | fastest path, tok/s | invariant (default), tok/s | cost (time, 95% CI) | identical to plain |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lo, hi = r["ci95"]
        table.append(f"| {r['config']} | {r['tok_s_fastest']:.1f} | {r['tok_s_invariant']:.1f} | "
                     f"{100 * (r['time_ratio'] - 1):+.1f}% [{100 * (lo - 1):+.1f}, {100 * (hi - 1):+.1f}] | "
                     f"{r['identical']} |")  # fmt: skip
    print("\n" + "\n".join(table))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.results:
        body = (f"`ngram` (γ = 8), {len(texts)} input-reuse prompts × {args.repeats}, {args.max_tokens} tokens, batch 1: "
                "the default, where every position is computed alone, against `batch_invariant=False`, "
                "interleaved. *identical*: speculative greedy against plain greedy, default mode.\n\n"
                + "\n".join(table) + "\n")  # fmt: skip
        write_results(args.results, "invariant-cost", body)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
