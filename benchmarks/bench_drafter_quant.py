"""A learned drafter's own weights in the target's format (int4 for a GGUF target, the default)
against the same net dense, side by side: α and decode speedup over plain decoding.

Default model, CPU, batch 1, greedy, 128 new tokens, the prompts of `prompts_learned.json`; per
prompt and repetition: plain, then the two drafters, interleaved in one process. The dense net is
loaded with the quantization step skipped (`quant.quantize_linears_` replaced while it loads).

    python benchmarks/bench_drafter_quant.py [--method eagle] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from args import decode_tokens, positive_int, run

import specdecode.model.quant as quant
from specdecode import LLM, SamplingParams
from specdecode.entrypoints.cli import OneLineParser

HERE = Path(__file__).parent


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="eagle", choices=["eagle", "eagle3", "mtp", "medusa", "dflash"])
    ap.add_argument("--max-tokens", type=decode_tokens, default=128)
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--threads", type=positive_int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = {"method": args.method}
    llms = {"own format": LLM(speculative_config=spec)}
    real = quant.quantize_linears_
    quant.quantize_linears_ = lambda net, mode: net
    try:
        llms["dense"] = LLM(speculative_config=spec)
    finally:
        quant.quantize_linears_ = real
    plain = llms["own format"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = [(kind, p) for kind, ps in json.loads((HERE / "prompts_learned.json").read_text()).items() for p in ps]
    counts = {name: [0, 0] for name in llms}  # accepted, reached
    ratios: dict[str, list[float]] = {name: [] for name in llms}
    for kind, text in prompts:
        ids = plain.encode_chat(text)
        for _ in range(args.repeats):
            base = plain.generate([ids], params, speculative=False)[0].metrics.decode_tokens_per_s
            for name, llm in llms.items():
                m = llm.generate([ids], params)[0].metrics
                counts[name][0] += m.num_accepted_tokens
                counts[name][1] += m.num_reached_tokens
                ratios[name].append(m.decode_tokens_per_s / base)
        last = {name: round(statistics.geometric_mean(r[-args.repeats :]), 3) for name, r in ratios.items()}
        print(f"{kind:13} {text[:40]:40} speedup {last}", flush=True)
    for name in llms:
        accepted, reached = counts[name]
        print(f"{name}: α {accepted / max(reached, 1):.3f}, speedup (geometric mean) "
              f"{statistics.geometric_mean(ratios[name]):.3f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
