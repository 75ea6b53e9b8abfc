"""Self-distillation data: the target's own answers to instructions built from offline text.

Owns: answering the instructions of instructions.py with the target through our engine,
written as chat records (``{"messages": [...]}`` per line) that `specdecode train --data`
reads. ``--passages`` takes the prose answers of an earlier run (explanations, posts,
stories, news reports) as texts to summarise; ``--exclude`` skips the instructions that
earlier runs answered, so that a new run adds new data. A non-empty ``--out`` is kept
unless ``--overwrite`` is given (its records are a run's work).
A drafter trained on the target's own outputs learns what the target will say, which
is what acceptance measures.

``--instructions magpie`` asks the target for the requests too (Magpie, Xu et al. 2024): fed
only the chat template up to where a user's message begins, an instruction-tuned model writes
a request like those it was tuned on, far more varied than templates (their answers are half
of the shipped datastore). Those that name a benchmark subject
(`names_held_out`), repeat, or do not end within ``--instruction-max-tokens`` are drawn again.

    python -m specdecode.train.regenerate --target smollm2-135m --out data/selfdistill.jsonl --num 600
    python -m specdecode.train.regenerate --out data/more.jsonl --num 600 --seed 1 --passages data/selfdistill.jsonl
    python -m specdecode.train.regenerate --out data/magpie.jsonl --num 600 --instructions magpie
    python -m specdecode.train.regenerate --out data/code.jsonl --num 600 --instructions magpie --instruction-start "Write a Python"

Does not own: the instructions (instructions.py), training (trainer.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.train.instructions import instructions, names_held_out

if TYPE_CHECKING:
    from specdecode import LLM


def read_messages(paths: list[str], role: str) -> list[str]:
    """The ``role`` messages of chat records (an earlier run's output)."""
    texts = []
    for path in paths:
        if not Path(path).is_file():
            raise SpecDecodeError(f"chat records not found: {path}")
        # as the trainer reads text: a stray non-UTF-8 byte is replaced, not fatal
        for n, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # blank, or the last line of a run stopped mid-write
                continue
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise SpecDecodeError(f'{path}:{n}: expected a chat record {{"messages": [{{"role": ..., '
                                      '"content": ...}, ...]}')  # fmt: skip
            texts += [m["content"] for m in messages if m.get("role") == role and isinstance(m.get("content"), str)]
    return texts


def read_passages(paths: list[str]) -> list[str]:
    """The prose answers of chat records as texts to summarise; answers holding code are left out."""
    return [t for t in read_messages(paths, "assistant") if "```" not in t and "def " not in t]


def new_instructions(num: int, seed: int, passages: list[str], answered: set[str]) -> list[str]:
    """``num`` instructions that are not in ``answered`` (fewer if the pools run out)."""
    pool = instructions(num + len(answered), seed, passages)
    return [p for p in pool if p not in answered][:num]


def user_turn_prefix(llm: LLM) -> list[int]:
    """The chat template's tokens up to where a user's message begins (system prompt included):
    the common start of two one-turn chats."""
    a, b = llm.encode_chat("Hello"), llm.encode_chat("?")
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def sample_instructions(
    llm: LLM, num: int, seed: int, skip: set[str], params: SamplingParams, start: str = "", max_rounds: int = 8
) -> list[str]:
    """``num`` requests written by the target itself (Magpie), each ended by the model within
    ``params.max_tokens``, none in ``skip`` or naming a benchmark subject, no two alike; fewer
    if ``max_rounds`` draws do not find them. With ``start`` every request opens with it (the
    model writes the rest), e.g. "Write a Python" for code tasks."""
    from tqdm import tqdm

    opening = list(llm.tokenizer(start, add_special_tokens=False)["input_ids"]) if start else []
    prefix = user_turn_prefix(llm) + opening
    key = lambda text: " ".join(text.lower().split())  # case and spacing make no new request
    seen = {key(t) for t in skip}
    kept: list[str] = []
    drawn = 0
    with tqdm(total=0, desc="drawing requests", unit="request") as bar:
        for _ in range(max_rounds):
            want = num - len(kept)
            if want <= 0:
                break
            n = want + want // 4 + 8  # some are dropped
            draws = [dataclasses.replace(params, seed=seed * 1_000_003 + drawn + i) for i in range(n)]
            drawn += n
            bar.total = drawn
            tokens: dict[int, list[int]] = {}
            ended: dict[int, bool] = {}
            for e in llm.stream([prefix] * n, draws):
                tokens.setdefault(e.index, []).extend(e.new_token_ids)
                if e.finish_reason:
                    ended[e.index] = e.finish_reason == "stop"  # the model closed its message
                    bar.update(1)
            for i in range(n):  # in draw order, so a seed gives the same requests
                text = (start + llm.decode(tokens.get(i, []))).strip()
                k = key(text)
                if not ended[i] or len(k) < 12 or k in seen or names_held_out(text):
                    continue
                seen.add(k)
                kept.append(text)
                if len(kept) == num:
                    break
            bar.set_postfix(kept=len(kept))
    return kept


def main(argv: list[str] | None = None) -> int:
    from specdecode.entrypoints.cli import OneLineParser  # argparse's errors as one line, exit 2

    ap = OneLineParser(prog="python -m specdecode.train.regenerate", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="model path or alias (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=600, help="instructions to answer")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = the target's greedy answers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16), float32, bfloat16, float16")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument("--quantization", default="auto", help="as `specdecode generate --quantization`")
    ap.add_argument("--batch", type=int, default=16, help="instructions answered together (the engine's max_num_seqs)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer instructions")
    ap.add_argument("--shard", default="0/1", help="K/N: answer every N-th instruction from the K-th (parallel runs)")
    ap.add_argument("--passages", nargs="*", default=[], help="chat records whose answers become texts to summarise")
    ap.add_argument("--exclude", nargs="*", default=[], help="chat records whose instructions are not asked again")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (else refused)")
    ap.add_argument(
        "--instructions",
        choices=["templates", "magpie"],
        default="templates",
        help="templates over offline text, or requests the target writes itself (Magpie)",
    )
    ap.add_argument("--instruction-temperature", type=float, default=0.8, help="magpie: sampling the requests")
    ap.add_argument("--instruction-top-p", type=float, default=0.95, help="magpie: sampling the requests")
    ap.add_argument("--instruction-max-tokens", type=int, default=96, help="magpie: longer requests are drawn again")
    ap.add_argument("--instruction-start", default="", help='magpie: every request opens with this ("Write a Python")')
    args = ap.parse_args(argv)
    try:
        for flag in ("num", "max_tokens", "batch", "max_prompt_tokens", "threads", "instruction_max_tokens"):
            value = getattr(args, flag)
            if value is not None and value < 1:  # --num -5 sliced the pool from its end: thousands of prompts
                raise SpecDecodeError(f"--{flag.replace('_', '-')} must be an integer >= 1, got {value}")
        try:
            shard, num_shards = (int(x) for x in args.shard.split("/"))
            assert 0 <= shard < num_shards
        except (ValueError, AssertionError):
            raise SpecDecodeError(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}") from None
        if Path(args.out).is_dir():
            raise SpecDecodeError(f"--out {args.out} is a folder; name the file to write")
        if Path(args.out).is_file() and Path(args.out).stat().st_size and not args.overwrite:
            raise SpecDecodeError(f"--out {args.out} holds records already; --overwrite replaces them, or write "
                                  f"a new file with --exclude {args.out} (its instructions are not asked again)")  # fmt: skip
        if args.instructions == "magpie" and args.passages:
            raise SpecDecodeError("--passages are texts for templated summaries; --instructions magpie takes none")
        if args.instruction_start and args.instructions != "magpie":
            raise SpecDecodeError(
                "--instruction-start opens requests the target writes: it needs --instructions magpie"
            )
        # bad values before the model loads
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        magpie_params(args)
        return answer(args, shard, num_shards)
    except SpecDecodeError as e:  # bad input: one line, as the CLI gives it
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the records written so far are whole lines (flushed one by one)
        print(file=sys.stderr)
        return 130


def magpie_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.instruction_temperature, top_p=args.instruction_top_p,
                          max_tokens=args.instruction_max_tokens)  # fmt: skip


def answer(args: argparse.Namespace, shard: int, num_shards: int) -> int:
    """Answer this shard's instructions and write them as chat records to ``args.out``."""
    import torch
    from tqdm import tqdm

    from specdecode import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    answered = set(read_messages(args.exclude, "user"))  # bad paths fail before the model loads
    if args.instructions == "templates":
        prompts = new_instructions(args.num, args.seed, read_passages(args.passages), answered)[shard::num_shards]
    # sequences end within max_model_len; KV for a whole batch of them, so nothing is preempted
    max_len = args.max_prompt_tokens + args.max_tokens
    # the answers are the model's as it is loaded here: on a GPU (bf16) they may differ from the GGUF
    # model's that CPU serving runs; --device cpu --quantization gguf gives those
    try:
        llm = LLM(model=args.target, dtype=args.dtype, device=args.device, quantization=args.quantization,
                  max_model_len=max_len, max_num_seqs=args.batch, num_blocks=args.batch * -(-(max_len + 32) // 16))  # fmt: skip
    except SpecDecodeError as e:  # the engine's limit, named by the flags that set it here
        if not str(e).startswith("max_model_len"):
            raise
        raise SpecDecodeError(f"--max-prompt-tokens + --max-tokens = {max_len} does not fit the target: {e}") from None
    if args.instructions == "magpie":  # this shard's share, drawn with its own seeds
        share = len(range(shard, args.num, num_shards))
        prompts = sample_instructions(llm, share, args.seed * num_shards + shard, answered, magpie_params(args),
                                      args.instruction_start)  # fmt: skip
        print(f"the target wrote {len(prompts)} requests", file=sys.stderr)
    limit = args.max_prompt_tokens
    encoded = [(p, llm.encode_chat(p)) for p in prompts]  # the chat template rendered once per instruction
    fits = [(p, ids) for p, ids in encoded if len(ids) <= limit]
    if len(fits) < len(prompts):
        print(f"skipped {len(prompts) - len(fits)} instructions longer than {limit} tokens", file=sys.stderr)
    prompts, token_lists = [p for p, _ in fits], [ids for _, ids in fits]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not prompts:  # a shard past the last instruction, or every one too long: nothing to answer
        out.write_text("")
        print(f"wrote 0 chat records to {out}: no instruction to answer", file=sys.stderr)
        return 0
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i)
              for i in range(len(prompts))]  # fmt: skip
    answers: dict[int, list[int]] = {}
    # one continuous batch over every instruction: a row that finishes makes room for the next
    with out.open("w") as f, tqdm(total=len(prompts), desc="answering", unit="prompt") as bar:
        for e in llm.stream(token_lists, params):
            answers.setdefault(e.index, []).extend(e.new_token_ids)
            if e.finish_reason:
                text = llm.decode(answers.pop(e.index))
                messages = [{"role": "user", "content": prompts[e.index]}, {"role": "assistant", "content": text}]
                f.write(json.dumps({"messages": messages}) + "\n")
                f.flush()  # whole records only, should the run be stopped
                bar.update(1)
    print(f"wrote {len(prompts)} chat records to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
