"""Build a datastore (drafters/datastore.py) from chat records: the target's own answers.

    python -m specdecode.train.datastore --data d/*.jsonl --out DIR [--target MODEL]

Owns: reading the assistant turns of ``{"messages": [...]}`` records as the target's chat
template renders them, and writing the folder that ``"datastore": DIR`` loads.
Does not own: making the records (regenerate.py writes the target's answers) or the lookup.

Each turn is stored with the last HEADER tokens of the prompt before it (the template's
``<|im_start|>assistant\\n``), so that an answer's opening words can be matched from the
header, and through its end-of-turn tokens, so that the stop is drafted too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from specdecode.config import SpecDecodeError, first_line
from specdecode.train.corpus import find_files

HEADER = 3  # prompt tokens kept before each answer


def answer_tokens(messages: list[Any], tokenizer: Any) -> list[list[int]]:
    """Each assistant turn's tokens, with the HEADER tokens before it (none where the
    conversation does not render the turn after its own generation prompt)."""
    turns = []
    for i, m in enumerate(messages):
        if i == 0 or not (isinstance(m, dict) and m.get("role") == "assistant"):
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True)
        before, through = list(_ids(before)), list(_ids(through))
        if len(through) > len(before) and through[: len(before)] == before:
            turns.append(through[max(0, len(before) - HEADER) :])
    return turns


def _ids(rendered: Any) -> list[int]:
    """apply_chat_template's ids (a list, or a BatchEncoding in newer transformers)."""
    return rendered["input_ids"] if hasattr(rendered, "keys") else rendered


def read_answers(files: list[Path], tokenizer: Any, drop_held_out: bool = False) -> list[list[int]]:
    """The answers of every chat record in ``files`` (`find_files`'s; files other than .jsonl are
    skipped); with ``drop_held_out``, not those of a record whose first user turn names a benchmark
    prompt's subject (`instructions.names_held_out`)."""
    from jinja2 import TemplateError

    from specdecode.train.instructions import names_held_out

    docs: list[list[int]] = []
    for file in files:
        if file.suffix != ".jsonl":
            continue
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise SpecDecodeError(f"cannot read {file}: {first_line(e)}") from None
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                messages = record["messages"]
                assert isinstance(messages, list)
                if drop_held_out and names_held_out(_first_request(messages)):
                    continue
                docs += answer_tokens(messages, tokenizer)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise SpecDecodeError(f'{file}:{number}: expected a JSON chat record {{"messages": [...]}}') from None
            except TemplateError as e:
                raise SpecDecodeError(f"{file}:{number}: cannot render messages: {first_line(e)}") from None
    if not docs:
        raise SpecDecodeError(
            f"no assistant turns found in {', '.join(map(str, files))} (chat records in .jsonl files)"
        )
    return docs


def _first_request(messages: list[Any]) -> str:
    """The first user turn's text ("" where there is none)."""
    user = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return user[0] if user and isinstance(user[0], str) else ""


def main(argv: list[str] | None = None) -> int:
    from specdecode.entrypoints.cli import OneLineParser  # argparse's errors as one line, exit 2

    ap = OneLineParser(prog="python -m specdecode.train.datastore", description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", required=True, help="chat records (.jsonl files or folders of them)")
    ap.add_argument("--out", required=True, help="the folder to write")
    ap.add_argument("--target", default=None, help="model path or alias (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--note", default=None, help="a line recorded in config.json (how the records were made)")
    ap.add_argument("--drop-held-out", action="store_true",
                    help="skip records whose request names a benchmark prompt's subject (as the shipped store does)")
    args = ap.parse_args(argv)
    try:
        from specdecode.drafters.datastore import build_datastore, tokenizer_digest
        from specdecode.drafters.learned import target_fingerprint
        from specdecode.model.loader import load_model

        files = find_files(tuple(args.data))  # a missing or empty path before the model loads
        target = load_model(args.target, device="cpu")
        if target.tokenizer is None:
            raise SpecDecodeError(f"{target.name} has no tokenizer to render chat records with")
        store = build_datastore(read_answers(files, target.tokenizer, args.drop_held_out))
        extra = {"built_from": [str(p) for p in args.data], **({"note": args.note} if args.note else {}),
                 **({"drop_held_out": True} if args.drop_held_out else {})}  # fmt: skip
        try:
            out = store.save(args.out, target_fingerprint(target.model), extra, tokenizer_digest(target.tokenizer))
        except OSError as e:  # --out an existing file, a read-only place
            raise SpecDecodeError(f"cannot write --out {args.out}: {first_line(e)}") from None
        print(f"{out}: {store.num_documents} answers, {len(store)} tokens")
        return 0
    except SpecDecodeError as e:  # bad input: one line, as the CLI gives it
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
