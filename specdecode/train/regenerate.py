"""Self-distillation data: the target's own answers to instructions built from offline text.

Owns: building instructions (chat questions from a topic list, code tasks from Python
standard-library docstrings, summaries of paragraphs from the standard library's and
/usr/share/doc's text) and answering them with the target through our engine, written as
chat records (``{"messages": [...]}`` per line) that `specdecode train --data` reads.
A drafter trained on the target's own outputs learns what the target will say, which
is what acceptance measures.

    python -m specdecode.train.regenerate --target smollm2-135m --out data/selfdistill.jsonl --num 600

Does not own: training (trainer.py). The benchmark prompts (benchmarks/prompts*.json)
are not drawn from these sources' templates.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "vaccines", "inflation",
    "machine learning", "the immune system", "plate tectonics", "the Roman Empire", "climate change",
    "blockchains", "the printing press", "DNA replication", "supply and demand", "volcanoes", "electric cars",
    "the internet", "jazz music", "the Renaissance", "antibiotics", "solar panels", "the Moon landing",
    "compound interest", "sleep", "coffee", "honeybees", "the stock market", "recycling", "earthquakes",
    "the human heart", "neural networks", "the Olympic Games", "democracy", "rainbows", "tides", "gravity",
    "the Great Wall of China", "chess", "meditation", "nuclear energy", "the Industrial Revolution", "bread making",
    "public speaking", "time management", "the theory of evolution", "operating systems", "databases",
    "encryption", "the speed of light", "glaciers", "coral reefs", "the ancient Egyptians", "hurricanes",
    "photosynthetic algae", "the metric system", "electricity", "magnets", "the periodic table", "vitamins",
)  # fmt: skip
CHAT_TEMPLATES = (
    "Explain {t} to a high-school student.",
    "What are the most important facts about {t}?",
    "Give me three interesting questions about {t} and answer each one.",
    "Write a short blog post about {t}.",
    "What are common misconceptions about {t}?",
    "Describe the history of {t} in a few paragraphs.",
)


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))


def code_tasks(rng: random.Random, n: int) -> list[str]:
    """"Write a Python function ..." from standard-library functions' one-line docstrings."""
    tasks = []
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                if 20 <= len(doc) <= 160:
                    args = ", ".join(a.arg for a in node.args.args)
                    tasks.append(f"Write a Python function `{node.name}({args})`. {doc} Include a short example.")
    rng.shuffle(tasks)
    return tasks[:n]


def paragraphs(rng: random.Random, n: int) -> list[str]:
    """Paragraphs of 300-1200 characters from module docstrings and /usr/share/doc text files."""
    found = []
    for path in _stdlib_files():
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8", errors="replace"))) or ""
        except SyntaxError:
            continue
        found += [p for p in doc.split("\n\n") if 300 <= len(p) <= 1200]
    for path in sorted(Path("/usr/share/doc").glob("*/*"))[:2000]:
        if path.is_file() and path.suffix in ("", ".txt", ".md") and path.stat().st_size < 200_000:
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [p for p in text.split("\n\n") if 300 <= len(p) <= 1200 and p.count(" ") > 40]
    rng.shuffle(found)
    return found[:n]


def instructions(num: int, seed: int) -> list[str]:
    """About a third each of chat questions, code tasks and summaries, shuffled."""
    rng = random.Random(seed)
    chat = [t.format(t=topic) for topic in TOPICS for t in CHAT_TEMPLATES]
    rng.shuffle(chat)
    third = num // 3
    summaries = [f"Summarize the following text in a few sentences:\n\n{p}" for p in paragraphs(rng, third)]
    out = chat[: num - 2 * third] + code_tasks(rng, third) + summaries
    rng.shuffle(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="model path or alias (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=600, help="instructions to answer")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = the target's greedy answers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16, help="instructions answered together (the engine's max_num_seqs)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer instructions")
    ap.add_argument("--shard", default="0/1", help="K/N: answer every N-th instruction from the K-th (parallel runs)")
    args = ap.parse_args(argv)
    try:
        shard, num_shards = (int(x) for x in args.shard.split("/"))
        assert 0 <= shard < num_shards
    except (ValueError, AssertionError):
        ap.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
    import torch
    from tqdm import tqdm

    from specdecode import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    # sequences end within max_model_len; KV for a whole batch of them, so nothing is preempted
    max_len = args.max_prompt_tokens + args.max_tokens
    llm = LLM(model=args.target, max_model_len=max_len, max_num_seqs=args.batch,
              num_blocks=args.batch * -(-(max_len + 32) // 16))  # fmt: skip
    prompts = instructions(args.num, args.seed)[shard::num_shards]
    limit = args.max_prompt_tokens
    fits = [p for p in prompts if len(llm.encode_chat(p)) <= limit]
    if len(fits) < len(prompts):
        print(f"skipped {len(prompts) - len(fits)} instructions longer than {limit} tokens", file=sys.stderr)
    prompts = fits
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f, tqdm(total=len(prompts), desc="answering", unit="prompt") as bar:
        for i in range(0, len(prompts), args.batch):
            chunk = prompts[i : i + args.batch]
            params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i + j)
                      for j in range(len(chunk))]  # fmt: skip
            for prompt, res in zip(chunk, llm.generate([llm.encode_chat(p) for p in chunk], params)):
                messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": res.text}]
                f.write(json.dumps({"messages": messages}) + "\n")
                f.flush()  # whole records only, should the run be stopped
            bar.update(len(chunk))
    print(f"wrote {len(prompts)} chat records to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
