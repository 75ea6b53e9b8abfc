"""Calibration of the adaptive budget's confidences: a learned drafter's own draft probabilities
(and, given one, a trained confidence head) against the online per-position estimates, each
before and after Sequential Temperature Scaling.

Default model, CPU, batch 1, 128 new tokens, the 9 prompts of prompts_learned.json, served one
after another through one engine per variant with `"num_speculative_tokens": "auto"` (the
adaptive budget), each prompt right after plain decoding of it. ECE is of block survival
(s_k = c_1 ⋯ c_k against "tokens 1..k were all accepted"), fitted on the older half of the
recorded rounds and measured on the newer half. Also prints the decode speedup against plain
decoding (geometric mean over the prompts) and the draft tokens verified per round.

    python benchmarks/bench_confidence.py --threads 2 --quantization gguf [--head out/eagle_head]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from args import decode_tokens, nonneg_float, positive_int, run, unit_float
from timing import Timer

from specdecode import LLM, SamplingParams
from specdecode.config import SpecDecodeError
from specdecode.entrypoints.cli import OneLineParser

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="eagle", choices=["eagle", "eagle3", "mtp", "dflash"])
    ap.add_argument("--head", default=None, help="an eagle folder with a confidence head: also compare the head")
    ap.add_argument("--confidence-threshold", type=unit_float, default=0.0, help="the drafter's stop (0: none)")
    ap.add_argument("--fixed", type=positive_int, nargs="*", default=[],
                    help="also these fixed γ (no adaptive budget)")
    ap.add_argument("--temperature", type=nonneg_float, default=0.0)
    ap.add_argument("--max-tokens", type=decode_tokens, default=128)
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--quantization", default="none", help="weights: none (bf16), gguf, int8, int4, auto")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [t for texts in json.loads((HERE / "prompts_learned.json").read_text()).values() for t in texts]
    spec = {"method": args.method, "num_speculative_tokens": "auto"}
    if args.confidence_threshold:
        spec["confidence_threshold"] = args.confidence_threshold

    def load(s: dict) -> LLM:
        return LLM(speculative_config=s, dtype="bfloat16", device="cpu", quantization=args.quantization)

    online, own = load(spec), load(spec)
    online.engine.drafter.report_confidence = False  # ablation: the same drafts, budgeted on online counts
    variants = [("online estimates", online), ("draft probability", own)]
    if args.head:
        head = load({**spec, "model": args.head})
        if head.engine.drafter.net.confidence is None:
            raise SpecDecodeError(f"{args.head} has no confidence head (train one with --init and confidence_head)")
        variants.append(("confidence head", head))
    variants += [(f"fixed γ = {g}", load({**spec, "num_speculative_tokens": g})) for g in args.fixed]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    warm = online.encode_chat("Hi")  # untimed: the first passes of a process are cold (allocator, kernels)
    short = SamplingParams(temperature=args.temperature, max_tokens=8, seed=0)
    online.generate([warm], short, speculative=False)
    for _, llm in variants:
        llm.generate([warm], short)
    ratios: dict[str, list[float]] = {name: [] for name, _ in variants}
    drafts: dict[str, list[float]] = {name: [] for name, _ in variants}
    # decode rounds: the drafter hears every round's outcome, drafted or not (counting them as the
    # tokens after the first less the accepted ones missed a last round that a stop cut short)
    rounds = {name: Timer(llm.engine.drafter, "on_verified") for name, llm in variants}
    for text in prompts:
        ids = online.encode_chat(text)
        plain = online.generate([ids], params, speculative=False)[0].metrics
        for name, llm in variants:
            rounds[name].calls = 0
            m = llm.generate([ids], params)[0].metrics
            ratios[name].append(m.decode_tokens_per_s / plain.decode_tokens_per_s)
            drafts[name].append(m.num_draft_tokens / max(rounds[name].calls, 1))
    for name, llm in variants:
        acceptance = getattr(llm.engine.budget, "acceptance", None)  # a fixed budget keeps no estimates
        ece = ""
        if acceptance is not None:
            before, after = acceptance.calibration_error()
            ece = f"ECE before STS {before:.3f}  after {after:.3f}  ({len(acceptance.records)} rounds)  "
        print(f"{name:17s} {ece:48s}drafts/round {statistics.mean(drafts[name]):.2f}  "
              f"decode speedup {statistics.geometric_mean(ratios[name]):.3f}x", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
