"""Token match rate of speculative against plain greedy decoding, per weight format, with and
without the batch-invariant verify mode (issue 6). Default model, CPU, batch 1, greedy, 128
new tokens, `ngram` (γ = 8), the chat and input-reuse prompts of prompts.json.

A γ+1-position verify pass can round differently from a 1-position pass, so in bf16 a
speculative greedy output may leave plain greedy's path at a near-tie and never come back.
*match* is the fraction of plain greedy's tokens that the speculative output reproduces
before the first difference; *identical* counts outputs equal to the last token. Timings
are not measured here (see bench_quant.py and bench_core.py).

    python benchmarks/bench_match.py --threads 2 [--modes bf16 int8 gguf gguf-a8] --plot docs/match_rate.png
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from args import out_path, positive_int, run

from specdecode import LLM, SamplingParams
from specdecode.entrypoints.cli import OneLineParser

HERE = Path(__file__).resolve().parent
MODES = {"bf16": None, "int8": "int8", "gguf Q4_1": "gguf", "gguf Q4_1 a8": "gguf-a8"}


def prefix_match(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(b), 1)


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=positive_int, default=128)
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--plot", type=out_path, default=None, help="PNG bar chart of the mean match rate")
    ap.add_argument("--json", type=out_path, default=None)
    ap.add_argument("--modes", nargs="+", default=["bf16", "int8", "gguf"], choices=["bf16", "int8", "gguf", "gguf-a8"],
                    help="weight formats (gguf-a8: int8 activations)")
    args = ap.parse_args()
    modes = {name: q for name, q in MODES.items() if (q or "bf16") in args.modes}
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = json.loads((HERE / "prompts.json").read_text())
    texts = [(kind, t) for kind in ("chat", "input_reuse") for t in prompts[kind]]
    spec = {"method": "ngram", "num_speculative_tokens": 8}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    for mode, quant in modes.items():
        for invariant in (False, True):
            llm = LLM(speculative_config=spec, dtype="bfloat16", device="cpu", quantization=quant,
                      batch_invariant=invariant)  # fmt: skip
            for kind, text in texts:
                ids = llm.encode_chat(text)
                plain = llm.generate([ids], params, speculative=False)[0].token_ids
                fast = llm.generate([ids], params)[0].token_ids
                rows.append({"mode": mode, "batch_invariant": invariant, "kind": kind, "prompt": text[:36],
                             "match": prefix_match(fast, plain), "identical": fast == plain})  # fmt: skip
                print(f"{mode:10s} invariant={invariant!s:5s} {kind:11s} match {rows[-1]['match']:.2f}", flush=True)
    print("\n| weights | batch_invariant | mean match | identical outputs |\n|---|---|---|---|")
    summary = []
    for mode in modes:
        for invariant in (False, True):
            sel = [r for r in rows if r["mode"] == mode and r["batch_invariant"] == invariant]
            mean = statistics.mean(r["match"] for r in sel)
            same = sum(r["identical"] for r in sel)
            summary.append((mode, invariant, mean))
            print(f"| {mode} | {'on' if invariant else 'off'} | {mean:.2f} | {same}/{len(sel)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.6))
        x = range(len(modes))
        for j, invariant in enumerate((False, True)):
            vals = [m for mode, inv, m in summary if inv == invariant]
            label = "batch_invariant=True" if invariant else "default (batch_invariant=False)"
            ax.bar([i + (j - 0.5) * 0.38 for i in x], vals, width=0.38, label=label)
        ax.set_xticks(list(x), list(modes))
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("tokens matching plain greedy\n(before the first difference)")
        ax.set_title(f"ngram γ=8 vs plain greedy, {len(texts)} prompts, {args.max_tokens} tokens (CPU)")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
