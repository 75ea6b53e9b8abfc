"""The training corpus: text files -> token windows, split into train and held-out.

Owns: finding documents (files, or folders searched recursively for *.txt, *.md, *.py,
*.rst and *.jsonl), reading them (a .jsonl line is one document: ``{"text": ...}`` or
chat ``{"messages": [...]}`` rendered with the tokenizer's chat template), tokenizing
with the target's tokenizer, the held-out split by document, and packing each side into
windows of ``seq_len`` tokens. Files are read in a seeded shuffled order until
``max_tokens``, so a capped corpus is a sample of the whole and the split is deterministic.
What is trained on: in a chat record only the positions where serving drafts, those whose
next token the assistant wrote (its turns through their first stop token; the system and
user turns are context only, as EAGLE's recipe masks them); plain text everywhere. Windows
start at a document (whole documents are packed while they fit), and a chat record longer
than a window continues with half a window of context, so an answer's target logits are
never computed from a window that starts on them.
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
    """Packed token windows: ``tokens`` [N, T] int64, ``mask`` [N, T] bool (False = padding, at
    the right), ``trained`` [N, T] bool: the target's logits at t (for token t + 1) are a label."""

    tokens: Tensor
    mask: Tensor
    trained: Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def num_trained(self) -> int:
        return int(self.trained.sum())


@dataclass(frozen=True)
class Corpus:
    train: Windows
    heldout: Windows
    num_documents: int  # trained on or held out
    num_files: int  # files read (the cap may stop before the last)
    num_dropped: int = 0  # training documents dropped for quoting held-out text, or being quoted by it
    num_whole: int = 0  # chat records trained on whole: the template renders turns otherwise, or no fast tokenizer


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
    answers: tuple[tuple[int, int], ...] | None = None  # chat: the assistant turns' [start, end) in text; None: all


def _answer_spans(messages: list[Any], rendered: str, tokenizer: Any) -> tuple[tuple[int, int], ...] | None:
    """Where each assistant turn lies in ``rendered``: from the end of the conversation before
    it rendered with the generation prompt (what serving is given) to the end of the turn (the
    tokens are cut at its first stop token, `_trained`). A turn the whole conversation renders
    otherwise than it would be served (Qwen3 drops an earlier turn's reasoning) is context only.
    None where no turn can be placed (the record is then trained on whole), or where no turn
    is the assistant's."""
    from jinja2 import TemplateError

    spans = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") == "assistant") or i == 0:
            continue
        try:
            before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        except (TemplateError, ValueError, TypeError, KeyError):
            return None
        if rendered.startswith(through) and through.startswith(before) and len(through) > len(before):
            spans.append((len(before), len(through)))
    return tuple(spans) or None


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
            yield _Doc(rendered, True, contents, _answer_spans(record["messages"], rendered, tokenizer))
        else:
            raise SpecDecodeError(f'{file}:{number}: expected {{"text": ...}} or {{"messages": [...]}}')


def read_corpus(
    paths: tuple[str, ...], tokenizer: Any, seq_len: int, max_tokens: int, heldout: float, seed: int,
    stop_ids: tuple[int, ...] = (),
) -> Corpus:
    """Tokenized documents (each followed by EOS) split by document and packed into windows.

    The last ``heldout`` fraction of documents (at least one) is held out; a corpus of a
    single document holds out the tail of its tokens instead. ``stop_ids``: the target's EOS
    ids (its config and generation_config.json, as serving stops), which end an assistant
    turn beside the tokenizer's EOS (Gemma ends turns with <end_of_turn>, its EOS is <eos>).
    """
    if tokenizer is None:
        raise SpecDecodeError("the target has no tokenizer: cannot tokenize a corpus")
    files = find_files(paths)
    random.Random(seed).shuffle(files)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    docs: list[Tokenized] = []
    sources: list[_Doc] = []  # docs[i] came from sources[i]
    total, pending = 0, []
    offsets = bool(getattr(tokenizer, "is_fast", False))  # a slow tokenizer cannot place answers: all trains
    stops = {*stop_ids, *eos}

    def flush() -> None:
        nonlocal total
        todo = [d for d in pending if d.text.strip()]
        pending.clear()
        ids: dict[int, list[int]] = {}
        char_spans: dict[int, list[tuple[int, int]]] = {}  # each token's characters in a chat record's text
        for chat in (False, True):  # as served: a chat template writes its own BOS, plain text gets the tokenizer's
            group = [i for i, d in enumerate(todo) if d.chat == chat]
            if group:
                out = tokenizer([todo[i].text for i in group], add_special_tokens=not chat, verbose=False,
                                return_offsets_mapping=chat and offsets)  # fmt: skip
                ids.update(zip(group, out["input_ids"]))
                char_spans.update(zip(group, out["offset_mapping"]) if chat and offsets else ())
        for i, d in enumerate(todo):  # in reading order: the split depends on it
            trained = _trained(ids[i], len(eos), d.answers, char_spans.get(i), stops)
            docs.append(Tokenized(list(ids[i]) + eos, trained, context=d.answers is not None and i in char_spans))
            sources.append(d)
            total += len(docs[-1].ids)

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
        if n + len(d.ids) > max_tokens:  # the cap: whole documents, a cut one only if it would be the only one
            if not kept:
                kept.append(d.part(0, max_tokens))
            break
        kept.append(d)
        n += len(d.ids)
    docs, sources = kept, sources[: len(kept)]
    whole = sum(s.chat and not d.context for d, s in zip(docs, sources))  # chat records trained on whole
    if len(docs) >= 2:
        held = min(max(1, round(heldout * len(docs))), len(docs) - 1)  # at least one document trains
        leaks = _quoting(sources[:-held], sources[-held:])
        dropped = len(leaks)
        train = [d for i, d in enumerate(docs[:-held]) if i not in leaks]
        test = docs[-held:]
        if leaks and len(leaks) == len(docs) - held:
            raise SpecDecodeError("every training document quotes a held-out one: lower --heldout or add text")
    else:
        dropped = 0
        one = docs[0]
        cut = len(one.ids) - max(1, round(heldout * len(one.ids)))
        train, test = [one.part(0, cut)], [one.part(cut, len(one.ids))]
    for side in (train, test):
        if sum(len(d.ids) for d in side) < 2 or sum(sum(d.trained) for d in side) < 1:
            capped = total > max_tokens  # the cap cut text off: raising it helps; else only more text does
            raise SpecDecodeError(f"corpus too small: {sum(len(d.ids) for d in docs)} tokens, "
                                  f"{sum(sum(d.trained) for d in docs)} of them labels "
                                  f"({'raise --max-tokens or add text' if capped else 'add text'})")  # fmt: skip
    return Corpus(pack(train, seq_len), pack(test, seq_len), len(docs) - dropped, num_files, dropped, whole)


@dataclass(frozen=True)
class Tokenized:
    ids: list[int]
    trained: list[bool]  # trained[t]: the target's logits at t (for token t + 1) are a label
    context: bool = False  # a chat record whose answers were placed: its labels need the prompt before them

    def part(self, start: int, end: int) -> Tokenized:
        return Tokenized(self.ids[start:end], self.trained[start:end], self.context)


def _trained(
    ids: list[int], num_eos: int, answers: tuple[tuple[int, int], ...] | None, offsets: Any, stops: set[int]
) -> list[bool]:
    """Which of a document's positions (``ids`` and ``num_eos`` appended EOS) are trained on: all
    but the last (its next token is another document's), or, in a chat record, those whose next
    token the assistant wrote: a token starting inside an assistant turn (``offsets``: each
    token's character span in the rendered text), up to the turn's first stop token (serving
    stops there; what the template writes after it is never generated)."""
    n = len(ids) + num_eos
    if answers is None or offsets is None:
        return [True] * (n - 1) + [False]
    answer, ended = [], set()
    for t, (start, _) in zip(ids, offsets):
        turn = next((k for k, (a, b) in enumerate(answers) if a <= start < b), None)
        answer.append(turn is not None and turn not in ended)
        if answer[-1] and t in stops:
            ended.add(turn)
    return answer[1:] + [False] * (num_eos + 1)


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


def pack(docs: list[Tokenized], seq_len: int) -> Windows:
    """Windows of ``seq_len`` tokens that start at a document: documents in order, each in the
    current window if it fits, else from a new one. A longer document fills windows of its own:
    plain text in consecutive pieces (its rest then starts the next window); a chat record's
    later windows each repeat the half window before them, untrained, so that an answer's labels
    are computed with at least that much of what precedes them. Windows without a trained
    position are left out (they teach nothing). Padded at the right with 0 (mask False)."""
    rows: list[tuple[list[int], list[bool]]] = []
    for d in docs:
        if rows and len(rows[-1][0]) + len(d.ids) <= seq_len:
            rows[-1][0].extend(d.ids)
            rows[-1][1].extend(d.trained)
            continue
        start = done = 0  # the window's first position; the positions placed so far
        while done < len(d.ids):
            end = min(start + seq_len, len(d.ids))
            rows.append((d.ids[start:end], [False] * (done - start) + d.trained[done:end]))
            done = end
            start = done - seq_len // 2 if d.context else done
    rows = [r for r in rows if any(r[1])]
    tokens = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros(len(rows), seq_len, dtype=torch.bool)
    trained = torch.zeros(len(rows), seq_len, dtype=torch.bool)
    for i, (ids, tr) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = True
        trained[i, : len(tr)] = torch.tensor(tr, dtype=torch.bool)
    return Windows(tokens, mask, trained)
