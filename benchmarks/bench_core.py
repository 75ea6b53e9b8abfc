"""Core benchmark: every ratio is measured side by side in this one run.

Default model, CPU, batch 1, greedy, 128 new tokens, over the prompts in prompts.json:
  1. our plain decoding against Hugging Face transformers `generate` (same model, dtype);
  2. `ngram` against our plain decoding on prompts whose answer reuses the input;
  3. `ngram` against transformers `prompt_lookup_num_tokens` on those prompts;
  4. the measured speedup against Leviathan's formula, from the measured α and c, and the
     share f of rounds in which the lookup found a draft (the others emit one token:
     `theory.expected_speedup(..., drafting=f)`; on chat prompts most rounds find none).
     The formula models decode rounds only, so it is compared with the decode speedup
     (time after the first token; prefill is the same work with or without drafts).
It also reports the token match rate of speculative against plain greedy (in bf16,
rounding may differ between a 1-token and a (γ+1)-token pass).

    python benchmarks/bench_core.py [--dtype bfloat16] [--gamma 8] [--max-tokens 128] [--json out.json]
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
from specdecode.entrypoints.cli import OneLineParser
from specdecode.analysis.theory import expected_speedup

HERE = Path(__file__).parent


def load_hf(llm: LLM, dtype: torch.dtype):
    """The same checkpoint in transformers, at the same dtype."""
    from transformers import AutoModelForCausalLM

    path = Path(llm.target.path)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval()


def time_hf(model, ids: list[int], max_new: int, lookup: int | None) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, **kw)
    return y[0, len(ids) :].tolist(), time.perf_counter() - t0


def prefix_match(a: list[int], b: list[int]) -> float:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(a), len(b), 1)


def main() -> int:
    ap = OneLineParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", help="weights: none (the documented runs: bf16), gguf, int8, int4, auto")
    ap.add_argument("--gamma", type=positive_int, default=8)
    ap.add_argument("--max-tokens", type=decode_tokens, default=128)
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--json", type=out_path, default=None, help="also write the raw results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = json.loads((HERE / "prompts.json").read_text())
    spec = {"method": "ngram", "num_speculative_tokens": args.gamma, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    llm = LLM(model=args.model, speculative_config=spec, dtype=args.dtype, device="cpu", quantization=args.quantization)
    dtype = next(llm.target.model.parameters()).dtype
    hf = load_hf(llm, dtype)
    timer = Timer(llm.engine.drafter, "propose")  # draft cost per round, for c
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    # Warm-up (allocator, kernels) for every path, untimed.
    warm = llm.encode_chat("Hi")
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=8))
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=8), speculative=False)
    time_hf(hf, warm, 8, None)
    time_hf(hf, warm, 8, args.gamma)

    rows = []
    for kind, texts in prompts.items():
        for text in texts:
            ids = llm.encode_chat(text)
            base = llm.generate([ids], params, speculative=False)[0]
            timer.seconds, timer.calls = 0.0, 0
            spec_out = llm.generate([ids], params)[0]
            hf_ids, hf_s = time_hf(hf, ids, args.max_tokens, None)
            hfl_ids, hfl_s = time_hf(hf, ids, args.max_tokens, args.gamma)
            m = spec_out.metrics
            step_s = 1.0 / max(base.metrics.decode_tokens_per_s, 1e-9)  # one plain decode step
            # the formula's c is a draft token's cost, and its γ the mean depth of a drafting round: a lookup
            # drafts fewer than γ where its match runs out, and nothing in some rounds (their lookups count in c)
            depth = m.num_draft_tokens / m.num_drafts if m.num_drafts else args.gamma
            c = timer.seconds / max(m.num_draft_tokens, 1) / step_s
            alpha = m.acceptance_rate  # accepted / reached: the formula's α
            drafting = m.num_drafts / max(timer.calls, 1)  # rounds whose lookup found a draft
            rows.append({
                "kind": kind,
                "prompt": text[:40].replace("\n", " "),
                "ours_plain_tps": base.metrics.tokens_per_s,
                "hf_plain_tps": len(hf_ids) / hf_s,
                "ours_ngram_tps": m.tokens_per_s,
                "decode_speedup": m.decode_tokens_per_s / base.metrics.decode_tokens_per_s,
                "hf_lookup_tps": len(hfl_ids) / hfl_s,
                "alpha": alpha,
                "tau": m.mean_accepted_length,
                "tokens_per_round": (len(spec_out.token_ids) - 1) / max(timer.calls, 1),  # the first is prefill's
                "accepted_per_position": [n / max(m.num_drafts, 1) for n in m.accepted_per_position],
                "c": c,
                "drafting": drafting,
                "predicted_speedup": expected_speedup(alpha, depth, c, drafting),
                "match_vs_plain": prefix_match(spec_out.token_ids, base.token_ids),
                "match_ours_vs_hf": prefix_match(base.token_ids, hf_ids),
                "n_tokens": len(spec_out.token_ids),
            })
            r = rows[-1]
            print(f"[{kind}] {r['prompt']!r}: plain {r['ours_plain_tps']:.1f} tok/s (hf {r['hf_plain_tps']:.1f}), "
                  f"ngram {r['ours_ngram_tps']:.1f} (hf lookup {r['hf_lookup_tps']:.1f}), α={alpha:.2f} τ={r['tau']:.2f}", flush=True)

    print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n### dtype={args.dtype}, γ={args.gamma}, {args.max_tokens} new tokens, greedy, batch 1, "
          f"threads={torch.get_num_threads()}\n")
    print("| kind | prompt | ours plain tok/s | HF plain tok/s | ours/HF | ngram tok/s | ngram/ours plain | HF lookup tok/s "
          "| ngram/HF lookup | α | τ | c | rounds drafting | formula | decode speedup | decode/formula | match vs plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = r["ours_ngram_tps"] / r["ours_plain_tps"]
        print(f"| {r['kind']} | {r['prompt']} | {r['ours_plain_tps']:.1f} | {r['hf_plain_tps']:.1f} | "
              f"{r['ours_plain_tps'] / r['hf_plain_tps']:.2f}x | {r['ours_ngram_tps']:.1f} | {sp:.2f}x | "
              f"{r['hf_lookup_tps']:.1f} | {r['ours_ngram_tps'] / r['hf_lookup_tps']:.2f}x | {r['alpha']:.2f} | "
              f"{r['tau']:.2f} | {r['c']:.3f} | {r['drafting']:.2f} | {r['predicted_speedup']:.2f}x | "
              f"{r['decode_speedup']:.2f}x | "
              f"{r['decode_speedup'] / r['predicted_speedup']:.2f} | {r['match_vs_plain']:.2f} |")
    for kind in sorted({r["kind"] for r in rows}):
        sel = [r for r in rows if r["kind"] == kind]
        g = lambda f: statistics.geometric_mean([f(r) for r in sel])  # noqa: E731
        print(f"\n**{kind}** (geometric means): ours/HF plain {g(lambda r: r['ours_plain_tps'] / r['hf_plain_tps']):.2f}x, "
              f"ngram/ours plain {g(lambda r: r['ours_ngram_tps'] / r['ours_plain_tps']):.2f}x, "
              f"ngram/HF lookup {g(lambda r: r['ours_ngram_tps'] / r['hf_lookup_tps']):.2f}x, "
              f"decode speedup/formula {g(lambda r: r['decode_speedup'] / r['predicted_speedup']):.2f}, "
              f"match vs plain {statistics.mean(r['match_vs_plain'] for r in sel):.2f}")


if __name__ == "__main__":
    sys.exit(run(main))
