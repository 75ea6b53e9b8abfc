"""The fused CPU block against the torch blocks, side by side in one run (issue 6).

Default model, CPU, bf16 activations, one forward pass of B rows x T new positions over a
cached 100-token prompt per row (decode: T = 1; verify: T = γ + 1), and prefill passes of
T tokens over an empty cache. Each cell: median ms of ``--rounds`` passes, the two paths
interleaved round by round so that machine noise hits both. The torch blocks are the same
model with its ``cpu_blocks`` set to None, which is what `Transformer.forward` checks.
Passes over `MAX_POSITIONS` positions run the torch blocks either way (reported as such).
With ``--compiled`` a third path runs the torch blocks compiled by `specdecode.model.compiled`
(what ``compile=True`` builds), interleaved with the other two; its first round, which
builds the graphs, is dropped like every path's.

    python benchmarks/bench_block.py [--modes none gguf] [--threads 2] [--rounds 9] [--compiled]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.model.compiled import compile_blocks
from specdecode.model.cpu_block import MAX_POSITIONS
from specdecode.model.loader import load_model

DECODE = [(1, 1), (1, 2), (1, 5), (1, 9), (1, 16), (4, 1), (4, 5), (8, 1), (16, 1), (16, 3), (32, 1), (32, 3)]
PREFILL = [16, 64]


def one_pass(model, B: int, T: int, prompt: int) -> float:
    """ms of one forward of B x T new tokens after ``prompt`` cached tokens per row."""
    cache = model.new_cache(B, prompt + T + 1)
    g = torch.Generator().manual_seed(B * 100 + T)
    if prompt:
        model(torch.randint(0, 1000, (B, prompt), generator=g), torch.arange(prompt).expand(B, prompt), cache)
        cache.commit(torch.full((B,), prompt))
    toks = torch.randint(0, 1000, (B, T), generator=g)
    pos = cache.lengths[:, None] + torch.arange(T)
    start = time.perf_counter()
    model(toks, pos, cache)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["none", "gguf"], help="quantization: none (bf16 weights), gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--compiled", action="store_true", help="also the torch blocks under torch.compile")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    paths = ["fused", "torch"] + ["compiled"] * args.compiled
    extra = " compiled ms | compiled / fused |" if args.compiled else ""
    print(f"| weights | pass | B x T | fused ms | torch ms | torch / fused |{extra}")
    print("|---" * (6 + 2 * args.compiled) + "|")
    for mode in args.modes:
        model = load_model(None, dtype="bfloat16", device="cpu", quantization=None if mode == "none" else mode).model
        fused = model.cpu_blocks
        assert fused is not None, "the fused block does not apply on this machine"
        graphs = []
        if args.compiled:
            compile_blocks(model, "default")
            graphs = [block._compiled_call_impl for block in model.layers]
        cells = [("decode/verify", B, T, 100) for B, T in DECODE] + [("prefill", 1, T, 0) for T in PREFILL]
        with torch.inference_mode():
            for kind, B, T, prompt in cells:
                times: dict[str, list[float]] = {name: [] for name in paths}
                for r in range(args.rounds + 1):
                    for name in paths[r % len(paths):] + paths[: r % len(paths)]:  # rotated each round
                        model.cpu_blocks = fused if name == "fused" else None
                        for block, graph in zip(model.layers, graphs):  # nn.Module.compile sets this one field
                            block._compiled_call_impl = graph if name == "compiled" else None
                        ms = one_pass(model, B, T, prompt)
                        if r:  # the first round warms both up
                            times[name].append(ms)
                model.cpu_blocks = fused
                f, t = statistics.median(times["fused"]), statistics.median(times["torch"])
                note = "" if B * T <= MAX_POSITIONS else " (both torch: over MAX_POSITIONS)"
                w = "bf16" if mode == "none" else mode
                c = statistics.median(times["compiled"]) if args.compiled else 0.0
                cols = f" {c:.1f} | {c / f:.2f}x |" if args.compiled else ""
                print(f"| {w} | {kind}{note} | {B} x {T} | {f:.1f} | {t:.1f} | {t / f:.2f}x |{cols}", flush=True)
        del model


if __name__ == "__main__":
    main()
