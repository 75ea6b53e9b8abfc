"""`specdecode bench`: which speculative configuration helps, measured on your model and prompts.

Owns: the command's arguments, the measurement (each configuration right after plain
decoding of the same prompts, so both meet the same stretch of machine noise), the table,
the JSON file, the plots and the results-page section. Prompts: bench_prompts.py.

Per category, temperature, batch size and configuration it reports output tokens/s, the
speedup against plain decoding (geometric mean of the per-prompt ratios), α, τ, acceptance
by position, Leviathan's predicted speedup from the measured α and draft cost c beside the
measured one, and (greedy) whether every output was identical to plain decoding's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.entrypoints.bench_prompts import CATEGORIES, BenchPrompt, build_prompts, read_prompts_file

QUICK = {"methods": ["auto"], "per_category": 2, "max_tokens": 64, "temperatures": [0.0], "batch_sizes": [1],
         "repeats": 1, "busy": [0]}


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file or alias (default: SmolLM2-135M-Instruct)")
    p.add_argument("--methods", nargs="+", default=None,
                   help="configurations to measure against plain decoding: auto, a method name, or JSON, "
                        "optionally as LABEL=JSON (default: auto ngram suffix)")  # fmt: skip
    p.add_argument("--categories", nargs="+", default=None, help=f"of {', '.join(CATEGORIES)} (default: all)")
    p.add_argument("--prompts", default=None, help="your own prompts: JSON lines of OpenAI chat requests "
                   '({"messages": [...], "category": optional})')  # fmt: skip
    p.add_argument("--per-category", type=int, default=None, help="prompts per category (default 4)")
    p.add_argument("--temperatures", nargs="+", type=float, default=None, help="(default: 0)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="prompts decoded together (default: 1)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (default: 128)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each prompt, plain and speculative in alternating order (default 2)")
    p.add_argument("--quick", action="store_true", help="auto only, 2 prompts per category, 64 tokens, greedy, once")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads, fixed (default: the cores allowed, fewer while other processes take cores)")
    p.add_argument("--busy", nargs="+", type=int, default=None,
                   help="measure again beside this many CPU-bound processes, for each number given (default: 0)")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--plot-dir", default=None, help="write speedup.png and acceptance.png here")
    p.add_argument("--results", default=None, help="write the table into this results page (markdown)")
    p.add_argument("--section", default="bench", help="the results page's section to replace (default: bench)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings: explicit flags over --quick's over the defaults; bad values are one line."""
    base = {"methods": ["auto", "ngram", "suffix"], "per_category": 4, "max_tokens": 128, "temperatures": [0.0],
            "batch_sizes": [1], "repeats": 2, "busy": [0]} | (QUICK if args.quick else {})  # fmt: skip
    opts = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    if opts["per_category"] < 1 or opts["max_tokens"] < 2 or opts["repeats"] < 1:
        raise SpecDecodeError("--per-category and --repeats must be >= 1 and --max-tokens >= 2")
    if any(not (math.isfinite(t) and t >= 0) for t in opts["temperatures"]):
        raise SpecDecodeError(f"--temperatures must be finite numbers >= 0, got {opts['temperatures']}")
    if any(b < 1 for b in opts["batch_sizes"]):
        raise SpecDecodeError(f"--batch-sizes must be >= 1, got {opts['batch_sizes']}")
    if any(not 0 <= n <= 64 for n in opts["busy"]):
        raise SpecDecodeError(f"--busy must be numbers of processes in [0, 64], got {opts['busy']}")
    if args.threads is not None and args.threads < 1:
        raise SpecDecodeError(f"--threads must be >= 1, got {args.threads}")
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", args.section):
        raise SpecDecodeError(f"--section must be lowercase letters, digits and dashes, got {args.section!r}")
    for path in (args.json, args.results):
        if path is not None and not Path(path).expanduser().parent.is_dir():
            raise SpecDecodeError(f"no folder to write {path!r} in")
    return opts


def parse_method(text: str) -> tuple[str, Any]:
    """``auto``, a registered method's name (its defaults), or a JSON configuration, optionally
    labelled (``ngram8={"method": "ngram", "num_speculative_tokens": 8}``)."""
    from specdecode.drafters.registry import method_names, parse_spec

    label = re.match(r"([\w.+-]+)=(?=\s*\{)", text)
    if label is not None:
        return label.group(1), parse_spec(text[label.end() :])
    if text.lstrip().startswith("{"):
        spec = parse_spec(text)
        return json.dumps(json.loads(text), separators=(",", ":")), spec  # its label: two may share a method
    if text != "auto" and text not in method_names():
        raise SpecDecodeError(f"unknown method {text!r} for --methods; valid: auto, {', '.join(method_names())}, or JSON")
    return text, parse_spec("auto" if text == "auto" else {"method": text})


class _DraftTimer:
    """Adds up a drafter's time in propose and on_verified: the draft cost c."""

    def __init__(self, drafter: Any) -> None:
        self.seconds = 0.0
        for name in ("propose", "on_verified"):
            inner = getattr(drafter, name)
            setattr(drafter, name, self._wrap(inner))

    def _wrap(self, inner: Any) -> Any:
        def call(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a)
            finally:
                self.seconds += time.perf_counter() - t0

        return call


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes running beside the block: a machine with other work on it."""
    import multiprocessing

    procs = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(n)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        for proc in procs:
            proc.terminate()
            proc.join()


def encode_prompt(llm: Any, prompt: BenchPrompt) -> list[int]:
    if prompt.text is not None:
        return llm.tokenize(prompt.text)
    tok = llm.tokenizer
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return llm.tokenize("\n".join(f"{m['role']}: {m['content']}" for m in prompt.messages) + "\nassistant:")


def timed_generate(llm: Any, ids: list[list[int]], params: list[SamplingParams], speculative: bool) -> tuple[list, float]:
    start = time.perf_counter()
    outs = llm.generate(ids, params, speculative=speculative)
    return outs, time.perf_counter() - start


def measure(llm: Any, plain_llm: Any, name: str, prompts: list[BenchPrompt], opts: dict, progress: Any) -> list[dict]:
    """Rows of figures per (category, temperature, batch size) for one configuration."""
    from specdecode.analysis.theory import expected_speedup

    timer = _DraftTimer(llm.engine.drafter) if llm.engine.drafter is not None else None
    # a drafter that learns from other requests (suffix) would copy a repeated prompt's earlier output
    repeats = 1 if getattr(llm.engine.drafter, "learns_from_other_requests", False) else opts["repeats"]
    rows = []
    by_category: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    for temperature in opts["temperatures"]:
        for batch in opts["batch_sizes"]:
            for category, items in by_category.items():
                ratios, tokens, seconds, plain_seconds, identical = [], 0, 0.0, 0.0, True
                accepted = reached = drafts = draft_tokens = 0
                per_pos: list[int] = []
                draft_s = 0.0
                for start in range(0, len(items), batch):
                    group = items[start : start + batch]
                    ids = [encode_prompt(llm, p) for p in group]
                    logs = []
                    for r in range(repeats):  # alternating order: a drift in the machine's speed cancels
                        # sampled, each run draws other texts (both configurations the same seeds): a
                        # prompt's ratio then averages over the texts' lengths and repetitiveness too
                        params = [SamplingParams(temperature=temperature, max_tokens=opts["max_tokens"],
                                                 seed=start + i + 1000 * r * (temperature > 0),
                                                 structured=p.structured) for i, p in enumerate(group)]  # fmt: skip
                        if r % 2 == 0:
                            base, t_plain = timed_generate(plain_llm, ids, params, speculative=False)
                        if timer is not None:
                            timer.seconds = 0.0
                        outs, t_spec = timed_generate(llm, ids, params, speculative=True)
                        if r % 2 == 1:
                            base, t_plain = timed_generate(plain_llm, ids, params, speculative=False)
                        n_spec, n_plain = sum(len(o.token_ids) for o in outs), sum(len(o.token_ids) for o in base)
                        logs.append(math.log((n_spec / t_spec) / (n_plain / t_plain)))
                        tokens, seconds, plain_seconds = tokens + n_spec, seconds + t_spec, plain_seconds + t_plain
                    # the median run: one run slowed by another process does not move a prompt's ratio
                    ratios.append(math.exp(statistics.median(logs)))
                    if temperature == 0:
                        identical &= all(a.token_ids == b.token_ids for a, b in zip(outs, base))
                    for o in outs:
                        m = o.metrics
                        accepted, reached, drafts = accepted + m.num_accepted_tokens, reached + m.num_reached_tokens, drafts + m.num_drafts
                        draft_tokens += m.num_draft_tokens
                        per_pos += [0] * (len(m.accepted_per_position) - len(per_pos))
                        for k, n in enumerate(m.accepted_per_position):
                            per_pos[k] += n
                    draft_s += timer.seconds if timer is not None else 0.0
                    progress.update(opts["repeats"])  # as counted in the total, whatever ran
                alpha = accepted / reached if reached else 0.0
                step_s = plain_seconds / max(1, tokens)  # a plain step's time per token
                depth = draft_tokens / drafts if drafts else 0.0
                c = draft_s / max(draft_tokens, 1) / step_s if draft_tokens else 0.0
                predicted = expected_speedup(alpha, max(1, round(depth)), c) if drafts else 1.0
                rows.append({
                    "method": name, "spec": llm.spec.to_dict() if llm.spec else None, "auto": llm.auto_choice,
                    "category": category, "temperature": temperature, "batch_size": batch, "prompts": len(items),
                    "tokens_per_s": tokens / seconds, "plain_tokens_per_s": tokens / plain_seconds if plain_seconds else 0.0,
                    "speedup": math.exp(statistics.fmean(math.log(r) for r in ratios)),
                    "speedup_min": min(ratios), "speedup_max": max(ratios), "speedup_ci95": interval(ratios),
                    "alpha": alpha, "tau": 1 + accepted / drafts if drafts else 1.0,
                    "acceptance_by_position": [n / drafts for n in per_pos] if drafts else [],
                    "c": c, "predicted_speedup": predicted,
                    "identical": identical if temperature == 0 else None,
                })  # fmt: skip
    return rows


def _needs(module: str) -> Any:
    """An optional dependency of `bench` / `tune`, or one line saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise SpecDecodeError(f"this needs {module.split('.')[0]}: pip install 'specdecode[bench]'") from None


def interval(ratios: list[float]) -> list[float] | None:
    """The 95% t interval of the geometric mean of per-prompt ratios (None from one prompt)."""
    if len(ratios) < 2:
        return None
    t = _needs("scipy.stats").t

    logs = [math.log(r) for r in ratios]
    half = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return [math.exp(mean - half), math.exp(mean + half)]


def table(rows: list[dict]) -> str:
    busy = any(r.get("busy") for r in rows)  # a column only where some run had busy neighbours
    head = "| T | batch | category | method |" + (" busy |" if busy else "")
    lines = [head + " tokens/s | plain | speedup [95% CI] | predicted | α | τ | identical |",
             "|---" * (11 + busy) + "|"]  # fmt: skip
    for r in rows:
        same = {True: "yes", False: "**NO**", None: "–"}[r["identical"]]
        lines.append(f"| {r['temperature']:g} | {r['batch_size']} | {r['category']} | {r['method']} | "
                     + (f"{r.get('busy', 0)} | " if busy else "") +
                     f"{r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}×{ci(r)} | "
                     f"{r['predicted_speedup']:.2f}× | {r['alpha']:.2f} | {r['tau']:.2f} | {same} |")  # fmt: skip
    return "\n".join(lines)


def busy_lines(rows: list[dict]) -> list[str]:
    """Plain decoding's tokens/s beside busy processes as a share of its quiet tokens/s (the
    same prompts, first configuration's runs): a fair share of n cores with k busy is (n - k) / n."""
    quiet = {(r["temperature"], r["batch_size"], r["category"]): r["plain_tokens_per_s"]
             for r in rows if r.get("busy", 0) == 0}  # fmt: skip
    levels = sorted({r["busy"] for r in rows if r.get("busy")})
    lines = []
    for n in levels:
        shares = [r["plain_tokens_per_s"] / quiet[k] for r in rows if r.get("busy") == n
                  and (k := (r["temperature"], r["batch_size"], r["category"])) in quiet]  # fmt: skip
        if shares:
            lines.append(f"plain decoding beside {n} busy process(es): {statistics.fmean(shares):.0%} of its quiet tokens/s")
    return lines


def ci(row: dict) -> str:
    lo_hi = row["speedup_ci95"]
    return f" [{lo_hi[0]:.2f}–{lo_hi[1]:.2f}]" if lo_hi else ""


def plots(rows: list[dict], folder: str) -> list[str]:
    _needs("matplotlib").use("Agg")
    plt = _needs("matplotlib.pyplot")

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    first = [r for r in rows if r["temperature"] == rows[0]["temperature"] and r["batch_size"] == rows[0]["batch_size"]]
    methods = list(dict.fromkeys(r["method"] for r in first))
    categories = list(dict.fromkeys(r["category"] for r in first))
    fig, ax = plt.subplots(figsize=(max(6, len(categories) * 1.2), 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [next((r["speedup"] for r in first if r["method"] == m and r["category"] == c), 0.0) for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], ys, width, label=m)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=30)
    ax.set_ylabel("speedup vs plain decoding")
    ax.set_title(f"temperature {rows[0]['temperature']:g}, batch {rows[0]['batch_size']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        pos = [r["acceptance_by_position"] for r in first if r["method"] == m and r["acceptance_by_position"]]
        if pos:
            width_ = max(len(p) for p in pos)
            mean = [statistics.fmean(p[k] if k < len(p) else 0.0 for p in pos) for k in range(width_)]
            ax.plot(range(1, width_ + 1), mean, marker="o", label=m)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted per drafting round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=120)
    plt.close("all")
    return [str(out / "speedup.png"), str(out / "acceptance.png")]


def cmd_bench(args: argparse.Namespace) -> int:
    opts = _options(args)
    methods = [parse_method(m) for m in opts["methods"]]  # bad input fails before the model loads
    if args.prompts is not None:
        prompts = read_prompts_file(args.prompts)
    else:
        prompts = build_prompts(args.categories or list(CATEGORIES), opts["per_category"])
    from tqdm import tqdm

    from specdecode import LLM

    # no prefix cache: the same prompts run again and again, and a cached prompt would make
    # whichever configuration runs it later look faster
    plain = LLM(model=args.model, speculative_config=None, dtype=args.dtype, quantization=args.quantization,
                enable_prefix_caching=False, threads=args.threads)
    warm = [plain.tokenize("Hello, world.")]
    plain.generate(warm, SamplingParams(temperature=0.0, max_tokens=8))
    groups = sum(-(-len([p for p in prompts if p.category == c]) // b) for c in {p.category for p in prompts}
                 for b in opts["batch_sizes"]) * len(opts["temperatures"]) * opts["repeats"]  # fmt: skip
    rows = []
    with tqdm(total=groups * len(methods) * len(opts["busy"]), desc="bench", unit="run") as progress:
        for busy in opts["busy"]:
            with busy_processes(busy):
                for name, spec in methods:
                    llm = plain.with_speculative_config(spec)
                    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8))
                    rows += [r | {"busy": busy} for r in measure(llm, plain, name, prompts, opts, progress)]
                    del llm
    text = table(rows)
    print(text)
    print(*busy_lines(rows), sep="\n")
    if any(r["auto"] for r in rows):
        print(next(r["auto"] for r in rows if r["auto"]))
    if args.json:
        Path(args.json).expanduser().write_text(json.dumps({"options": opts, "rows": rows}, indent=1))
    pngs = plots(rows, args.plot_dir) if args.plot_dir else []
    if pngs:
        print("plots:", ", ".join(pngs))
    if args.results:
        from specdecode.entrypoints.results import write_section

        auto = next((r["auto"] for r in rows if r["auto"]), None)
        note = (f"`specdecode bench`: each configuration beside plain decoding of the same prompts, "
                f"{opts['repeats']} run(s) each in alternating order (suffix, which learns from earlier requests, "
                f"once), prefix caching off; at most {opts['max_tokens']} new tokens, "
                f"{len(prompts)} prompts. Speedup: output tokens/s (prefill included) against plain decoding, "
                "geometric mean over prompts (each prompt's median run; sampled, each run draws other texts) "
                "with its 95% interval; predicted: Leviathan's formula from the measured α and draft cost c. Threads: "
                + (f"{args.threads}, fixed." if args.threads else "chosen by each engine (engine/threads.py).")
                + (" Busy: that many CPU-bound processes ran beside the measurement." if any(opts["busy"]) else ""))
        lines = "".join(f"\n{line}.\n" for line in busy_lines(rows))
        title = "Speculation by category" + (f": {args.section}" if args.section != "bench" else "")
        body = f"## {title}\n\n{note}\n\n{text}\n{lines}" + (f"\n{auto}.\n" if auto else "")
        page = Path(args.results).expanduser().resolve().parent
        body += "".join(f"\n![{Path(png).stem}]({os.path.relpath(Path(png).resolve(), page)})\n" for png in pngs)
        write_section(args.results, args.section, body)
    return 1 if any(r["identical"] is False for r in rows) else 0
