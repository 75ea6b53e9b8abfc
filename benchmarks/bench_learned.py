"""Learned drafters against plain decoding and the early-exit baseline.

For each method: α, τ, acceptance by position, tokens per round, the cost ratio c and the
decode speedup against our plain decoding of the same model, beside Leviathan's
prediction (1 − α^(γ+1)) / ((1 − α)(γc + 1)). Default model, CPU, batch 1, 128 new
tokens, greedy and temperature 0.7, on chat, code and summarisation prompts that are not
in the training data (benchmarks/prompts_learned.json). Every method runs right after
plain decoding of the same prompt, in one process. With ``--repeats R`` each prompt runs R
times, the methods in an order rotated each time (so that none always runs furthest from its
plain run); the speedup is then the geometric mean over prompts x repetitions, with its 95% t
interval over prompts (benchmarks/timing.py; a prompt's repetitions, which differ by timing
noise only, are first averaged into one ratio: the prompt is the sampling unit). α, τ,
tokens/round and c are means over runs.

    python benchmarks/bench_learned.py --threads 2 --json learned.json --plot docs/learned_acceptance.png

Methods are given as NAME=JSON (a speculative_config) or as a name from METHODS.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from args import decode_tokens, nonneg_float, out_path, positive_int, run, write_results
from timing import Timer, paired_interval

from specdecode import LLM, SamplingParams
from specdecode.drafters.registry import parse_spec
from specdecode.config import SpecDecodeError
from specdecode.entrypoints.cli import OneLineParser
from specdecode.entrypoints.outputs import RequestOutput
from specdecode.analysis.theory import expected_speedup

HERE = Path(__file__).resolve().parent
METHODS = {
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "num_speculative_tokens": 1},  # eagle's default γ
    "eagle_g2": {"method": "eagle", "num_speculative_tokens": 2},  # one draft token deeper than the default
    "eagle_tree": {"method": "eagle", "num_speculative_tokens": 3, "topk": 4, "num_draft_tokens": 8},
    "eagle_g8": {"method": "eagle", "num_speculative_tokens": 8},
    # prompt lookup beside the net: a row whose suffix n-gram occurred before drafts up to 8 copied tokens
    "eagle_lookup": {"method": "eagle", "num_speculative_tokens": 8, "num_steps": 1, "prompt_lookup_max": 5},
    "eagle_tree_lookup": {"method": "eagle", "num_speculative_tokens": 8, "num_steps": 3, "topk": 4,
                          "num_draft_tokens": 8, "prompt_lookup_max": 5},  # fmt: skip
    # and in the datastore of the target's own answers shipped with the package (REST)
    "eagle_datastore": {"method": "eagle", "num_speculative_tokens": 8, "num_steps": 1, "prompt_lookup_max": 5,
                        "datastore": True},  # fmt: skip
    "eagle_tree_datastore": {"method": "eagle", "num_speculative_tokens": 8, "num_steps": 3, "topk": 4,
                             "num_draft_tokens": 8, "prompt_lookup_max": 5, "datastore": True},  # fmt: skip
    # smaller trees beside the copies: 6 nodes (3 deep, top-3) and 4 (2 deep, top-2)
    "eagle_tree6_datastore": {"method": "eagle", "num_speculative_tokens": 8, "num_steps": 3, "topk": 3,
                              "num_draft_tokens": 6, "prompt_lookup_max": 5, "datastore": True},  # fmt: skip
    "eagle_tree4_datastore": {"method": "eagle", "num_speculative_tokens": 8, "num_steps": 2, "topk": 2,
                              "num_draft_tokens": 4, "prompt_lookup_max": 5, "datastore": True},  # fmt: skip
    # 6 nodes 2 deep, copies up to 12 tokens: aims at tree6's τ on code with one net pass fewer
    "eagle_tree6d2_datastore": {"method": "eagle", "num_speculative_tokens": 12, "num_steps": 2, "topk": 3,
                                "num_draft_tokens": 6, "prompt_lookup_max": 5, "datastore": True},  # fmt: skip
    "ngram": {"method": "ngram", "num_speculative_tokens": 8},  # the lookup alone, for reference
    "ngram_datastore": {"method": "ngram", "num_speculative_tokens": 8, "datastore": True},  # no model at all
    "layer_skip_lookup": {"method": "layer_skip", "num_speculative_tokens": 8, "num_steps": 1, "prompt_lookup_max": 5},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 1},
    "mtp": {"method": "mtp", "num_speculative_tokens": 1},
    "medusa": {"method": "medusa", "num_speculative_tokens": 3},
    "dflash": {"method": "dflash", "num_speculative_tokens": 16},
    "dflash_cut": {"method": "dflash", "num_speculative_tokens": 16, "confidence_threshold": 0.5},
    # the heads / the block beside the copies, as eagle_datastore
    "medusa_datastore": {"method": "medusa", "num_speculative_tokens": 8, "num_steps": 1, "prompt_lookup_max": 5,
                         "datastore": True},  # fmt: skip
    "dflash_datastore": {"method": "dflash", "num_speculative_tokens": 8, "num_steps": 1, "prompt_lookup_max": 5,
                         "datastore": True},  # fmt: skip
}

def parse_method(arg: str) -> tuple[str, dict]:
    if "=" in arg:
        name, spec = arg.split("=", 1)
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{arg!r}: the speculative_config after '=' is not JSON ({e})") from None
        if not name or not isinstance(spec, dict):
            raise argparse.ArgumentTypeError(f"{arg!r}: give NAME=JSON with a name and a JSON object")
        try:
            parse_spec(spec)  # its errors before any model loads
        except SpecDecodeError as e:
            raise argparse.ArgumentTypeError(f"{arg!r}: {e}") from None
        return name, spec
    if arg not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {arg!r}; give NAME=JSON or one of {', '.join(METHODS)}")
    return arg, METHODS[arg]


def method_arg(arg: str) -> str:
    """--methods' type: ``arg`` as given, once `parse_method` takes it."""
    parse_method(arg)
    return arg


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else 0.0


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, help="none, int8, int4, gguf: the target's and the nets' weights")
    ap.add_argument("--methods", nargs="+", type=method_arg,
                    default=["layer_skip", "eagle", "eagle_tree", "eagle_g8", "eagle_lookup", "eagle3", "mtp", "medusa",
                             "dflash"])
    ap.add_argument("--temperatures", nargs="+", type=nonneg_float, default=[0.0, 0.7])
    ap.add_argument("--max-tokens", type=decode_tokens, default=128)
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--prompts", default=str(HERE / "prompts_learned.json"))
    ap.add_argument("--json", type=out_path, default=None)
    ap.add_argument("--results", type=out_path, default=None, help="the results page to write the table into")
    ap.add_argument("--plot", type=out_path, default=None,
                    help="PNG of acceptance by position (greedy), one line per method")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="runs of each prompt: plain, then the methods in an order rotated each time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        prompts = json.loads(Path(args.prompts).read_text())
    except (OSError, ValueError) as e:
        raise SpecDecodeError(f"cannot read --prompts {args.prompts}: {e}") from None
    plain = LLM(model=args.model, dtype=args.dtype, device="cpu", quantization=args.quantization)
    methods = [parse_method(m) for m in args.methods]
    llms, timers = {}, {}
    for name, spec in methods:
        llms[name] = LLM(model=args.model, speculative_config=spec, dtype=args.dtype, device="cpu",
                         quantization=args.quantization)  # fmt: skip
        # draft cost per round (propose, plus on_verified where a drafter feeds features)
        timers[name] = (Timer(llms[name].engine.drafter, "propose"), Timer(llms[name].engine.drafter, "on_verified"))
    warm = plain.encode_chat("Hi")
    for llm in [plain, *llms.values()]:
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=8))

    rows = []
    for temperature in args.temperatures:
        for kind, texts in prompts.items():
            for i, text in enumerate(texts):
                ids = plain.encode_chat(text)
                params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=i)
                for rep in range(args.repeats):
                    base = plain.generate([ids], params)[0]
                    step_s = 1.0 / max(base.metrics.decode_tokens_per_s, 1e-9)
                    for name, _ in methods[rep % len(methods):] + methods[: rep % len(methods)]:
                        rows.append(run_method(llms[name], timers[name], ids, params, base, step_s))
                        r = rows[-1]
                        r.update(temperature=temperature, kind=kind, prompt=text[:36].replace("\n", " "), method=name,
                                 prompt_index=i,  # the prompt itself: labels may share their first 36 characters
                                 rep=rep)  # fmt: skip
                        print(f"T={temperature} [{kind}] {r['prompt']!r} {name}: α={r['alpha']:.2f} τ={r['tau']:.2f} "
                              f"c={r['c']:.3f} speedup {r['speedup']:.2f}x (formula {r['predicted']:.2f}x)", flush=True)
    table = print_summary(rows, [n for n, _ in methods], args)
    if args.results:
        body = ("Batch 1, each method right after plain decoding of the same prompt (the 9 prompts of "
                "`benchmarks/prompts_learned.json`: chat, code, summaries). Speedup: decode tokens/s against "
                "plain decoding, geometric mean over prompts with its 95% interval; formula: Leviathan's "
                "prediction from the measured α and c.\n\n" + table + "\n")  # fmt: skip
        write_results(args.results, "learned", body)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if args.plot:
        model = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
        weights = args.quantization if args.quantization not in (None, "none") else args.dtype
        plot(rows, [n for n, _ in methods], args.plot, f"{model}, {weights} weights (CPU)")
    return 0


def run_method(
    llm: LLM, timers: tuple[Timer, Timer], ids: list[int], params: SamplingParams, base: RequestOutput, step_s: float
) -> dict:  # fmt: skip
    """One speculative run of a prompt: its figures against the plain run ``base`` just before."""
    propose, verified = timers
    for t in (propose, verified):
        t.seconds, t.calls = 0.0, 0
    out = llm.generate([ids], params)[0]
    m = out.metrics
    gamma = llm.engine.gamma
    rounds = max(verified.calls, 1)
    # per draft token, and the formula at the mean drafted depth (a confidence stop or a budget drafts fewer than γ)
    depth = m.num_draft_tokens / m.num_drafts if m.num_drafts else gamma
    c = (propose.seconds + verified.seconds) / max(m.num_draft_tokens, 1) / step_s
    alpha = m.acceptance_rate  # accepted / reached
    return {
        "gamma": gamma, "alpha": alpha, "tau": m.mean_accepted_length,
        "accepted_per_position": [n / max(m.num_drafts, 1) for n in m.accepted_per_position]
        + [0.0] * (gamma - len(m.accepted_per_position)),  # a chain stopped early may never reach γ
        "tokens_per_round": (len(out.token_ids) - 1) / rounds, "c": c,  # the first comes from prefill
        "plain_tps": base.metrics.decode_tokens_per_s, "tps": m.decode_tokens_per_s,
        "speedup": m.decode_tokens_per_s / base.metrics.decode_tokens_per_s,
        "predicted": expected_speedup(alpha, depth, c),
        "latency_s": m.wall_time_s, "plain_latency_s": base.metrics.wall_time_s, "lossy": m.lossy,
    }  # fmt: skip


def print_summary(rows: list[dict], names: list[str], args: argparse.Namespace) -> str:
    """Print the table (markdown) and return it."""
    weights = f", {args.quantization} weights" if args.quantization else ""
    reps = f", {args.repeats} runs of each prompt" if args.repeats > 1 else ""
    title = f"{args.dtype}{weights}, {args.max_tokens} new tokens, batch 1, threads={args.threads}{reps}"
    lines = [f"**{title}**", "",
             "| T | kind | method | γ | α | τ | tokens/round | c | latency s (plain) | speedup | formula | acceptance by position |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for temperature in args.temperatures:
        for kind in dict.fromkeys(r["kind"] for r in rows):
            for name in names:
                sel = [r for r in rows if r["temperature"] == temperature and r["kind"] == kind and r["method"] == name]
                if not sel:
                    continue
                mean = lambda k: sum(r[k] for r in sel) / len(sel)  # noqa: E731
                pos = [sum(r["accepted_per_position"][k] for r in sel) / len(sel) for k in range(sel[0]["gamma"])]
                lines.append(f"| {temperature} | {kind} | {name}{' (lossy)' if sel[0]['lossy'] else ''} | "
                             f"{sel[0]['gamma']} | {mean('alpha'):.2f} | {mean('tau'):.2f} | "
                             f"{mean('tokens_per_round'):.2f} | {mean('c'):.3f} | "
                             f"{mean('latency_s'):.2f} ({mean('plain_latency_s'):.2f}) | "
                             f"{speedup(sel)} | {geomean([r['predicted'] for r in sel]):.2f}x | "
                             f"{' '.join(f'{p:.2f}' for p in pos[:8])} |")  # fmt: skip
    print("\n" + "\n".join(lines))
    return "\n".join(lines)


def speedup(sel: list[dict]) -> str:
    """The geometric mean of the runs' speedups, with its 95% t interval over prompts when there
    are several: repetitions of a prompt (same tokens, other timing noise) are not independent
    samples, so each prompt's are averaged into one ratio first (treated as independent, they
    would give an interval far narrower than the prompts' own spread)."""
    by_prompt: dict[tuple, list[float]] = {}
    for r in sel:
        by_prompt.setdefault((r["kind"], r["prompt_index"]), []).append(r["speedup"])
    mean, lo, hi = paired_interval([geomean(v) for v in by_prompt.values()])
    return f"{mean:.2f}x" + (f" [{lo:.2f}–{hi:.2f}]" if len(by_prompt) > 1 else "")


def plot(rows: list[dict], names: list[str], path: str, what: str) -> None:
    if not any(r["temperature"] == 0.0 for r in rows):
        print(f"no greedy runs (--temperatures without 0): {path} not written")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    tab20 = plt.get_cmap("tab20").colors
    colors = tab20[::2] + tab20[1::2]  # 20 distinct: the default cycle repeats after 10 methods
    for i, name in enumerate(names):
        sel = [r for r in rows if r["method"] == name and r["temperature"] == 0.0]
        if not sel:
            continue
        pos = [sum(r["accepted_per_position"][k] for r in sel) / len(sel) for k in range(sel[0]["gamma"])]
        ax.plot(range(1, len(pos) + 1), pos, marker="o", color=colors[i % len(colors)],
                label=f"{name} (γ={sel[0]['gamma']})")  # fmt: skip
    deepest = max(r["gamma"] for r in rows)
    ax.set_xticks(range(1, deepest + 1))  # whole positions (one γ = 1 method alone gave 0.96..1.04)
    ax.set_xlim(0.5, deepest + 0.5)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("fraction of rounds accepting position k")
    ax.set_title(f"Acceptance by position, greedy, {what}")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(run(main))
