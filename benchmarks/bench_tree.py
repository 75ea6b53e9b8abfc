"""Tree against chain at the same number of verified positions, side by side in one run.

Default model, CPU, batch 1, greedy, prompts from prompts.json. Both drafts verify at
most ``--positions`` positions per round (root included): the chain has γ = positions−1
tokens; the tree merges up to ``--matches`` n-gram matches, ``positions−1`` nodes in all,
depth up to ``--depth``. Reports τ (mean accepted length), tokens per round, tokens/s
and the speedup over plain decoding, and Leviathan's formula for each: α = accepted /
reached draft tokens, γ = the mean drafted depth per drafting round (for a tree, the depth
of its deepest path), c = the measured lookup time (`propose`) per drafted token over a
plain step, and f = the share of rounds that found a draft (the others emit one token:
`theory.expected_speedup(..., drafting=f)`). For a tree the formula is an analogy: α is
then the acceptance per level along the accepted path.

    python benchmarks/bench_tree.py [--positions 9] [--matches 4] [--depth 8] [--max-tokens 128]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from args import decode_tokens, int_at_least, positive_int, run
from timing import Timer

from specdecode import LLM, SamplingParams
from specdecode.entrypoints.cli import OneLineParser
from specdecode.analysis.theory import expected_speedup

HERE = Path(__file__).parent


def main() -> int:
    ap = OneLineParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", help="weights: none (the documented runs: bf16), gguf, int8, int4, auto")
    ap.add_argument("--positions", type=int_at_least(2, " (the root and a draft token)"), default=9)
    ap.add_argument("--matches", type=int_at_least(2, " (a tree merges several matches)"), default=4)
    ap.add_argument("--depth", type=positive_int, default=8)
    ap.add_argument("--max-tokens", type=decode_tokens, default=128)
    args = ap.parse_args()
    prompts = json.loads((HERE / "prompts.json").read_text())
    n = args.positions - 1
    chain = LLM(model=args.model, dtype=args.dtype, device="cpu", quantization=args.quantization,
                speculative_config={"method": "ngram", "num_speculative_tokens": n})  # fmt: skip
    tree = LLM(model=args.model, dtype=args.dtype, device="cpu", quantization=args.quantization, speculative_config={
        "method": "ngram", "num_speculative_tokens": args.depth, "max_matches": args.matches, "num_draft_tokens": n})  # fmt: skip
    timers = {llm: Timer(llm.engine.drafter, "propose") for llm in (chain, tree)}  # the lookups' cost, for c
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = chain.encode_chat("Hi")
    for llm in (chain, tree):
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=8))
    chain.generate([warm], SamplingParams(temperature=0.0, max_tokens=8), speculative=False)

    rows = []
    print("| kind | prompt | plain tok/s | chain α | chain τ | chain tok/s | chain speedup | chain formula | tree α | tree τ "
          "| tree tok/s | tree speedup | tree formula | tree τ / chain τ |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, texts in prompts.items():
        for text in texts:
            ids = chain.encode_chat(text)
            base = chain.generate([ids], params, speculative=False)[0].metrics
            step_s = 1.0 / max(base.decode_tokens_per_s, 1e-9)  # one plain decode step
            spec = {}
            for llm in (chain, tree):
                timers[llm].seconds, timers[llm].calls = 0.0, 0
                spec[llm] = llm.generate([ids], params)[0].metrics
            c, t = spec[chain], spec[tree]
            r = {"kind": kind, "plain": base.decode_tokens_per_s, "chain_tau": c.mean_accepted_length,
                 "chain_tps": c.decode_tokens_per_s, "tree_tau": t.mean_accepted_length, "tree_tps": t.decode_tokens_per_s,
                 "chain_alpha": c.acceptance_rate, "tree_alpha": t.acceptance_rate,
                 "chain_formula": formula(c, timers[chain], step_s), "tree_formula": formula(t, timers[tree], step_s)}  # fmt: skip
            rows.append(r)
            print(f"| {kind} | {text[:32]!r} | {r['plain']:.1f} | {r['chain_alpha']:.2f} | {r['chain_tau']:.2f} | "
                  f"{r['chain_tps']:.1f} | {r['chain_tps'] / r['plain']:.2f}x | {r['chain_formula']:.2f}x | "
                  f"{r['tree_alpha']:.2f} | {r['tree_tau']:.2f} | {r['tree_tps']:.1f} | {r['tree_tps'] / r['plain']:.2f}x | "
                  f"{r['tree_formula']:.2f}x | {r['tree_tau'] / r['chain_tau']:.2f} |", flush=True)
    for kind in sorted({r["kind"] for r in rows}):
        sel = [r for r in rows if r["kind"] == kind]
        g = lambda f: statistics.geometric_mean([f(r) for r in sel])  # noqa: E731
        print(f"\n**{kind}** (geometric means, decode tokens/s): chain {g(lambda r: r['chain_tps'] / r['plain']):.2f}x, "
              f"tree {g(lambda r: r['tree_tps'] / r['plain']):.2f}x, tree τ / chain τ {g(lambda r: r['tree_tau'] / r['chain_tau']):.2f}; "
              f"formula: chain {g(lambda r: r['chain_formula']):.2f}x, tree {g(lambda r: r['tree_formula']):.2f}x")
    return 0


def formula(m, timer: Timer, step_s: float) -> float:
    """Leviathan's speedup at the run's α, γ = its mean drafted depth, c = its lookups' time per
    drafted token over a plain step, over the share of rounds that drafted."""
    rounds = max(timer.calls, 1)
    if not m.num_drafts:
        return 1.0 / (1.0 + timer.seconds / rounds / step_s)  # every round one token, lookups paid
    c = timer.seconds / m.num_draft_tokens / step_s
    return expected_speedup(m.acceptance_rate, m.num_draft_tokens / m.num_drafts, c, m.num_drafts / rounds)


if __name__ == "__main__":
    sys.exit(run(main))
