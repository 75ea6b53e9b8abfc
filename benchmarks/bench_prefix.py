"""Prefix caching on conversations: a multi-turn chat and an agent loop, each with a shared
system prompt of about 1,000 tokens, with and without the cache, plain and with ``suffix``.

Default model, chat template, greedy. Each turn's prompt is the whole conversation so far,
rendered by the chat template and tokenized again, as a server sees it. The chat asks 8
questions; the agent takes 10 steps, each step's observation a piece of a standard-library
module's source. The four configurations take turns (turn k of each before turn k + 1), so
the machine's noise falls on all alike; greedy outputs are checked to be identical, so the
four conversations are the same tokens.

Per workload and configuration: time to first token of the first and the last turn, the
last turn's as a share of the first's, the total time, and the prompt tokens the cache
served.

    python benchmarks/bench_prefix.py [--threads 2] [--max-tokens 48] [--results docs/results.md]
"""

from __future__ import annotations

import inspect
import json
import time

import torch
from args import out_path, positive_int, run, write_results

from specdecode import LLM, SamplingParams
from specdecode.entrypoints.cli import OneLineParser

CONFIGS = {  # name: (speculative_config, prefix caching)
    "plain, no cache": (None, False),
    "plain, cache": (None, True),
    "suffix, no cache": ({"method": "suffix"}, False),
    "suffix, cache": ({"method": "suffix"}, True),
}
QUESTIONS = [
    "What does json.dumps do with a dict?",
    "How do I pretty-print JSON with an indent?",
    "What does textwrap.dedent do?",
    "How do I wrap a long line at 40 characters?",
    "What is the difference between json.load and json.loads?",
    "How do I sort the keys when writing JSON?",
    "How can I shorten a string with a placeholder?",
    "Summarize what we discussed in two sentences.",
]
AGENT_TASK = "Find where the json module escapes non-ASCII characters and explain how, step by step."


def reference_text(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of the json and textwrap modules' documentation."""
    import json as json_module
    import textwrap

    parts = [json_module.__doc__, textwrap.__doc__]
    parts += [f"{name}{inspect.signature(f)}: {inspect.getdoc(f)}" for name, f in inspect.getmembers(textwrap)
              if inspect.isfunction(f) and f.__doc__]  # fmt: skip
    parts += [f"{name}{inspect.signature(f)}: {inspect.getdoc(f)}" for name, f in inspect.getmembers(json_module)
              if inspect.isfunction(f) and f.__doc__]  # fmt: skip
    ids = tokenizer.encode("\n\n".join(p for p in parts if p))[:tokens]
    return tokenizer.decode(ids)


def observations() -> list[str]:
    """The agent's tool results: pieces of json's encoder, in order."""
    import json.encoder

    lines = inspect.getsource(json.encoder).splitlines()
    return ["\n".join(lines[i : i + 14]) for i in range(0, 14 * 10, 14)]


def render(llm: LLM, messages: list[dict]) -> list[int]:
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def turn(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], float, float]:
    """Output tokens, time to first token and total seconds of one turn."""
    first: list[float] = []
    start = time.perf_counter()
    out = llm.generate([prompt], params, on_tokens=lambda i, ids: first or first.append(time.perf_counter()))[0]
    return out.token_ids, first[0] - start, time.perf_counter() - start


def workload(llms: dict[str, LLM], system: str, user_turns: list[str], params: SamplingParams) -> dict:
    """Every configuration through the same conversation, turn by turn in turns."""
    first = next(iter(llms.values()))
    messages = [{"role": "system", "content": system}]
    rows: dict[str, dict] = {name: {"ttft": [], "total": []} for name in llms}
    before = {name: llm.engine.stats() for name, llm in llms.items()}
    for text in user_turns:
        messages.append({"role": "user", "content": text})
        prompt = render(first, messages)
        outs = {}
        for name, llm in llms.items():
            outs[name], ttft, total = turn(llm, prompt, params)
            rows[name]["ttft"].append(ttft)
            rows[name]["total"].append(total)
        if len({tuple(o) for o in outs.values()}) != 1:
            raise SystemExit(f"greedy outputs differ between configurations at turn {len(rows[name]['ttft'])}")
        messages.append({"role": "assistant", "content": first.decode(outs[name])})
    for name, llm in llms.items():
        stats = llm.engine.stats()
        rows[name]["prompt_tokens"] = stats.prefix_cache_queries - before[name].prefix_cache_queries
        rows[name]["cached_tokens"] = stats.prefix_cache_hits - before[name].prefix_cache_hits
    rows["last_prompt_tokens"] = len(prompt)
    return rows


def table(name: str, rows: dict, turns: int) -> str:
    lines = [f"**{name}** ({turns} turns, last prompt {rows['last_prompt_tokens']} tokens)", "",
             "| configuration | TTFT turn 1 (s) | TTFT last turn (s) | last / first | total (s) | prompt tokens cached |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for config in CONFIGS:
        r = rows[config]
        t = r["ttft"]
        cached = f"{r['cached_tokens'] / r['prompt_tokens']:.0%}" if r["prompt_tokens"] else "–"
        lines.append(f"| {config} | {t[0]:.3f} | {t[-1]:.3f} | {t[-1] / t[0]:.0%} | {sum(r['total']):.2f} | {cached} |")
    return "\n".join(lines)


def main() -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--max-tokens", type=positive_int, default=48)
    parser.add_argument("--system-tokens", type=positive_int, default=1000)
    parser.add_argument("--json", type=out_path, default=None)
    parser.add_argument("--results", type=out_path, default=None, help="write the tables into this results page")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llms = {name: LLM(speculative_config=spec, enable_prefix_caching=cache) for name, (spec, cache) in CONFIGS.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    first = next(iter(llms.values()))
    for llm in llms.values():  # the first passes of a process are cold
        llm.generate([first.tokenize("Hello, world.")], SamplingParams(temperature=0.0, max_tokens=8))
    system = "You are a helpful assistant for Python programmers. Answer briefly.\n\nReference:\n"
    system += reference_text(first.tokenizer, args.system_tokens)
    chat = workload(llms, system, QUESTIONS, params)
    agent_system = "You are an agent: say which file and lines to read next, then reason about what you read.\n\n"
    agent_system += system  # first: the agent's prompt shares no block with the chat's
    steps = [AGENT_TASK] + [f"Observation:\n{o}" for o in observations()[:9]]
    agent = workload(llms, agent_system, steps, params)
    body = "\n\n".join([table("Multi-turn chat", chat, len(QUESTIONS)), table("Agent loop", agent, len(steps))])
    print(body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"chat": chat, "agent": agent}, f, indent=1)
    if args.results:
        note = ("Time to first token (TTFT) and total time per conversation, default model, greedy, "
                f"{args.max_tokens} new tokens per turn, a {args.system_tokens}-token system prompt; every "
                "turn's prompt is the whole conversation, re-rendered by the chat template. Outputs are "
                "identical across the four configurations.")  # fmt: skip
        write_results(args.results, "prefix-caching", f"## Prefix caching\n\n{note}\n\n{body}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
