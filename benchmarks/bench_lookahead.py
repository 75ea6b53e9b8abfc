"""`lookahead` against our plain decoding, side by side in one run, with the formula's prediction.

Default model, CPU, greedy, batch 1, 128 new tokens, over the chat and input-reuse
prompts of prompts.json. For each prompt, ``--reps`` interleaved repetitions run plain
decoding and every lookahead config back to back (order rotated per repetition), so
all see the same CPU load; the speedup is the median over repetitions of the paired
decode-rate ratio (tokens after the first per second: prefill is the same work either
way), and end-to-end tokens/s ratios are printed too. On a CPU shared with other jobs,
wall time swings with their load; the *CPU time* column (this process's CPU seconds
per generated token, plain over lookahead, whole `generate`, median of the paired
ratios) is far steadier, since time spent waiting for a core is not counted. Each config gets its own `LLM`
(the converted model is cached on disk), so a sweep is one command.

The formula. Leviathan's (1 − α^(γ+1)) / ((1 − α)(γc + 1)) with γ = N − 1 (a guess's
depth), α = accepted / reached draft tokens over rounds that had a guess, and c = the
drafter's CPU time per round (propose + on_verified) / γ / one plain decode step's CPU time. It
assumes a verify pass costs one plain step and that every round drafts. The *costed*
prediction drops both assumptions with measured quantities: the formula's tokens per
drafted round, weighted by f (the fraction of rounds whose root had a pool guess; the
others emit one token), over the measured round cost v (target pass with its tree and
W·(N−1) window nodes, in plain steps, from CPU time per round and per plain token,
prefill included in both) plus γc.

    python benchmarks/bench_lookahead.py [--configs 2,5,4 4,4,4,noprompt,nooutput] [--reps 3] [--max-tokens 128] [--threads 2] [--json out.json]

A config is W,N,G (lookahead_window, lookahead_ngram, lookahead_guess), optionally
followed by flags: ``,noprompt`` / ``,nooutput`` turn off ``pool_from_prompt`` /
``pool_from_output``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from args import decode_tokens, out_path, positive_int, run
from timing import Timer

from specdecode import LLM, SamplingParams
from specdecode.drafters.registry import parse_spec
from specdecode.config import SpecDecodeError
from specdecode.entrypoints.cli import OneLineParser
from specdecode.analysis.theory import expected_speedup, expected_tokens_per_round

HERE = Path(__file__).parent
FLAGS = ("noprompt", "nooutput")  # a config's optional parts


def parse_config(text: str) -> dict:
    parts = text.split(",")
    try:
        W, N, G = (int(x) for x in parts[:3])
    except ValueError:
        W = None
    if W is None or not set(parts[3:]) <= set(FLAGS):
        raise argparse.ArgumentTypeError(f"a config is W,N,G[,noprompt][,nooutput] (three integers), got {text!r}")
    spec = {"method": "lookahead", "lookahead_window": W, "lookahead_ngram": N, "lookahead_guess": G}
    spec["pool_from_prompt"] = "noprompt" not in parts[3:]
    spec["pool_from_output"] = "nooutput" not in parts[3:]
    return spec


def config_arg(text: str) -> str:
    """--configs' type: ``text`` as given, once `parse_config` and `SpecConfig` take it."""
    try:
        parse_spec(parse_config(text))
    except SpecDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return text


def kinds_arg(text: str) -> str:
    """--kinds' type: ``text`` as given, once each of its kinds is one of prompts.json's."""
    known = json.loads((HERE / "prompts.json").read_text())
    for kind in text.split(","):
        if kind not in known:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}; choose from {', '.join(known)}")
    return text


def prefix_match(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


def main() -> int:
    ap = OneLineParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", help="weights: none (the documented runs: bf16), gguf, int8, int4, auto")
    ap.add_argument("--configs", nargs="+", type=config_arg, default=["2,5,4"], help="W,N,G[,noprompt][,nooutput] ...")
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--max-tokens", type=decode_tokens, default=128)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--kinds", type=kinds_arg, default="input_reuse,chat")
    ap.add_argument("--json", type=out_path, default=None, help="also write the raw results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = json.loads((HERE / "prompts.json").read_text())
    llms = {text: LLM(model=args.model, speculative_config=parse_config(text), dtype=args.dtype, device="cpu", quantization=args.quantization)
            for text in args.configs}  # fmt: skip
    engines = {text: llm.engine for text, llm in llms.items()}
    # CPU seconds, as the runs and plain steps they are set against (wall time is half that at 2 threads)
    timers = {text: [Timer(e.drafter, m, clock=time.process_time) for m in ("propose", "on_verified")]
              for text, e in engines.items()}  # fmt: skip
    first = llms[args.configs[0]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def timed(name: str, ids: list[int]):
        t0 = time.process_time()
        if name == "plain":
            out = first.generate([ids], params, speculative=False)[0]
        else:
            out = llms[name].generate([ids], params)[0]
        return out, time.process_time() - t0

    warm = first.encode_chat("Hi")  # allocator and kernels, untimed
    for name in ["plain", *engines]:
        timed(name, warm)

    rows = []
    names = ["plain", *engines]
    for kind in args.kinds.split(","):
        for text in prompts[kind]:
            ids = first.encode_chat(text)
            runs: dict[str, list] = {n: [] for n in names}
            for rep in range(args.reps):
                order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate who goes first
                for name in order:
                    if name != "plain":
                        for t in timers[name]:
                            t.seconds, t.calls = 0.0, 0
                    out, cpu_s = timed(name, ids)
                    extra = {"cpu_s": cpu_s, "cpu_s_per_token": cpu_s / max(len(out.token_ids), 1)}
                    if name != "plain":
                        extra |= {"draft_s": sum(t.seconds for t in timers[name]), "rounds": timers[name][0].calls}
                    runs[name].append((out, extra))
            for name in engines:
                rows.append(summarize(kind, text, name, runs["plain"], runs[name], engines[name]))
                print(fmt(rows[-1]), flush=True)

    print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


def summarize(kind: str, text: str, name: str, plain_runs: list, spec_runs: list, engine) -> dict:
    o = engine.spec.options
    gamma = min(engine.spec.num_speculative_tokens, o.lookahead_ngram - 1)
    decode_ratio = [s.metrics.decode_tokens_per_s / p.metrics.decode_tokens_per_s for (p, _), (s, _) in zip(plain_runs, spec_runs)]
    e2e_ratio = [s.metrics.tokens_per_s / p.metrics.tokens_per_s for (p, _), (s, _) in zip(plain_runs, spec_runs)]
    cpu_ratio = [p["cpu_s_per_token"] / s["cpu_s_per_token"] for (_, p), (_, s) in zip(plain_runs, spec_runs)]
    out, extra = spec_runs[0]
    m = out.metrics
    rounds = extra["rounds"]
    # Costs in CPU seconds (steady under load): a plain step ≈ plain CPU time per token; a
    # lookahead round ≈ its CPU time per round, less the drafter's host time.
    step_s = statistics.median(p["cpu_s_per_token"] for _, p in plain_runs)
    draft_round_s = statistics.median(e["draft_s"] / max(e["rounds"], 1) for _, e in spec_runs)
    round_s = statistics.median(e["cpu_s"] / max(e["rounds"], 1) for _, e in spec_runs)
    alpha = m.acceptance_rate
    c = draft_round_s / gamma / step_s
    v = (round_s - draft_round_s) / step_s  # target pass per round, in plain steps
    f = m.num_drafts / max(rounds, 1)  # rounds whose root had a guess
    tokens_per_round = f * expected_tokens_per_round(alpha, gamma) + (1 - f)
    return {
        "kind": kind, "prompt": text[:36].replace("\n", " "), "config": name,
        "plain_tps": statistics.median(p.metrics.decode_tokens_per_s for p, _ in plain_runs),
        "spec_tps": statistics.median(s.metrics.decode_tokens_per_s for s, _ in spec_runs),
        "speedup": statistics.median(decode_ratio), "speedup_min": min(decode_ratio), "speedup_max": max(decode_ratio),
        "e2e_speedup": statistics.median(e2e_ratio), "cpu_speedup": statistics.median(cpu_ratio),
        "alpha": alpha, "tau": m.mean_accepted_length, "guess_rate": f,
        "tokens_per_round": (len(out.token_ids) - 1) / max(rounds, 1),  # the first comes from prefill
        "c": c, "verify_cost": v, "formula": expected_speedup(alpha, gamma, c),
        "formula_costed": tokens_per_round / (gamma * c + v),
        "draft_ms": draft_round_s * 1e3,
        "match_vs_plain": prefix_match(out.token_ids, plain_runs[0][0].token_ids),
    }  # fmt: skip


def fmt(r: dict) -> str:
    return (f"[{r['kind']}] {r['config']} {r['prompt']!r}: plain {r['plain_tps']:.1f} tok/s, lookahead {r['spec_tps']:.1f} "
            f"({r['speedup']:.2f}x, {r['speedup_min']:.2f}-{r['speedup_max']:.2f}; CPU time {r['cpu_speedup']:.2f}x), α={r['alpha']:.2f} τ={r['tau']:.2f} "
            f"f={r['guess_rate']:.2f} v={r['verify_cost']:.2f} formula {r['formula']:.2f}x costed {r['formula_costed']:.2f}x")


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n### lookahead vs plain: dtype={args.dtype}, {args.max_tokens} new tokens, greedy, batch 1, "
          f"threads={torch.get_num_threads()}, median of {args.reps} interleaved repetitions\n")
    print("| kind | prompt | W,N,G | plain tok/s | lookahead tok/s | decode speedup (min–max) | end-to-end | CPU time | α | τ "
          "| rounds with a guess | tokens/round | c | verify cost v | formula | formula, costed | match vs plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['prompt']} | {r['config']} | {r['plain_tps']:.1f} | {r['spec_tps']:.1f} | "
              f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}–{r['speedup_max']:.2f}) | {r['e2e_speedup']:.2f}x | {r['cpu_speedup']:.2f}x | "
              f"{r['alpha']:.2f} | {r['tau']:.2f} | {r['guess_rate']:.2f} | {r['tokens_per_round']:.2f} | {r['c']:.3f} | "
              f"{r['verify_cost']:.2f} | {r['formula']:.2f}x | {r['formula_costed']:.2f}x | {r['match_vs_plain']:.2f} |")
    print()
    for config in dict.fromkeys(r["config"] for r in rows):
        for kind in dict.fromkeys(r["kind"] for r in rows):
            sel = [r for r in rows if r["kind"] == kind and r["config"] == config]
            g = lambda f: statistics.geometric_mean([f(r) for r in sel])  # noqa: E731
            print(f"**{kind}, {config}** (geometric means): decode speedup {g(lambda r: r['speedup']):.2f}x, "
                  f"end-to-end {g(lambda r: r['e2e_speedup']):.2f}x, CPU time {g(lambda r: r['cpu_speedup']):.2f}x, "
                  f"formula {g(lambda r: r['formula']):.2f}x, "
                  f"costed formula {g(lambda r: r['formula_costed']):.2f}x, verify cost v {g(lambda r: r['verify_cost']):.2f}")


if __name__ == "__main__":
    sys.exit(run(main))
