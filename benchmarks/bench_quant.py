"""Quantized linears on the default model: every ratio measured side by side in one run.

CPU, batch 1, activations in bf16. For each quantization (none = bf16 weights, int8, int4 g32,
gguf = the file's own Q4_1/Q8_0 blocks; "-a8" = int4 / gguf times int8-quantized activations;
"@stock" = torch's int4 CPU kernel instead of ours;
"gguf@planes" = ours, with the Q8_0 head as two int4 planes instead of its own blocks) it reports:
  1. ms per forward of M = 1, 2, 5, 9, 16 new positions over a cached prompt (the verify cost
     curve of speculative decoding), and the M=5 / M=1 ratio;
  2. greedy decode tok/s (time after the first token) and its speedup over bf16;
  3. how many greedy tokens match the bf16 model's.
Modes are interleaved round by round so that load from other processes hits them alike; the
table reports medians.

    python benchmarks/bench_quant.py [--modes none,int8,int4@stock,int4,gguf@stock,gguf] [--positions 1,2,5,9,16]
                                     [--rounds 15] [--new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch
from args import decode_tokens, positive_int, run

from specdecode.config import SpecDecodeError
from specdecode.entrypoints.cli import OneLineParser
from specdecode.model.cpu_int4 import INT4_CPU_KERNELS
from specdecode.model.gguf_convert import gguf_int4_weights
from specdecode.model.loader import load_model, use_gguf_blocks_
from specdecode.model.packaged import default_model_path
from specdecode.model.quant import describe_kernels, parse_quantization, quantize_model_

PROMPT = "Explain in a few sentences why the sky is blue, then list three other colours of the sky at dusk."


def load(mode: str):
    """``mode`` is a quantization, or "int4@stock" / "gguf@stock" for torch's own int4 CPU kernel,
    or "gguf@planes" for Q8_0 weights as two int4 planes (as before Q8Linear)."""
    quant, _, kernel = mode.partition("@")
    if not kernel:
        return load_model(None, dtype="bfloat16", device="cpu", progress=False, quantization=quant)
    lm = load_model(None, dtype="bfloat16", device="cpu", progress=False)
    if quant == "gguf":
        blocks = gguf_int4_weights(default_model_path(), lm.config.num_heads, lm.config.num_kv_heads)
        if kernel == "planes":  # relabelled, Q8_0 blocks are not recognised as such: they stay planes
            blocks = {k: replace(g, source_type="Q8_0 planes") if g.source_type == "Q8_0" else g
                      for k, g in blocks.items()}  # fmt: skip
            kernel = "auto"
        use_gguf_blocks_(lm.model, lm.config, blocks, int4_kernel=kernel)
    else:
        quantize_model_(lm.model, quant, int4_kernel=kernel)
    return lm


def modes_arg(text: str) -> list[str]:
    """--modes' type: quantizations, each optionally @KERNEL (an int4 kernel, or planes for gguf)."""
    modes = text.split(",")
    for mode in modes:
        quant, _, kernel = mode.partition("@")
        try:
            parse_quantization(quant)
        except SpecDecodeError as e:
            raise argparse.ArgumentTypeError(f"{mode!r}: {e}") from None
        kernels = (*INT4_CPU_KERNELS, "planes") if quant == "gguf" else INT4_CPU_KERNELS
        if kernel and (kernel not in kernels or not (quant.startswith("int4") or quant == "gguf")):
            raise argparse.ArgumentTypeError(f"{mode!r}: @KERNEL goes with int4* or gguf, one of {', '.join(kernels)}")
    return modes


def positions_arg(text: str) -> list[int]:
    """--positions' type: a comma-separated list of integers >= 1."""
    return [positive_int(m) for m in text.split(",")]


def forward_ms(model, cache, context: torch.Tensor, m: int) -> float:
    """One forward of m new positions after ``context`` (in ``cache``); the cache length is left alone."""
    tokens = context[:, torch.arange(m) % context.shape[1]]  # any tokens (the cost does not depend on them), m of them
    positions = cache.lengths[:, None] + torch.arange(m)
    t0 = time.perf_counter()
    model(tokens, positions, cache)
    return (time.perf_counter() - t0) * 1e3


def greedy(model, ids: torch.Tensor, n: int) -> tuple[list[int], float]:
    """Greedy tokens and the decode time (seconds after the first token)."""
    cache = model.new_cache(1, ids.shape[1] + n + 1)
    x, pos, out = ids, torch.arange(ids.shape[1])[None], []
    t_first = None
    for _ in range(n):
        logits = model(x, pos, cache)
        cache.commit(torch.tensor([x.shape[1]]))
        nxt = logits[:, -1].argmax(-1)
        out.append(int(nxt))
        if t_first is None:
            t_first = time.perf_counter()
        x, pos = nxt[:, None], pos[:, -1:] + 1
    return out, time.perf_counter() - t_first


def main() -> int:
    ap = OneLineParser()
    ap.add_argument("--modes", type=modes_arg, default="none,int8,int4@stock,int4,gguf@stock,gguf")
    ap.add_argument("--positions", type=positions_arg, default="1,2,5,9,16")
    ap.add_argument("--rounds", type=positive_int, default=15)
    ap.add_argument("--decode-rounds", type=positive_int, default=3)
    ap.add_argument("--new-tokens", type=decode_tokens, default=64)
    ap.add_argument("--threads", type=positive_int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes, ms = args.modes, args.positions

    loaded = {q: load(q) for q in modes}
    tok = next(iter(loaded.values())).tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = torch.tensor([tok.encode(text)])
    times: dict[tuple[str, int], list[float]] = {(q, m): [] for q in modes for m in ms}
    decode: dict[str, list[float]] = {q: [] for q in modes}
    tokens: dict[str, list[int]] = {}
    caches = {}
    with torch.inference_mode():
        for q, lm in loaded.items():  # prefill the shared context once per model
            caches[q] = cache = lm.model.new_cache(1, ids.shape[1] + max(ms) + 1)
            lm.model(ids, torch.arange(ids.shape[1])[None], cache)
            cache.commit(torch.tensor([ids.shape[1]]))
            for m in ms:  # warm-up
                forward_ms(lm.model, cache, ids, m)
        for _ in range(args.rounds):
            for q, lm in loaded.items():
                for m in ms:
                    times[q, m].append(forward_ms(lm.model, caches[q], ids, m))
        for _ in range(args.decode_rounds):
            for q, lm in loaded.items():
                out, seconds = greedy(lm.model, ids, args.new_tokens)
                tokens[q] = out
                decode[q].append((len(out) - 1) / seconds)

    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {q: statistics.median(v) for q, v in decode.items()}
    base = modes[0]
    print(f"\n$ python {' '.join(sys.argv)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 activations, prompt {ids.shape[1]} tokens, "
          f"medians of {args.rounds} rounds (forward) / {args.decode_rounds} (decode)")  # fmt: skip
    head = "| mode | " + " | ".join(f"M={m} ms" for m in ms) + " | M=5/M=1 | decode tok/s | vs " + base
    head += f" | greedy = {base} |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for q in modes:
        row = [f"{med[q, m]:.1f}" for m in ms]
        ratio = f"{med[q, 5] / med[q, 1]:.2f}x" if 5 in ms and 1 in ms else "-"
        same = sum(a == b for a, b in zip(tokens[q], tokens[base]))
        first_diff = next((i for i, (a, b) in enumerate(zip(tokens[q], tokens[base])) if a != b), None)
        agree = f"{same}/{len(tokens[base])}" + (f" (first diff @{first_diff})" if first_diff is not None else "")
        print(f"| {q} | " + " | ".join(row) + f" | {ratio} | {tps[q]:.1f} | {tps[q] / tps[base]:.2f}x | {agree} |")
    print()
    for q, lm in loaded.items():
        print(f"{q}: {describe_kernels(lm.model)}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
