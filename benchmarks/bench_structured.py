"""Structured output under speculation: JSON-schema extraction from a passage, a choice
classification, and a forced tool call, on the default model, plain decoding against ngram,
suffix and the fastest learned setup, with the same prompts as free chat beside them.

Per task and method: output tokens/s (wall, all prompts one by one), its ratio to plain decoding
of the same task, τ (tokens per verify round that drafted), and the share of draft tokens cut
because they left the grammar. Structured output repeats keys and copies values from the
input, so its speedup is expected above free chat's. Greedy; every output is checked to equal
plain decoding's and to parse.

    python benchmarks/bench_structured.py --results docs/results.md
"""

from __future__ import annotations

import json
import time

import torch
from args import out_path, positive_int, run, write_results

from specdecode import LLM, SamplingParams, StructuredOutput
from specdecode.entrypoints.cli import OneLineParser

METHODS = {
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "eagle + copies": {"method": "eagle", "num_speculative_tokens": 8, "num_steps": 1, "prompt_lookup_max": 5,
                       "datastore": True},
}  # fmt: skip
PASSAGES = [
    "Maria Gonzalez, 41, is a civil engineer who lives in Valencia, Spain. She designs bridges and has "
    "worked for the city of Valencia for twelve years.",
    "The Aurora X2 is a compact electric scooter sold by Voltway for 649 dollars. It weighs 14 kilograms "
    "and has a range of 45 kilometres on one charge.",
    "Kenji Watanabe, a 29-year-old data analyst from Osaka, Japan, spends his weekends teaching "
    "programming to high school students in Osaka.",
    "Greenleaf Bakery in Portland, Oregon, was founded in 2011 by Ruth Okafor. It employs 23 people and "
    "is known for its sourdough bread.",
]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "kind": {"enum": ["person", "product", "company"]},
    "place": {"type": "string"}, "number": {"type": "integer"}, "summary": {"type": "string"}},
    "required": ["name", "kind", "place", "number", "summary"], "additionalProperties": False}  # fmt: skip
REVIEWS = [
    "The battery died after two days and support never answered my emails.",
    "Absolutely love it: setup took five minutes and it works perfectly every time.",
    "It is fine. Does what it says, nothing more, nothing less.",
    "Terrible sound quality, and the left earbud stopped working within a week.",
]
LABELS = ["positive", "negative", "neutral"]
TOOL = {"name": "book_table", "parameters": {"type": "object", "properties": {
    "restaurant": {"type": "string"}, "date": {"type": "string"}, "time": {"type": "string"},
    "guests": {"type": "integer", "minimum": 1, "maximum": 20}},
    "required": ["restaurant", "date", "time", "guests"], "additionalProperties": False}}  # fmt: skip
REQUESTS = [
    "Book a table for 4 at Luigi's Trattoria on 2026-12-24 at 19:30.",
    "I need a reservation at The Blue Oyster for 2 people, 2027-01-03, 20:00.",
    "Reserve Sakura Garden for six guests on 2026-12-31 at 18:45.",
    "Can you get us a table at Casa Verde, 3 people, on 2027-02-14 at 21:15?",
]


def tasks() -> dict[str, list[tuple[str, StructuredOutput | None]]]:
    """Per task, its chat messages and constraint (None: the same request as free chat)."""
    extract = [(f"Extract name, kind, place, number and a one-sentence summary as JSON from: {p}",
                StructuredOutput("json", SCHEMA)) for p in PASSAGES]  # fmt: skip
    classify = [(f"Classify the sentiment of this review as positive, negative or neutral: {r}",
                 StructuredOutput("choice", LABELS)) for r in REVIEWS]  # fmt: skip
    tool = [(f"You can call {TOOL['name']} with arguments {json.dumps(TOOL['parameters'])}. Reply with the "
             f"arguments as JSON. Request: {r}", StructuredOutput("json", TOOL["parameters"])) for r in REQUESTS]  # fmt: skip
    out = {"json extraction": extract, "choice": classify, "tool call": tool}
    out["free chat (same prompts)"] = [(m, None) for m, _ in extract + tool]
    return out


def measure(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], speculative: bool) -> dict:
    start = time.perf_counter()
    outs = [llm.generate([p], sp, speculative=speculative)[0] for p, sp in zip(prompts, params)]
    seconds = time.perf_counter() - start
    drafts = sum(o.metrics.num_drafts for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    cut = sum(o.metrics.num_grammar_cut_tokens for o in outs)
    return {"outs": outs, "tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds,
            "tau": 1 + sum(o.metrics.num_accepted_tokens for o in outs) / drafts if drafts else 1.0,
            "cut": cut / (cut + drafted) if cut + drafted else 0.0}  # fmt: skip


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=positive_int, default=96)
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--json", type=out_path, default=None)
    ap.add_argument("--results", type=out_path, default=None, help="the results page to write the table into")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for method in args.methods:
        llm = LLM(speculative_config=METHODS[method])
        warm = llm.encode_chat("Hello")
        for speculative in (True, False):  # the first passes of a process are cold
            llm.generate([warm], SamplingParams(temperature=0, max_tokens=8), speculative=speculative)
        for task, items in tasks().items():
            prompts = [llm.encode_chat(m) for m, _ in items]
            params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, structured=so) for _, so in items]
            plain = measure(llm, prompts, params, speculative=False)
            spec = measure(llm, prompts, params, speculative=True)
            for a, b, (_, so) in zip(plain["outs"], spec["outs"], items):
                assert a.token_ids == b.token_ids, (method, task, "speculative greedy differs from plain")
                if so is not None and so.kind == "json" and a.finish_reason == "stop":
                    json.loads(a.text)
            ratio = (spec["tokens"] / spec["seconds"]) / (plain["tokens"] / plain["seconds"])
            rows.append({"method": method, "task": task, "plain_tok_s": plain["tokens"] / plain["seconds"],
                         "tok_s": spec["tokens"] / spec["seconds"], "speedup": ratio, "tau": spec["tau"],
                         "cut": spec["cut"]})  # fmt: skip
            r = rows[-1]
            print(f"{method:15s} {task:26s} plain {r['plain_tok_s']:6.1f} tok/s  spec {r['tok_s']:6.1f} tok/s  "
                  f"x{r['speedup']:.2f}  τ {r['tau']:.2f}  cut {100 * r['cut']:.1f}%", flush=True)  # fmt: skip
        del llm
    lines = ["| method | task | plain tok/s | speculative tok/s | speedup | τ | drafts cut by the grammar |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['method']} | {r['task']} | {r['plain_tok_s']:.1f} | {r['tok_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['tau']:.2f} | {100 * r['cut']:.1f}% |")  # fmt: skip
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.results:
        body = (f"Greedy, default model, {args.max_tokens} tokens at most, batch 1, each prompt one by one (4 per "
                "task); every speculative output equal to plain decoding's. *Free chat* is the extraction and "
                "tool prompts without a constraint: the speedup structure adds. *Cut*: draft tokens dropped "
                "before verification because they left the grammar, of all draft tokens.\n\n" + table + "\n")  # fmt: skip
        write_results(args.results, "structured-output", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
