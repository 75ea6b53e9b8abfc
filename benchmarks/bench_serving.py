"""Serving under load: no speculation, fixed γ and the adaptive budget, side by side.

An in-process closed-loop load generator drives one `ServingEngine` per configuration
(all over one loaded model): C clients each submit their next request as soon as their
previous one finishes, so requests arrive while the engine steps. The request mix is
fixed: request i is prompt i of a deterministic interleaving of prompts.json's kinds
(chat template applied), greedy, ``--max-tokens`` new tokens (EOS may end it earlier),
max(``--min-requests``, ``--requests-per-client`` · C) requests per load. Configurations
are interleaved within each load so they share the machine's noise: each configuration's loop
keeps its own clock (the seconds of its own submissions and steps), and by default the next
engine step is always the loop whose clock is behind (``--interleave steps``: the loops step
in turn; ``runs``: one loop after another). With ``--repeats R`` each load runs every
configuration R times (the order rotated each time), reports the pooled figures, and each
configuration's throughput over *none*'s in the same repetition (a paired ratio: both met
the same stretch of machine noise): median and range, and the geometric mean with its 95%
t interval. ``--control`` adds a second *none* (``none′``), whose paired ratio shows how far
two identical configurations drift apart in the run: the noise any other ratio sits in.

Per configuration and load it reports output throughput (output tokens / wall time of the
load), per-user speed (mean over requests of output tokens / (finish − submit), and of
decode tokens / (finish − first token)), τ, α, the policy's mean budget per row, what the
drafter actually proposed per row, and the positions each verify pass computed (rows +
their drafts: the pass runs its linears on real tokens only). Also: the B·(γ+1) threshold of this
CPU (roofline from a local profile, and the knee of the measured verify-cost curve), and
the expected calibration error of the adaptive policy's per-position estimates, from the
shared prior alone (before) and with each request's own counts (after).

Configurations: none, ngram with each fixed γ of ``--gammas``, and the engine's adaptive
budget (γ ≤ ``--adaptive-gamma``). The budget policies are wrapped (`Recording`), which also
receives each verify pass's positions and time from the engine; it and the closed loops live in
load.py.

    python benchmarks/bench_serving.py [--clients 1 4 16 32] [--max-tokens 64] [--gammas 2 4 8]
        [--threads 2] [--quantization none|gguf|gguf-a8|int8|int4] [--repeats 3] [--interleave clock|steps|runs]
        [--control] [--json out.json] [--plot docs/serving_throughput.png]
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
from args import decode_tokens, device, nonneg_int, out_path, positive_int, run
from load import Calibration, ClosedLoop, Recording, ece, merge_runs, run_load, run_loads
from timing import paired_interval

from specdecode.drafters.registry import parse_spec
from specdecode.engine.acceptance import AFTER_FULL, AFTER_MISS, AFTER_NOTHING
from specdecode.engine.adaptive import AdaptiveBudget
from specdecode.engine.cost import VerifyCost, least_squares_line
from specdecode.engine.serving import ServingEngine
from specdecode.entrypoints.cli import OneLineParser
from specdecode.model.loader import LoadedModel, load_model
from specdecode.analysis.roofline import Roofline, profile_local, shape_from_config

HERE = Path(__file__).parent


# ---- the request mix -------------------------------------------------------------------


def request_mix(model: LoadedModel) -> list[tuple[str, list[int]]]:
    """(kind, chat-templated prompt ids), the kinds interleaved: chat, reuse, chat, reuse, ..."""
    prompts = json.loads((HERE / "prompts.json").read_text())
    queues = {kind: list(texts) for kind, texts in prompts.items()}
    mix = []
    while any(queues.values()):
        for kind, q in queues.items():
            if q:
                mix.append((kind, encode_chat(model, q.pop(0))))
    return mix


def encode_chat(model: LoadedModel, text: str) -> list[int]:
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)  # fmt: skip
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- the verify cost on the machine the benchmark runs on -----------------------------------


def fit_line(curve: VerifyCost) -> tuple[float, float]:
    """Least-squares t(P) = a + m·P through the curve's points, a and m kept ≥ 0."""
    return fit_points(curve.points)


def fit_points(points: list[tuple[float, float]]) -> tuple[float, float]:
    """t = a + m·P through the points, a and m kept >= 0 (one point: a flat line)."""
    if len({p for p, _ in points}) < 2:
        return points[0][1], 0.0
    m = max(0.0, least_squares_line(points)[1])
    return max(0.0, statistics.fmean(t for _, t in points) - m * statistics.fmean(p for p, _ in points)), m


def threshold_report(model: LoadedModel, curve: VerifyCost) -> dict:
    """The roofline threshold from a local profile of the model's device, and the knee of the
    measured verify-cost curve: with t(P) ≈ a + m·P fitted, the P at which the per-position
    cost m·P equals the fixed cost a (the roofline's threshold has the same meaning)."""
    hw = profile_local(model.model.embed.weight.device)
    shape = shape_from_config(model.name, model.config)
    # the bytes the loaded weights hold (GGUF / int4 blocks: ~0.6 of bf16), each tensor once (tied)
    held = {t.data_ptr(): t.numel() * t.element_size() for t in model.model.state_dict().values()}
    shape = dataclasses.replace(shape, bytes_per_param=shape.bytes_per_param * sum(held.values()) / shape.weight_bytes)
    roof = Roofline(shape, hw)
    a, m = fit_line(curve)
    return {
        "hardware": hw.name,
        "flops": hw.flops,
        "bandwidth": hw.bandwidth,
        "flops_per_position": roof.flops_per_position,
        "weight_read_ms": roof.weight_read_s * 1e3,
        "roofline_threshold": roof.threshold_positions,
        "curve_ms": [(p, t * 1e3) for p, t in curve.points],
        "fit_ms": (a * 1e3, m * 1e3),
        "curve_knee": a / m if m > 0 else float("inf"),
    }


# ---- output -----------------------------------------------------------------------------


def print_results(
    results: list[dict], configs: list[str], args, threshold: dict, calib: dict[str, Calibration],
    paired: dict[int, dict[str, list[float]]],
) -> None:
    print(f"\n### Serving under load: default model, {weights_name(args)}, {device_name(args)}, greedy, "
          f"{args.max_tokens} new tokens max, requests per load = max({args.min_requests}, "
          f"{args.requests_per_client}·clients)\n")  # fmt: skip
    print(
        "| clients | config | throughput tok/s | per-user tok/s (e2e) | per-user decode tok/s | TTFT s | τ | α "
        "| budget/row | drafted/row | positions/step | rows/step | pass ms | pass share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['clients']} | {r['config']} | {r['throughput']:.1f} | {r['per_user_e2e']:.2f} | "
              f"{r['per_user_decode']:.2f} | {r['ttft_s']:.2f} | {r['tau']:.2f} | {r['alpha']:.2f} | "
              f"{r['budget_per_row']:.2f} | {r['drafted_per_row']:.2f} | {r['positions_per_step']:.1f} | "
              f"{r['rows_per_step']:.1f} | {r['pass_ms']:.1f} | {r['pass_share']:.2f} |")  # fmt: skip
    kinds = sorted(k for k in results[0] if k.startswith("per_user["))
    print("\nPer-user tok/s (e2e) by prompt kind:\n")
    print("| clients | config | " + " | ".join(k[len("per_user[") : -1] for k in kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    for r in results:
        print(f"| {r['clients']} | {r['config']} | " + " | ".join(f"{r[k]:.2f}" for k in kinds) + " |")
    variants = [k for k in configs if k.startswith("adaptive")]
    print("\n| clients | policy | / none (throughput) | best fixed | / best fixed (throughput) "
          "| / best fixed (per-user) | / none (per-user) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    checks = []
    loads = sorted({r["clients"] for r in results})
    for c in loads:
        at = {r["config"]: r for r in results if r["clients"] == c}
        none = at["none"]
        fixed = [at[k] for k in configs if k.startswith("γ=")]
        best = max(fixed, key=lambda r: r["throughput"])
        for v in variants:
            ad = at[v]
            print(f"| {c} | {v} | {ad['throughput'] / none['throughput']:.2f}x | {best['config']} | "
                  f"{ad['throughput'] / best['throughput']:.2f}x | {ad['per_user_e2e'] / best['per_user_e2e']:.2f}x | "
                  f"{ad['per_user_e2e'] / none['per_user_e2e']:.2f}x |")  # fmt: skip
            if v == "adaptive":  # the default floor; below 1 a floor may trade throughput away
                ratios = paired[c][v]
                text = f"{v}, {c} clients: throughput ≥ none (pooled {ad['throughput'] / none['throughput']:.3f}x"
                if len(ratios) > 1:
                    text += ", paired {:.3f}x [95%: {:.3f}-{:.3f}]".format(*paired_interval(ratios))
                checks.append((text + ")", ad["throughput"] >= none["throughput"]))
            if c == loads[0]:
                checks.append((f"{v}, {c} client(s): throughput within 5% of the best fixed γ ({best['config']})",
                               ad["throughput"] >= 0.95 * best["throughput"]))  # fmt: skip
        if c == loads[-1]:  # per-user speed at equal throughput: some floor φ gives more of both than each γ
            for f in fixed:
                by = [v for v in variants if at[v]["per_user_e2e"] > f["per_user_e2e"] and at[v]["throughput"] >= f["throughput"]]
                text = f"{c} clients: per-user speed above {f['config']}'s at no less throughput"
                checks.append((f"{text} ({', '.join(by) or 'no adaptive variant'})", bool(by)))
    print()
    for text, ok in checks:
        print(f"- {'met' if ok else 'NOT met'}: {text}")
    print(f"\nB·(γ+1) threshold on this {'GPU' if args.device.startswith('cuda') else 'CPU'}: roofline {threshold['roofline_threshold']:.1f} positions "
          f"({threshold['hardware']}: {threshold['flops'] / 1e9:.0f} GFLOP/s, "
          f"{threshold['bandwidth'] / 1e9:.1f} GB/s; {threshold['flops_per_position'] / 1e6:.0f} MFLOP/position, "
          f"{threshold['weight_read_ms']:.1f} ms weight read); knee of the measured verify-cost curve "
          f"{threshold['curve_knee']:.1f} positions (fit t(P) = {threshold['fit_ms'][0]:.1f} ms + "
          f"{threshold['fit_ms'][1]:.2f} ms·P)")  # fmt: skip
    passes = [(p, t) for r in results for p, t in r["passes"]]
    if len(passes) > 1:
        a, m = fit_points(passes)
        print(
            f"verify passes of the run ({len(passes)}, all configs and loads), least squares: t = {a * 1e3:.1f} ms + "
            f"{m * 1e3:.2f} ms · positions; knee {a / m if m > 0 else float('inf'):.1f} positions"
        )
    print("verify-cost curve (positions in one row: ms): "
          + ", ".join(f"{p}: {t:.1f}" for p, t in threshold["curve_ms"]))  # fmt: skip
    for name, cal in calib.items():
        print(f"\n{name} calibration (ECE, 10 bins, {len(cal.surv_online)} drafted positions): survival s_k "
              f"before (shared prior) {ece(cal.surv_prior):.3f}, after (per-request online) {ece(cal.surv_online):.3f}; "
              f"conditional c_k before {ece(cal.cond_prior):.3f}, after {ece(cal.cond_online):.3f}; counting rows "
              f"that drafted nothing as rejected at position 1 ({len(cal.plan_online)} pairs): before "
              f"{ece(cal.plan_prior):.3f}, after {ece(cal.plan_online):.3f}")  # fmt: skip


def weights_name(args) -> str:
    return "bf16" if args.quantization == "none" else args.quantization


def device_name(args) -> str:
    if args.device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(args.device))
    return f"CPU ({torch.get_num_threads()} threads)"


def plot(results: list[dict], configs: list[str], path: str, weights: str = "bf16", device: str = "CPU") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for cfg in configs:
        rows = sorted((r for r in results if r["config"] == cfg), key=lambda r: r["clients"])
        x = [r["clients"] for r in rows]
        style = {"adaptive": {"linewidth": 2.5, "color": "black"},
                 "adaptive*": {"linewidth": 2, "color": "black", "linestyle": "--"}}.get(cfg, {})  # fmt: skip
        axes[0].plot(x, [r["throughput"] for r in rows], marker="o", label=cfg, **style)
        axes[1].plot(x, [r["per_user_e2e"] for r in rows], marker="o", label=cfg, **style)
    for ax, title in zip(axes, ("output throughput (tok/s)", "per-user tok/s (output tokens / latency)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["clients"] for r in results}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[1].yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    axes[1].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes[1].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].legend()
    fig.suptitle(f"SmolLM2-135M, {weights}, {device}, greedy, ngram drafts: "
                 "serving under closed-loop load")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


# ---- main -------------------------------------------------------------------------------


def main() -> int:
    ap = OneLineParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", type=positive_int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests-per-client", type=nonneg_int, default=6,
                    help="requests per client and load: few make the run mostly ramp-up and drain")
    ap.add_argument("--min-requests", type=positive_int, default=8)
    ap.add_argument("--max-tokens", type=decode_tokens, default=64)
    ap.add_argument("--gammas", type=positive_int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--adaptive-gamma", type=positive_int, default=8)
    ap.add_argument("--adaptive-floors", type=float, nargs="*", default=[],
                    help="also run the adaptive budget with these throughput_floor values (< 1: it may trade "
                         "that share of the throughput optimum's throughput for per-user speed)")
    ap.add_argument("--max-model-len", type=positive_int, default=1024)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--quantization", default="none",
                    help="weights: none (bf16), gguf (the file's Q4_1 blocks), gguf-a8 "
                         "(the same times int8 activations), int8, int4")
    ap.add_argument("--load-warmup", type=nonneg_int, default=0,
                    help="untimed requests per client that every configuration serves at each load first "
                         "(on CUDA the first configuration at a new batch size otherwise pays for warming it up)")
    ap.add_argument("--repeats", type=positive_int, default=1, help="runs of every configuration per load, interleaved")
    ap.add_argument("--interleave", choices=("clock", "steps", "runs"), default="clock",
                    help="clock: a repetition runs every configuration's load together, one engine step at a "
                         "time, the next from the configuration whose own clock is behind (paired in time); "
                         "steps: every configuration steps in turn (paired at the step); runs: one "
                         "configuration's load after another")
    ap.add_argument("--control", action="store_true",
                    help="also run a second no-speculation engine (none′): an A/A control for the paired ratios")
    ap.add_argument("--json", type=out_path, default=None, help="also write the raw results here")
    ap.add_argument("--plot", type=out_path, default=None, help="write the throughput / per-user plot (PNG) here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    specs: dict[str, dict | None] = {"none": None} | ({"none′": None} if args.control else {})
    specs.update({f"γ={g}": {"method": "ngram", "num_speculative_tokens": g} for g in args.gammas})
    specs["adaptive"] = {"method": "ngram", "num_speculative_tokens": args.adaptive_gamma, "verify_budget": "adaptive"}
    for floor in args.adaptive_floors:  # the same policy, allowed to trade throughput for per-user speed
        specs[f"adaptive φ={floor:g}"] = dict(specs["adaptive"], throughput_floor=floor)
    parsed = {name: parse_spec(spec) for name, spec in specs.items()}  # a bad γ or floor before the load
    model = load_model(args.model, dtype="bfloat16", device=args.device, quantization=args.quantization)
    mix = request_mix(model)
    engines = {}
    for name, spec in parsed.items():
        engine = ServingEngine(model, spec, max_model_len=args.max_model_len,
                               max_num_seqs=max(args.clients))  # fmt: skip
        engines[name] = engine
    adaptive: AdaptiveBudget = engines["adaptive"].budget  # its verify-cost curve was measured just now
    print("adaptive verify-cost curve (ms):", [(p, round(t * 1e3, 1)) for p, t in adaptive.cost.points], flush=True)
    for engine in engines.values():
        engine.budget = Recording(engine.budget)
        run_load(engine, mix, clients=2, num_requests=2, max_tokens=8)  # warm-up, untimed
        engine.budget.steps, engine.budget.passes, engine.budget.calib = (
            [],
            [],
            Calibration(),
        )  # calibration over the timed runs only
    configs = list(engines)

    results, paired = [], {}
    for clients in args.clients:
        n = max(args.min_requests, args.requests_per_client * clients)
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for name in configs if args.load_warmup else []:  # untimed, and out of the calibration pairs
            kept, engines[name].budget.calib = engines[name].budget.calib, Calibration()
            run_load(engines[name], mix, clients, args.load_warmup * clients, args.max_tokens)
            engines[name].budget.calib = kept
        for rep in range(args.repeats):
            # each repetition runs every configuration once, the order rotated and every other
            # repetition reversed, so that no configuration always meets the machine in the same
            # state (a rotation alone keeps each one's neighbours, and a configuration that leaves
            # the machine slower, e.g. its allocator or caches in another state, always hits the same one)
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            order = order[::-1] if rep % 2 else order
            if args.interleave != "runs":  # all at once, one engine step at a time
                loops = [ClosedLoop(engines[name], mix, clients, n, args.max_tokens) for name in order]
                done = run_loads(loops, args.interleave)
            else:
                done = [run_load(engines[name], mix, clients, n, args.max_tokens) for name in order]
            for name, r in zip(order, done):
                runs[name].append(r)
                print(f"[{clients} clients, {n} requests, rep {rep + 1}] {name}: {r['throughput']:.1f} tok/s, "
                      f"per-user {r['per_user_e2e']:.2f} tok/s, τ={r['tau']:.2f}, α={r['alpha']:.2f}, budget/row "
                      f"{r['budget_per_row']:.2f}, positions/step {r['positions_per_step']:.1f}, {r['wall_s']:.1f} s",
                      flush=True)  # fmt: skip
        for name in configs:
            results.append(dict(merge_runs(runs[name]), config=name))
        # the same repetition's runs met similar noise: their ratios are paired
        paired[clients] = {name: [a["throughput"] / b["throughput"] for a, b in zip(runs[name], runs["none"])]
                           for name in configs}  # fmt: skip

    print(f"adaptive's cost model at the end: t(P) through {[(p, round(t * 1e3, 1)) for p, t in adaptive.cost.points]} "
          f"ms, + {adaptive.attention_cost * 1e6:.3f} µs per attention query and context token, drafting {adaptive.draft_cost * 1e3:.2f} ms "
          f"per depth", flush=True)  # fmt: skip
    labels = ((AFTER_NOTHING, "after the drafter found nothing (or no round yet)"), (AFTER_MISS, "after a rejection"),
              (AFTER_FULL, "after a fully accepted round"))
    for state, label in labels:
        c = adaptive.acceptance.shared()[state].tolist()
        print(f"adaptive's shared c_k {label}: {[round(x, 2) for x in c]} over "
              f"{int(adaptive.acceptance.reached[state, 0])} rounds (real and shadow)", flush=True)  # fmt: skip
    threshold = threshold_report(model, adaptive.cost)
    calib = {name: engines[name].budget.calib for name in configs if name.startswith("adaptive")}
    print_results(results, configs, args, threshold, calib, paired)
    # Sequential Temperature Scaling itself: fitted on the older half of each adaptive engine's
    # recorded rounds (every load), its ECE of block survival on the newer half, before and after
    sts = {name: engines[name].budget.inner.acceptance.calibration_error() for name in calib}
    for name, (before, after) in sts.items():
        rounds = len(engines[name].budget.inner.acceptance.records)
        print(f"{name}: survival ECE over the newer half of its last {rounds} rounds (real and shadow), STS fitted "
              f"on the older half: before {before:.3f}, after {after:.3f}")  # fmt: skip
    if args.repeats > 1:
        print("\nthroughput / none's in the same repetition (median, min-max):")
        for clients, ratios in paired.items():
            print(f"- {clients} clients: " + "; ".join(
                f"{name} {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})" for name, r in ratios.items()
                if name != "none"))  # fmt: skip
        print("\nthroughput / none's in the same repetition (geometric mean [95% t interval]):")
        for clients, ratios in paired.items():
            print(f"- {clients} clients: " + "; ".join(
                "{} {:.3f}x [{:.3f}-{:.3f}]".format(name, *paired_interval(r)) for name, r in ratios.items()
                if name != "none"))  # fmt: skip
    if args.plot:
        plot(results, configs, args.plot, weights_name(args), device_name(args))
    if args.json:
        kinds = ("surv_prior", "surv_online", "cond_prior", "cond_online", "plan_prior", "plan_online")
        out = {
            "args": vars(args),
            "results": results,
            "threshold": threshold,
            "ece": {name: {k: ece(getattr(c, k)) for k in kinds} for name, c in calib.items()},
            "ece_sts_held_out": {name: {"before": b, "after": a} for name, (b, a) in sts.items()},
            "paired": paired,  # per load and configuration: throughput / none's, one per repetition
        }
        Path(args.json).write_text(json.dumps(out, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
