"""Match grid: is speculative greedy output identical to plain greedy output, in the default
configuration, for every registered method × activation dtype × weight format?

Default model, batch 1 (``--batched``: every prompt at once), greedy, the 42 prompts of prompts_match.json (chat, code and
summaries; half end in whitespace or newlines, as pasted text does). Per cell: the share of
prompts whose output equals plain greedy's to the last token, and the first divergence
positions where one does not. Plain greedy runs once per dtype × format and serves every
method. Timings are not measured here.

    python benchmarks/bench_match.py --results docs/results.md --plot docs/match_grid.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from args import out_path, positive_int, run, write_results

from specdecode import LLM, SamplingParams
from specdecode.drafters.registry import method_names
from specdecode.entrypoints.cli import OneLineParser

HERE = Path(__file__).resolve().parent
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# a draft model needs one: the target itself (its drafts then differ from the target's only
# where a verify pass would round differently, which is what this grid looks for)
EXTRA = {"draft_model": {"model": "smollm2-135m"}}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ, None when identical."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None and len(a) != len(b):
        n = min(len(a), len(b))
    return n


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--prompts", type=positive_int, default=None, help="the first N prompts of each kind")
    ap.add_argument("--methods", nargs="+", default=method_names(), choices=method_names())
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--quantizations", nargs="+", default=["gguf", "int4", "none"], choices=["gguf", "int4", "none"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batched", action="store_true",
                    help="speculative runs take every prompt at once (continuous batching, 16 rows), not one by one")
    ap.add_argument("--json", type=out_path, default=None)
    ap.add_argument("--plot", type=out_path, default=None, help="PNG heat map of the identical share")
    ap.add_argument("--results", type=out_path, default=None, help="the results page to write the table into")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = json.loads((HERE / "prompts_match.json").read_text())
    texts = [(kind, t) for kind, ts in kinds.items() for t in ts[: args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    cells = []
    for dt in args.dtypes:
        for quant in args.quantizations:
            plain_llm = LLM(dtype=DTYPES[dt], device=args.device, quantization=quant)
            ids = [plain_llm.encode_chat(t) for _, t in texts]
            plain = [plain_llm.generate([i], params)[0].token_ids for i in ids]
            del plain_llm
            for method in args.methods:
                spec = {"method": method, **EXTRA.get(method, {})}
                llm = LLM(speculative_config=spec, dtype=DTYPES[dt], device=args.device, quantization=quant)
                if args.batched:
                    outs = [o.token_ids for o in llm.generate(ids, params)]
                else:
                    outs = [llm.generate([i], params)[0].token_ids for i in ids]
                diverged = []
                for (kind, text), out, want in zip(texts, outs, plain):
                    at = first_divergence(out, want)
                    if at is not None:
                        diverged.append({"kind": kind, "prompt": text[:40], "position": at})
                cells.append({"dtype": dt, "quantization": quant, "method": method, "prompts": len(texts),
                              "identical": len(texts) - len(diverged), "diverged": diverged})  # fmt: skip
                print(f"{dt:4s} {quant:5s} {method:11s} identical {cells[-1]['identical']}/{len(texts)}"
                      + (f"  first divergences at {[d['position'] for d in diverged]}" if diverged else ""), flush=True)  # fmt: skip
                del llm
    configs = [(dt, q) for dt in args.dtypes for q in args.quantizations]
    head = "| method | " + " | ".join(f"{dt} {q}" for dt, q in configs) + " |"
    lines = [head, "|---" * (len(configs) + 1) + "|"]
    for method in args.methods:
        row = []
        for dt, q in configs:
            c = next(c for c in cells if (c["dtype"], c["quantization"], c["method"]) == (dt, q, method))
            mark = f"{100 * c['identical'] / c['prompts']:.0f}%"
            if c["diverged"]:
                mark += " (at " + ", ".join(str(d["position"]) for d in c["diverged"][:4]) + ")"
            row.append(mark)
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    table = "\n".join(lines)
    print("\n" + table)
    total = sum(c["identical"] for c in cells), sum(c["prompts"] for c in cells)
    print(f"\nidentical to plain greedy: {total[0]}/{total[1]}")
    if args.json:
        Path(args.json).write_text(json.dumps(cells, indent=1))
    if args.results:
        batch = "all prompts at once, continuous batching" if args.batched else "batch 1"
        body = (f"Share of {len(texts)} prompts whose speculative greedy output is identical to plain greedy "
                f"({args.max_tokens} tokens, {batch}, each method's default configuration; in brackets, the "
                f"first positions where outputs diverged). In all: {total[0]}/{total[1]}.\n\n{table}\n")  # fmt: skip
        write_results(args.results, "match-grid-batched" if args.batched else "match-grid", body)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        grid = [[next(c["identical"] / c["prompts"] for c in cells if (c["dtype"], c["quantization"], c["method"])
                      == (dt, q, m)) for dt, q in configs] for m in args.methods]  # fmt: skip
        fig, ax = plt.subplots(figsize=(1.2 * len(configs) + 2, 0.4 * len(args.methods) + 1.5))
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(configs)), [f"{dt}\n{q}" for dt, q in configs])
        ax.set_yticks(range(len(args.methods)), args.methods)
        for r, row in enumerate(grid):
            for c, v in enumerate(row):
                ax.text(c, r, f"{100 * v:.0f}%", ha="center", va="center", fontsize=8)
        ax.set_title(f"greedy output identical to plain greedy ({len(texts)} prompts)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
