"""The training corpus: text files -> token windows, split into train and held-out.

Owns: finding documents (files, or folders searched recursively for *.txt, *.md, *.py,
*.rst and *.jsonl), reading them (a .jsonl line is one document: ``{"text": ...}`` or
chat ``{"messages": [...]}`` rendered with the tokenizer's chat template), tokenizing
with the target's tokenizer, the held-out split by document, and packing each side into
windows of ``seq_len`` tokens. Files are read in a seeded shuffled order until
``max_tokens``, so a capped corpus is a sample of the whole and the split is deterministic.
A training document that quotes a held-out one's long text, or is quoted by one (regenerate's
``--passages`` turns earlier answers into texts to summarise), is dropped: the held-out figures
would otherwise be measured on text the drafter was trained on.
Does not own: batching or the order windows are trained in (trainer.py).
"""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdecode.config import SpecDecodeError, first_line

SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl")
_TOKENIZE_CHUNK = 32  # documents per tokenizer call


@dataclass(frozen=True)
class Windows:
    """Packed token windows: ``tokens`` [N, T] int64, ``mask`` [N, T] bool (False = padding, at the right)."""

    tokens: Tensor
    mask: Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


@dataclass(frozen=True)
class Corpus:
    train: Windows
    heldout: Windows
    num_documents: int  # trained on or held out
    num_files: int  # files read (the cap may stop before the last)
    num_dropped: int = 0  # training documents dropped for quoting held-out text, or being quoted by it


def find_files(paths: tuple[str, ...]) -> list[Path]:
    """Every corpus file under ``paths``, sorted; a missing path or no file at all is an error."""
    files: set[Path] = set()  # resolved: a file named twice (two spellings, a link) is read once
    for p in map(Path, paths):
        if not p.exists():
            raise SpecDecodeError(f"data path not found: {p}")
        if p.is_file():
            with p.open("rb") as f:
                if b"\0" in f.read(4096):  # a file named outright is read whatever its suffix: not weights
                    raise SpecDecodeError(f"{p} is not a text file")
            files.add(p.resolve())
        else:
            files.update(f.resolve() for f in p.rglob("*") if f.suffix in SUFFIXES and f.is_file())
    if not files:
        kinds = " ".join(f"*{s}" for s in SUFFIXES)
        raise SpecDecodeError(f"no text found in {', '.join(paths)} (looked for {kinds})")
    return sorted(files)


QUOTE_CHARS = 300  # a part of a document this long found inside another one makes them one text


@dataclass(frozen=True)
class _Doc:
    text: str  # what is tokenized
    chat: bool  # rendered by the chat template, which writes its own special tokens (BOS)
    parts: tuple[str, ...]  # the message contents (or the text): what another document may quote


def _documents(file: Path, tokenizer: Any) -> Iterator[_Doc]:
    text = file.read_text(encoding="utf-8", errors="replace")
    if file.suffix != ".jsonl":
        yield _Doc(text, False, (text,))
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"{file}:{number} is not valid JSON: {e}") from None
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            yield _Doc(record["text"], False, (record["text"],))
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            from jinja2 import TemplateError

            try:
                rendered = tokenizer.apply_chat_template(record["messages"], tokenize=False)
            except (TemplateError, ValueError, TypeError, KeyError) as e:  # name the record, in one line
                raise SpecDecodeError(f"{file}:{number}: cannot render messages: {first_line(e)}") from None
            # what a record may quote or be quoted by: its turns, not a system prompt shared by many
            contents = tuple(
                m["content"] for m in record["messages"]
                if isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
            )  # fmt: skip
            yield _Doc(rendered, True, contents)
        else:
            raise SpecDecodeError(f'{file}:{number}: expected {{"text": ...}} or {{"messages": [...]}}')


def read_corpus(
    paths: tuple[str, ...], tokenizer: Any, seq_len: int, max_tokens: int, heldout: float, seed: int
) -> Corpus:
    """Tokenized documents (each followed by EOS) split by document and packed into windows.

    The last ``heldout`` fraction of documents (at least one) is held out; a corpus of a
    single document holds out the tail of its tokens instead.
    """
    if tokenizer is None:
        raise SpecDecodeError("the target has no tokenizer: cannot tokenize a corpus")
    files = find_files(paths)
    random.Random(seed).shuffle(files)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    docs: list[list[int]] = []
    sources: list[_Doc] = []  # docs[i] came from sources[i]
    total, pending = 0, []

    def flush() -> None:
        nonlocal total
        todo = [d for d in pending if d.text.strip()]
        pending.clear()
        ids: dict[int, list[int]] = {}
        for chat in (False, True):  # as served: a chat template writes its own BOS, plain text gets the tokenizer's
            group = [i for i, d in enumerate(todo) if d.chat == chat]
            if group:
                out = tokenizer([todo[i].text for i in group], add_special_tokens=not chat, verbose=False)
                ids.update(zip(group, out["input_ids"]))
        for i, d in enumerate(todo):  # in reading order: the split depends on it
            docs.append(list(ids[i]) + eos)
            sources.append(d)
            total += len(docs[-1])

    num_files = 0
    for file in files:
        num_files += 1
        for doc in _documents(file, tokenizer):
            pending.append(doc)
            if len(pending) >= _TOKENIZE_CHUNK:
                flush()
        if total >= max_tokens:
            break
        flush()
    flush()
    if not docs:
        raise SpecDecodeError(f"no text found in {', '.join(paths)}: the files are empty")
    kept, n = [], 0
    for d in docs:
        if n + len(d) > max_tokens:  # the cap: whole documents, a cut one only if it would be the only one
            if not kept:
                kept.append(d[:max_tokens])
            break
        kept.append(d)
        n += len(d)
    docs, sources = kept, sources[: len(kept)]
    if len(docs) >= 2:
        held = min(max(1, round(heldout * len(docs))), len(docs) - 1)  # at least one document trains
        leaks = _quoting(sources[:-held], sources[-held:])
        dropped = len(leaks)
        train = [t for i, d in enumerate(docs[:-held]) if i not in leaks for t in d]
        test = [t for d in docs[-held:] for t in d]
        if leaks and len(leaks) == len(docs) - held:
            raise SpecDecodeError("every training document quotes a held-out one: lower --heldout or add text")
    else:
        dropped = 0
        stream = docs[0]
        cut = len(stream) - max(1, round(heldout * len(stream)))
        train, test = stream[:cut], stream[cut:]
    if len(train) < 2 or len(test) < 2:
        capped = total > max_tokens  # the cap cut text off: raising it helps; else only more text does
        raise SpecDecodeError(f"corpus too small: {sum(map(len, docs))} tokens "
                              f"({'raise --max-tokens or add text' if capped else 'add text'})")  # fmt: skip
    return Corpus(pack(train, seq_len), pack(test, seq_len), len(docs) - dropped, num_files, dropped)


def _quoting(train: list[_Doc], heldout: list[_Doc]) -> set[int]:
    """Indices of training documents that contain a held-out document's part of at least
    QUOTE_CHARS characters, or one of whose such parts a held-out document contains."""

    def joined(docs: list[_Doc]) -> tuple[str, list[int]]:  # one string to search, and where each doc starts
        starts, texts, at = [], [], 0
        for d in docs:
            starts.append(at)
            texts.append("\x00".join(d.parts))
            at += len(texts[-1]) + 1
        return "\x00".join(texts), starts

    def owners(needles: set[str], haystack: str, starts: list[int]) -> set[int]:
        found = set()
        for needle in needles:
            at = haystack.find(needle)
            while at >= 0:
                found.add(bisect.bisect_right(starts, at) - 1)
                at = haystack.find(needle, at + 1)
        return found

    def long_parts(d: _Doc) -> set[str]:  # what is long enough to count as a quote
        return {p.strip() for p in d.parts if len(p.strip()) >= QUOTE_CHARS}

    train_text, train_starts = joined(train)
    held_text, _ = joined(heldout)
    leaks = owners(set().union(*map(long_parts, heldout)), train_text, train_starts)  # quoting a held-out answer
    leaks |= {i for i, d in enumerate(train) if any(p in held_text for p in long_parts(d))}  # quoted by held-out
    return leaks


def pack(ids: list[int], seq_len: int) -> Windows:
    """Consecutive windows of ``seq_len`` tokens; the last is padded with 0 (mask False)."""
    n = -(-len(ids) // seq_len)
    tokens = torch.zeros(n * seq_len, dtype=torch.long)
    tokens[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    mask = torch.zeros(n * seq_len, dtype=torch.bool)
    mask[: len(ids)] = True
    return Windows(tokens.view(n, seq_len), mask.view(n, seq_len))
