"""Our int4 CPU kernel at two revisions, side by side in one process.

Kernel work needs an A/B that separate runs cannot give on a shared machine with few cores:
there the same pass moves from one process to the next by more than most kernel changes are
worth, so alternating runs of `bench_quant.py` can rank two kernels the wrong way round. This
builds our library from the kernel sources at ``--rev`` (``git show``)
and from the working tree, loads both, and times ``int4_gemm`` over the default model's four
linear shapes (qkv, o, gate|up, down of a 576-wide layer) at each row count, the two builds
interleaved round by round; it prints medians and their ratio.

    python benchmarks/bench_kernels.py [--rev HEAD] [--isa avx2] [--rows 1 2 3 4 5] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from ctypes import CDLL

import torch
from args import positive_int, run

from specdecode.entrypoints.cli import OneLineParser
from specdecode.model import cpu_int4
from specdecode.model.quant import Int4Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate|up, down


def build(isa: str, rev: str | None) -> CDLL:
    """Our library for ``isa`` from the kernel sources at ``rev`` (None: the working tree)."""
    read = cpu_int4._read
    if rev is not None:
        cpu_int4._read = lambda name: subprocess.check_output(
            ["git", "show", f"{rev}:specdecode/model/kernels/{name}"], text=True
        )
    try:
        lib = cpu_int4.cpu_lib.__wrapped__(isa)  # past the cache: one library per source text
    finally:
        cpu_int4._read = read
    if lib is None:
        raise SystemExit(f"the host CPU or compiler cannot build the {isa} kernels")
    return lib


def rev_arg(rev: str) -> str:
    """--rev's type: a commit of the repository in the working directory."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], capture_output=True)
    if found.returncode:
        raise argparse.ArgumentTypeError(f"{rev!r} is not a commit of the git repository here")
    return rev


def time_gemm(lib: CDLL, lins: list[Int4Linear], rows: int, threads: int, reps: int = 40) -> float:
    """Median seconds of one int4_gemm over every shape at ``rows`` rows."""
    xs = [torch.randn(rows, k).bfloat16() for _, k in SHAPES]
    ys = [torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in SHAPES]
    sums = [torch.empty(rows * k // 32) for _, k in SHAPES]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for lin, x, y, s, (n, k) in zip(lins, xs, ys, sums, SHAPES):
            lib.int4_gemm(x.data_ptr(), rows, k, lin.weight.data_ptr(), lin.scales_and_zeros.data_ptr(), n,
                          y.data_ptr(), s.data_ptr(), threads)  # fmt: skip
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", type=rev_arg, default="HEAD", help="the revision to compare the working tree with")
    ap.add_argument("--isa", default="avx2", choices=sorted(cpu_int4.CPU_ISAS))
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--threads", type=positive_int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = {args.rev: build(args.isa, args.rev), "working tree": build(args.isa, None)}
    g = torch.Generator().manual_seed(0)
    lins = [Int4Linear.from_weight(torch.randn(n, k, generator=g), 32, kernel=args.isa) for n, k in SHAPES]
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for rows in args.rows:
            for name, lib in libs.items():
                runs.setdefault((name, rows), []).append(time_gemm(lib, lins, rows, args.threads))
    print(f"{args.isa} int4_gemm over {len(SHAPES)} shapes, {args.threads} threads, medians of {args.rounds} rounds")
    print(f"| rows | {args.rev} us | working tree us | working tree / {args.rev} |")
    print("|---|---|---|---|")
    for rows in args.rows:
        a, b = (statistics.median(runs[name, rows]) * 1e6 for name in libs)
        print(f"| {rows} | {a:.0f} | {b:.0f} | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
