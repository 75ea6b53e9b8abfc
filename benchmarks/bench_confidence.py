"""Calibration of the adaptive budget's confidences: a drafter's trained confidence head against
the online per-position estimates, each before and after Sequential Temperature Scaling (issue 5).

Default model, bf16, CPU, batch 1, 128 new tokens, the 9 prompts of prompts_learned.json, served
one after another through one engine with `"num_speculative_tokens": "auto"` (the adaptive
budget). ECE is of block survival (s_k = c_1 ⋯ c_k against "tokens 1..k were all accepted"),
fitted on the older half of the recorded rounds and measured on the newer half. Also prints the
decode speedup against plain decoding (geometric mean) for each.

    python benchmarks/bench_confidence.py --head out/eagle_head --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from specdecode import LLM, SamplingParams

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", default=None, help="an eagle folder with a confidence head (default: the shipped one)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantization", default="none", help="weights: none (the documented runs: bf16), gguf, int8, int4, auto")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [t for texts in json.loads((HERE / "prompts_learned.json").read_text()).values() for t in texts]
    head = {"method": "eagle", "num_speculative_tokens": "auto", **({"model": args.head} if args.head else {})}
    llm = LLM(speculative_config=head, dtype="bfloat16", quantization=args.quantization)
    if llm.engine.drafter.net.confidence is None:
        raise SystemExit("that eagle folder has no confidence head (train one with --init and confidence_head)")
    # the same net without its head: online estimates only
    online = LLM(speculative_config={"method": "eagle", "num_speculative_tokens": "auto"}, dtype="bfloat16",
                 quantization=args.quantization)
    online.engine.drafter.net.confidence = None  # ablation: the same drafts, budgeted without the head
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    for name, engine_llm in (("online estimates", online), ("confidence head", llm)):
        ratios = []
        for text in prompts:
            ids = engine_llm.encode_chat(text)
            plain = engine_llm.generate([ids], params, speculative=False)[0].metrics
            spec = engine_llm.generate([ids], params)[0].metrics
            ratios.append(spec.decode_tokens_per_s / plain.decode_tokens_per_s)
        before, after = engine_llm.engine.budget.acceptance.calibration_error()
        rounds = len(engine_llm.engine.budget.acceptance.records)
        print(f"{name:17s} ECE before STS {before:.3f}  after {after:.3f}  ({rounds} rounds)  "
              f"decode speedup {statistics.geometric_mean(ratios):.3f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
