"""Suffix decoding on repeated work, as agents do: the same prompts, over and over.

Default model, CPU, batch 1, greedy: 20 short chat prompts, run 5 times over. Each
prompt is decoded plainly and with ``suffix`` back to back (so both see the same CPU
load), and one `LLM` -- hence one drafter and one global tree -- serves every
repetition, so from the second repetition on earlier answers are drafted from.
Per repetition it prints acceptance α (accepted / reached draft tokens), τ (tokens per
drafting round), tokens/s for both, the speedup, and the drafter's own time (propose +
on_verified) per round as a percentage of a plain target step, and Leviathan's formula at
the measured α with γ = the mean drafted depth per drafting round, over the share of
rounds that found a suffix (the others emit one token), with the drafter's time paid every
round. The CPU may be shared: timings are noisy, ratios less so.

    python benchmarks/bench_suffix.py [--reps 5] [--max-tokens 128] [--gamma 24] [--threads 1] [--json out.json]

On a CPU shared with other jobs, ``--threads 1`` avoids OpenMP oversubscription (threads
waiting on busy cores can make a plain step many times slower). In
bf16, a (γ+1)-token pass rounds differently from a 1-token pass, so outputs may part
from plain greedy's ("same as plain"); in fp32 they are identical.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from args import decode_tokens, out_path, positive_int, run
from timing import Timer

from specdecode import LLM, SamplingParams
from specdecode.entrypoints.cli import OneLineParser
from specdecode.analysis.theory import expected_speedup

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain what a binary search is.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small coffee shop.",
    "How many legs does a spider have?",
    "Write a short thank-you note to a teacher.",
    "What is photosynthesis?",
    "List five fruits that are high in vitamin C.",
    "Explain recursion to a ten-year-old.",
    "What does HTTP stand for?",
    "Give me a simple recipe for pancakes.",
    "Why do cats purr?",
    "Write a SQL query that counts the rows in a table named users.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle.",
]


def main() -> int:
    ap = OneLineParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", help="weights: none (the documented runs: bf16), gguf, int8, int4, auto")
    ap.add_argument("--reps", type=positive_int, default=5)
    ap.add_argument("--prompts", type=positive_int, default=len(PROMPTS))
    ap.add_argument("--max-tokens", type=decode_tokens, default=128)
    ap.add_argument("--gamma", type=positive_int, default=None, help="num_speculative_tokens (default: the drafter's)")
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--json", type=out_path, default=None, help="also write the raw results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = {"method": "suffix"} | ({"num_speculative_tokens": args.gamma} if args.gamma else {})
    llm = LLM(model=args.model, speculative_config=spec, dtype=args.dtype, device="cpu", quantization=args.quantization)
    drafter = llm.engine.drafter
    timers = [Timer(drafter, "propose"), Timer(drafter, "on_verified")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = [llm.encode_chat(p) for p in PROMPTS[: args.prompts]]

    warm = llm.encode_chat("Hi")  # allocator and kernels, untimed (its answer joins the global tree)
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=8))
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=8), speculative=False)

    reps = []
    for rep in range(1, args.reps + 1):
        r = dict(rep=rep, plain_s=0.0, plain_tokens=0, plain_decode_s=0.0, spec_s=0.0, spec_tokens=0,
                 drafts=0, draft_tokens=0, reached=0, accepted=0, draft_s=0.0, rounds=0, same=0)  # fmt: skip
        global_before = drafter.stats.global_
        for ids in prompts:
            base = llm.generate([ids], params, speculative=False)[0]
            for t in timers:
                t.seconds, t.calls = 0.0, 0
            out = llm.generate([ids], params)[0]
            m, bm = out.metrics, base.metrics
            r["plain_s"] += bm.wall_time_s
            r["plain_tokens"] += bm.num_generated_tokens
            r["plain_decode_s"] += bm.wall_time_s - bm.first_token_time_s
            r["spec_s"] += m.wall_time_s
            r["spec_tokens"] += m.num_generated_tokens
            r["drafts"] += m.num_drafts
            r["draft_tokens"] += m.num_draft_tokens
            r["reached"] += m.num_reached_tokens
            r["accepted"] += m.num_accepted_tokens
            r["draft_s"] += sum(t.seconds for t in timers)
            r["rounds"] += timers[0].calls
            r["same"] += out.token_ids == base.token_ids
        r["global_rounds"] = drafter.stats.global_ - global_before
        r["cached_requests"] = len(drafter.cache)
        reps.append(r)
        print(f"repetition {rep}: {fmt_row(r, len(prompts))}", flush=True)

    print(f"\n### suffix vs plain: {len(prompts)} chat prompts x {args.reps} repetitions, dtype={args.dtype}, "
          f"γ={llm.spec.num_speculative_tokens}, {args.max_tokens} new tokens, greedy, batch 1, "
          f"threads={torch.get_num_threads()}\n")
    print("| rep | α | τ | plain tok/s | suffix tok/s | speedup | formula | draft ms/round | draft % of step "
          "| rounds from global | same as plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in reps:
        print("| " + " | ".join(str(c) for c in table_cells(r, len(prompts))) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "reps": reps}, indent=1))
    return 0


def table_cells(r: dict, n: int) -> list:
    alpha = r["accepted"] / r["reached"] if r["reached"] else 0.0  # accepted / reached, as everywhere
    tau = 1 + r["accepted"] / r["drafts"] if r["drafts"] else 1.0
    plain_tps, spec_tps = r["plain_tokens"] / r["plain_s"], r["spec_tokens"] / r["spec_s"]
    step_s = r["plain_decode_s"] / max(r["plain_tokens"] - n, 1)  # one plain decode step
    draft_round_s = r["draft_s"] / max(r["rounds"], 1)
    return [r["rep"], f"{alpha:.2f}", f"{tau:.2f}", f"{plain_tps:.1f}", f"{spec_tps:.1f}", f"{spec_tps / plain_tps:.2f}x",
            f"{formula(r, alpha, draft_round_s / step_s):.2f}x", f"{draft_round_s * 1e3:.2f}",
            f"{100 * draft_round_s / step_s:.1f}%", f"{r['global_rounds']}/{r['rounds']}", f"{r['same']}/{n}"]


def formula(r: dict, alpha: float, draft_cost: float) -> float:
    """Leviathan's speedup at γ = the mean drafted depth, over the share of rounds that found a
    suffix (the others emit one token), with the drafter's time per round (``draft_cost``, in
    plain steps) paid in every round; a verify pass is taken to cost one step."""
    rounds = max(r["rounds"], 1)
    if not r["drafts"]:
        return 1.0 / (1.0 + draft_cost)
    depth, drafting = r["draft_tokens"] / r["drafts"], r["drafts"] / rounds
    c = draft_cost * rounds / r["drafts"] / depth  # per drafted token: γc·f = the draft time per round
    return expected_speedup(alpha, depth, c, drafting)


def fmt_row(r: dict, n: int) -> str:
    c = table_cells(r, n)
    return (f"α={c[1]} τ={c[2]} plain {c[3]} tok/s, suffix {c[4]} tok/s ({c[5]}, formula {c[6]}), "
            f"draft {c[7]} ms/round = {c[8]} of a step, global {c[9]}, same {c[10]}")


if __name__ == "__main__":
    sys.exit(run(main))
