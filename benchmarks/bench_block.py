"""The fused CPU block against the torch blocks, side by side in one run.

Default model, CPU, bf16 activations, one forward pass of B rows x T new positions over a
cached 100-token prompt per row (decode: T = 1; verify: T = γ + 1), and prefill passes of
T tokens over an empty cache. Each cell: median ms of ``--rounds`` passes, the two paths
interleaved round by round so that machine noise hits both. The torch blocks are the same
model with its ``cpu_blocks`` set to None, which is what `Transformer.forward` checks.
Passes over `MAX_POSITIONS` positions run the torch blocks either way (reported as such).
With ``--compiled [MODE]`` a third path runs the torch blocks compiled by
`specdecode.model.compiled` (what ``compile=True`` builds), interleaved with the other two;
its first round, which builds the graphs, is dropped like every path's. ``--device cuda``
times the torch blocks eager against compiled (``--compiled reduce-overhead`` for CUDA graphs),
with no fused path.

    python benchmarks/bench_block.py [--modes none gguf] [--threads 2] [--rounds 9] [--compiled [MODE]] [--device cuda]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from args import device, positive_int, run

from specdecode.entrypoints.cli import OneLineParser
from specdecode.model.compiled import compile_blocks, parse_compile
from specdecode.model.cpu_block import MAX_POSITIONS
from specdecode.model.loader import load_model

DECODE = [(1, 1), (1, 2), (1, 5), (1, 9), (1, 16), (4, 1), (4, 5), (8, 1), (16, 1), (16, 3), (32, 1), (32, 3)]
PREFILL = [16, 64]


def one_pass(model, B: int, T: int, prompt: int) -> float:
    """ms of one forward of B x T new tokens after ``prompt`` cached tokens per row."""
    device = model.embed.weight.device
    cache = model.new_cache(B, prompt + T + 1)
    g = torch.Generator().manual_seed(B * 100 + T)
    if prompt:
        ids = torch.randint(0, 1000, (B, prompt), generator=g).to(device)
        model(ids, torch.arange(prompt, device=device).expand(B, prompt), cache)
        cache.commit(torch.full((B,), prompt, device=device))
    toks = torch.randint(0, 1000, (B, T), generator=g).to(device)
    pos = cache.lengths[:, None] + torch.arange(T, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    model(toks, pos, cache)
    sync()
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["none", "gguf"], help="quantization: none (bf16 weights), gguf")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (on CUDA the fused block does not run)")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=9)
    ap.add_argument("--compiled", nargs="?", const="auto", default=None,
                    help="also the torch blocks under torch.compile, in this mode (auto = default; reduce-overhead: CUDA graphs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    compile_mode = parse_compile(args.compiled) if args.compiled else None
    for mode in args.modes:
        model = load_model(args.model, dtype="bfloat16", device=args.device, quantization=None if mode == "none" else mode).model
        fused = model.cpu_blocks
        paths = ["fused"] * (fused is not None) + ["torch"] + ["compiled"] * (compile_mode is not None)
        print(f"\n| weights | pass | B x T | {' | '.join(f'{p} ms' for p in paths)} | "
              + " | ".join(f"{p} / {paths[0]}" for p in paths[1:]) + " |")
        print("|---" * (3 + 2 * len(paths) - 1) + "|")
        graphs = []
        if compile_mode is not None:
            compile_blocks(model, compile_mode)
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
                        if r:  # the first round warms every path up (and builds the graphs)
                            times[name].append(ms)
                model.cpu_blocks = fused
                med = [statistics.median(times[name]) for name in paths]
                note = " (fused: torch, over MAX_POSITIONS)" if fused is not None and B * T > MAX_POSITIONS else ""
                w = "bf16" if mode == "none" else mode
                ratios = " | ".join(f"{m / med[0]:.2f}x" for m in med[1:])
                print(f"| {w} | {kind}{note} | {B} x {T} | {' | '.join(f'{m:.1f}' for m in med)} | {ratios} |", flush=True)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
