"""`ngram` on loops: a draft that runs into the end of the sequence cut there (vLLM's rule) or
repeating the match's period where the match overlaps or adjoins its suffix (ours), side by side.

Default model, CPU, batch 1, greedy, γ = 8; the prompts of `prompts.json` (where the two rules
should draft alike) and a few that make the model repeat itself. For each prompt and rule:
τ, draft tokens verified and decode tokens/s, with plain decoding's rate beside them, all in
one process and interleaved (plain, cut, repeat, per prompt and repetition).

    python benchmarks/bench_ngram_loop.py [--quantization auto] [--repeats 3] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from args import decode_tokens, out_path, positive_int, run

import specdecode.drafters.ngram as ngram
from specdecode import LLM, SamplingParams
from specdecode.entrypoints.cli import OneLineParser

HERE = Path(__file__).parent
LOOPS = [
    "Repeat the word 'hello' 40 times.",
    "Write the letter a one hundred times.",
    "List the numbers from 1 to 60, one per line.",
]
REPEAT = ngram.continuation


def cut_at_end(tokens, start: int, k: int, n: int):
    """vLLM's rule: the tokens after the match, up to the end of the sequence."""
    return tokens[start : start + k]


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--gamma", type=positive_int, default=8)
    ap.add_argument("--max-tokens", type=decode_tokens, default=128)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--json", type=out_path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.gamma, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    llm = LLM(model=args.model, speculative_config=spec, device="cpu", quantization=args.quantization)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    kinds = json.loads((HERE / "prompts.json").read_text())
    prompts = [(kind, text) for kind, texts in kinds.items() for text in texts]
    prompts += [("loop", text) for text in LOOPS]
    llm.generate([llm.encode_chat("Hi")], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    rows = []
    for kind, text in prompts:
        ids = llm.encode_chat(text)
        rates: dict[str, list[float]] = {"plain": [], "cut": [], "repeat": []}
        stats = {}
        for _ in range(args.repeats):
            rates["plain"].append(llm.generate([ids], params, speculative=False)[0].metrics.decode_tokens_per_s)
            for name, rule in (("cut", cut_at_end), ("repeat", REPEAT)):
                ngram.continuation = rule
                try:
                    m = llm.generate([ids], params)[0].metrics
                finally:
                    ngram.continuation = REPEAT
                rates[name].append(m.decode_tokens_per_s)
                stats[name] = (m.mean_accepted_length, m.num_draft_tokens)  # greedy: the same every repetition
        plain = statistics.median(rates["plain"])
        row = {"kind": kind, "prompt": text[:40], "plain_tok_s": plain}
        for name in ("cut", "repeat"):
            tau, drafted = stats[name]
            speedup = statistics.median(rates[name]) / plain
            row |= {f"{name}_tau": tau, f"{name}_draft_tokens": drafted, f"{name}_speedup": speedup}
        rows.append(row)
        rules = " | ".join(f"{name}: τ {row[name + '_tau']:.2f}, {row[name + '_draft_tokens']:3} drafted, "
                           f"{row[name + '_speedup']:.2f}x" for name in ("cut", "repeat"))  # fmt: skip
        print(f"{kind:11} {text[:36]:36} plain {plain:6.1f} tok/s | {rules}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
