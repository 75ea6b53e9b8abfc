"""The `specdecode theory` command: the expected speedup (Leviathan et al.) and the verification
roofline, printed or as one JSON object.

Owns: its arguments, their checks and the printing. Does not own: the formulas and the
roofline model (analysis/theory.py, analysis/roofline.py).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from specdecode.config import SpecDecodeError


def add_theory_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument("--alpha", type=float, default=None, help="per-position acceptance rate α in [0, 1]")
    t.add_argument("--gamma", type=int, default=None, help="draft length γ (omit to print the optimal γ)")
    t.add_argument("--c", type=float, default=0.05, help="draft step cost / target step cost (default 0.05)")
    t.add_argument("--model", default=None, help="roofline for this model: llama-3-8b, llama-3-70b or a model path/alias")
    t.add_argument("--hardware", default=None, help="h100, a100, h200, or local (profiles the machine it runs on)")
    t.add_argument("--batch", type=int, default=64, help="roofline batch size B (default 64)")
    t.add_argument("--json", action="store_true")


def cmd_theory(args: argparse.Namespace) -> int:
    """The speedup formula (--alpha), the roofline (--model/--hardware), or both (--json: one object)."""
    roofline = args.model is not None or args.hardware is not None
    if args.alpha is None and not roofline:
        raise SpecDecodeError("theory needs --alpha (speedup formula) and/or --model/--hardware (roofline)")
    if not (math.isfinite(args.c) and args.c >= 0):
        raise SpecDecodeError(f"--c must be a finite number >= 0, got {args.c}")
    # both computed before anything is printed: a bad --model must not follow a printed formula
    speedup = cmd_speedup(args) if args.alpha is not None else None
    if speedup is not None:  # the roofline of the γ the formula used (the optimal one if none was given)
        args = argparse.Namespace(**{**vars(args), "gamma": speedup["gamma"]})
    roof = cmd_roofline(args) if roofline else None
    if args.json:
        both = speedup is not None and roof is not None
        print(json.dumps({"speedup": speedup, "roofline": roof} if both else speedup or roof))
        return 0
    if speedup is not None:
        _print_speedup(speedup)
    if roof is not None:
        _print_roofline(roof)
    return 0


def cmd_speedup(args: argparse.Namespace) -> dict[str, Any]:
    from specdecode.analysis.theory import expected_speedup, expected_tokens_per_round, optimal_gamma

    gamma = args.gamma if args.gamma is not None else optimal_gamma(args.alpha, args.c)
    result = {  # γ = 0 is plain decoding (1.00x), as the roofline takes it
        "alpha": args.alpha,
        "gamma": gamma,
        "c": args.c,
        "optimal_gamma": args.gamma is None,
        "tokens_per_round": expected_tokens_per_round(args.alpha, gamma),
        "speedup": expected_speedup(args.alpha, gamma, args.c),
    }
    return result


def _print_speedup(r: dict[str, Any]) -> None:
    label = "optimal γ" if r["optimal_gamma"] else "γ"
    print(f"α = {r['alpha']}, {label} = {r['gamma']}, c = {r['c']}")
    print(f"expected tokens per round: {r['tokens_per_round']:.2f}")
    print(f"expected speedup:          {r['speedup']:.2f}x")


MAX_ROOFLINE_BATCH = 10**9  # a larger integer would overflow the float time


def cmd_roofline(args: argparse.Namespace) -> dict[str, Any]:
    from specdecode.analysis.roofline import Roofline, resolve_hardware, resolve_model
    from specdecode.analysis.theory import MAX_THEORY_GAMMA

    gamma = 4 if args.gamma is None else args.gamma
    if not 1 <= args.batch <= MAX_ROOFLINE_BATCH or not 0 <= gamma <= MAX_THEORY_GAMMA:
        raise SpecDecodeError(f"--batch must be in [1, {MAX_ROOFLINE_BATCH}] and --gamma in [0, {MAX_THEORY_GAMMA}], "
                              f"got {args.batch} and {gamma}")  # fmt: skip
    roof = Roofline(resolve_model(args.model or "llama-3-8b"), resolve_hardware(args.hardware or "h100"))
    positions = args.batch * (gamma + 1)
    result = {
        "model": roof.model.name,
        "hardware": roof.hardware.name,
        "flops_per_s": roof.hardware.flops,
        "bandwidth_bytes_per_s": roof.hardware.bandwidth,
        "flops_per_position": roof.flops_per_position,
        "weight_bytes": roof.model.weight_bytes,
        "weight_read_ms": roof.weight_read_s * 1e3,
        "threshold_positions": roof.threshold_positions,
        "batch": args.batch,
        "gamma": gamma,
        "positions": positions,
        "compute_ms": roof.compute_s(positions) * 1e3,
        "verification_free": roof.compute_s(positions) <= roof.weight_read_s,
    }
    return result


def _print_roofline(r: dict[str, Any]) -> None:
    print(f"{r['model']} on {r['hardware']}: {r['flops_per_s'] / 1e12:.1f} TFLOP/s, {r['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s")
    print(f"FLOPs per verified position: {r['flops_per_position']:.3g} (matrices + LM head)")
    print(f"weight read: {r['weight_bytes'] / 1e9:.2f} GB in {r['weight_read_ms']:.2f} ms")
    print(f"threshold B·(γ+1): {r['threshold_positions']:.0f} positions")
    verdict = "free" if r["verification_free"] else "NOT free: compute exceeds the weight read"
    print(f"B = {r['batch']}, γ = {r['gamma']}: {r['positions']} positions, "
          f"compute {r['compute_ms']:.2f} ms -> verification {verdict}")
