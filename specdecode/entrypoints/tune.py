"""`specdecode tune`: search the speculative configuration for your prompts by measuring.

Owns: the search space (methods, γ, tree shapes and budgets, restricted by ``--methods``),
successive halving within a time limit, the ranking it prints (speedup against plain
decoding with a 95% interval, since machines are noisy) and the winning configuration,
written as JSON for ``--speculative-config @file.json``. Measuring one prompt is bench.py's.

Successive halving: every candidate runs on the first prompts (each beside plain decoding
of the same prompt), the better half goes on to twice as many new prompts, and so on until
one is left, the prompts run out or the time is up. A candidate's score is the geometric
mean of its per-prompt speedups over everything it ran.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.entrypoints.bench import encode_prompt, interval, timed_generate
from specdecode.entrypoints.bench_prompts import CATEGORIES, build_prompts, read_prompts_file

LOOKUP = {"num_steps": 1, "prompt_lookup_max": 5, "datastore": True}


def space(shipped_eagle: bool) -> list[Any]:
    """The default candidates: auto, prompt lookup at several γ, as a tree and adaptive, suffix,
    and where EAGLE weights ship, EAGLE alone, as a tree, and beside copies."""
    out: list[Any] = ["auto"]
    out += [{"method": "ngram", "num_speculative_tokens": g} for g in (2, 4, 8)]
    out += [{"method": "ngram", "num_speculative_tokens": 4, "max_matches": 4},
            {"method": "ngram", "num_speculative_tokens": "auto"},
            {"method": "suffix"}, {"method": "suffix", "num_speculative_tokens": "auto"}]  # fmt: skip
    if shipped_eagle:
        out += [{"method": "eagle"}, {"method": "eagle", "num_speculative_tokens": 3, "topk": 4, "num_draft_tokens": 8},
                {"method": "eagle", "num_speculative_tokens": 8, **LOOKUP},
                {"method": "eagle", "num_speculative_tokens": "auto", **LOOKUP}]  # fmt: skip
    return out


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file or alias (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", default=None, help="your prompts: JSON lines of OpenAI chat requests")
    p.add_argument("--categories", nargs="+", default=None,
                   help=f"built-in prompts when --prompts is not given: of {', '.join(CATEGORIES)} (default: all)")  # fmt: skip
    p.add_argument("--methods", nargs="+", default=None,
                   help="search only these methods (and auto, if named) of the default space")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds to search (default: 300)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", default="speculative_config.json", help="where the winning configuration goes")
    p.add_argument("--json", default=None, help="write the ranking here")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=None)


def _label(config: Any) -> str:
    return config if isinstance(config, str) else json.dumps(config, separators=(",", ":"))


def _check(args: argparse.Namespace) -> None:
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise SpecDecodeError(f"--time-limit must be a number of seconds > 0, got {args.time_limit}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0) or args.max_tokens < 2:
        raise SpecDecodeError("--temperature must be >= 0 and --max-tokens >= 2")
    if args.threads is not None and args.threads < 1:
        raise SpecDecodeError(f"--threads must be >= 1, got {args.threads}")
    for path in (args.out, args.json):
        if path is not None and not Path(path).expanduser().parent.is_dir():
            raise SpecDecodeError(f"no folder to write {path!r} in")
    if args.methods:
        from specdecode.drafters.registry import method_names

        unknown = [m for m in args.methods if m != "auto" and m not in method_names()]
        if unknown:
            raise SpecDecodeError(f"unknown method {unknown[0]!r} in the search space; valid: auto, "
                                  f"{', '.join(method_names())}")  # fmt: skip


def cmd_tune(args: argparse.Namespace) -> int:
    _check(args)
    prompts = read_prompts_file(args.prompts) if args.prompts else build_prompts(args.categories or list(CATEGORIES), 8)
    from specdecode import LLM
    from specdecode.drafters.learned import shipped_folder

    plain = LLM(model=args.model, speculative_config=None, dtype=args.dtype, quantization=args.quantization,
                enable_prefix_caching=False, threads=args.threads)  # a prompt cached by an earlier run would favour the later ones
    candidates = space(shipped_folder("eagle", plain.target) is not None)
    if args.methods:
        candidates = [c for c in candidates if (c if isinstance(c, str) else c["method"]) in args.methods]
        if not candidates:
            raise SpecDecodeError(f"the search space has no candidate for {', '.join(args.methods)}")
    order = prompts[::2] + prompts[1::2]  # categories interleaved early, so the first rung sees several
    ids = [encode_prompt(plain, p) for p in order]
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i, structured=p.structured)
              for i, p in enumerate(order)]  # fmt: skip
    plain.generate([ids[0]], SamplingParams(temperature=0.0, max_tokens=8))  # the first passes are cold
    scores = search(plain, candidates, ids, params, args.time_limit)
    # furthest rung first (it was measured on the most prompts), then by score; unmeasured last
    ranking = sorted(scores.values(), key=lambda s: (not s["logs"], -s["rung"], -s["score"]))
    best = ranking[0]
    if not best["logs"]:
        raise SpecDecodeError(f"--time-limit {args.time_limit:g} s ran out before any candidate was measured")
    print_ranking(ranking)
    Path(args.out).expanduser().write_text(json.dumps(best["resolved"], indent=1) + "\n")
    print(f"best: {best['label']} ({best['speedup']:.2f}x); written to {args.out}: use --speculative-config @{args.out}")
    if args.json:
        fields = ("label", "resolved", "speedup", "ci95", "prompts", "rung")
        Path(args.json).expanduser().write_text(json.dumps([{k: s[k] for k in fields} for s in ranking], indent=1))
    return 0


def search(plain: Any, candidates: list[Any], ids: list[list[int]], params: list[SamplingParams],
           time_limit: float) -> dict[str, dict]:  # fmt: skip
    """Successive halving; each candidate's per-prompt log speedups, score and the rung it reached."""
    deadline = time.perf_counter() + time_limit
    scores = {_label(c): {"label": _label(c), "config": c, "logs": [], "rung": 0} for c in candidates}
    alive, start, size, rung = list(scores), 0, 2, 0
    while alive and time.perf_counter() < deadline:
        chosen = list(range(start, min(start + size, len(ids))))
        if not chosen:
            break
        for label in alive:
            s = scores[label]
            llm = s.get("llm") or plain.with_speculative_config(s["config"])
            s["llm"], s["rung"] = llm, rung
            s["resolved"] = llm.spec.to_dict()
            for i in chosen:
                if time.perf_counter() >= deadline:
                    break
                base, t_plain = timed_generate(plain, [ids[i]], [params[i]], speculative=False)
                outs, t_spec = timed_generate(llm, [ids[i]], [params[i]], speculative=True)
                rate, plain_rate = len(outs[0].token_ids) / t_spec, len(base[0].token_ids) / t_plain
                s["logs"].append(math.log(rate / plain_rate))
        for s in scores.values():
            s["score"] = statistics.fmean(s["logs"]) if s["logs"] else -math.inf
        if len(alive) == 1:
            break
        alive = sorted(alive, key=lambda label: -scores[label]["score"])[: max(1, len(alive) // 2)]
        for label in set(scores) - set(alive):
            scores[label].pop("llm", None)  # a dropped candidate's engines are freed
        start, size, rung = start + size, size * 2, rung + 1
    for s in scores.values():
        s.pop("llm", None)
        s["speedup"] = math.exp(s["score"]) if s["logs"] else 0.0
        s["ci95"] = interval([math.exp(x) for x in s["logs"]])
        s["prompts"] = len(s["logs"])
        s.setdefault("resolved", None)
    return scores


def print_ranking(ranking: list[dict]) -> None:
    print("| rank | configuration | prompts | speedup [95% CI] | reached rung |")
    print("|---|---|---|---|---|")
    for i, s in enumerate(ranking, 1):
        ci = f" [{s['ci95'][0]:.2f}–{s['ci95'][1]:.2f}]" if s["ci95"] else ""
        shown = s["label"] if s["label"] != "auto" else f"auto = {s['resolved']['method']}" if s["resolved"] else "auto"
        speed = f"{s['speedup']:.2f}x{ci}" if s["prompts"] else "not measured"
        print(f"| {i} | `{shown}` | {s['prompts']} | {speed} | {s['rung']} |")
