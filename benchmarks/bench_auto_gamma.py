"""Fixed γ against "auto" (the adaptive budget choosing each step's depth from the measured
verify-cost curve), default model, bf16, CPU, batch 1, greedy, 128 new tokens, on the prompts
of prompts_learned.json (``--prompts reuse``: the input-reuse prompts of prompts.json). Each
configuration runs right after plain decoding of the same prompt; the ratio is decode tokens/s
over plain's, and the summary is the geometric mean.

    python benchmarks/bench_auto_gamma.py --method eagle --gammas 2 3 --threads 2
    python benchmarks/bench_auto_gamma.py --method ngram --gammas 2 8 --quantization gguf --prompts reuse
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from args import decode_tokens, positive_int, run

from specdecode import LLM, SamplingParams
from specdecode.entrypoints.cli import OneLineParser

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="eagle")
    ap.add_argument("--gammas", nargs="+", type=positive_int, default=[2, 3])
    ap.add_argument("--max-tokens", type=decode_tokens, default=128)
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--quantization", default="none", help="weights: none (the documented runs: bf16), gguf, int8, int4, auto")
    ap.add_argument("--prompts", choices=("learned", "reuse"), default="learned")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompts == "reuse":
        prompts = {"input_reuse": json.loads((HERE / "prompts.json").read_text())["input_reuse"]}
    else:
        prompts = json.loads((HERE / "prompts_learned.json").read_text())
    configs = {f"γ={g}": {"method": args.method, "num_speculative_tokens": g} for g in args.gammas}
    configs["auto"] = {"method": args.method, "num_speculative_tokens": "auto"}
    llms = {name: LLM(speculative_config=spec, dtype="bfloat16", device="cpu", quantization=args.quantization)
            for name, spec in configs.items()}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in llms.values():  # untimed: the first passes of a process are cold (allocator, kernels, graphs)
        warm = llm.encode_chat("Hi")
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=8))
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=8), speculative=False)
    ratios: dict[str, list[float]] = {name: [] for name in configs}
    for kind, texts in prompts.items():
        for text in texts:
            for name, llm in llms.items():
                ids = llm.encode_chat(text)
                plain = llm.generate([ids], params, speculative=False)[0].metrics
                spec = llm.generate([ids], params)[0].metrics
                ratios[name].append(spec.decode_tokens_per_s / plain.decode_tokens_per_s)
                print(f"{kind:13s} {name:5s} τ={spec.mean_accepted_length:.2f} speedup {ratios[name][-1]:.2f}x", flush=True)
    print(f"\n{args.method}, geometric mean decode speedup over {len(ratios['auto'])} prompts:")
    for name, r in ratios.items():
        print(f"  {name:5s} {statistics.geometric_mean(r):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
