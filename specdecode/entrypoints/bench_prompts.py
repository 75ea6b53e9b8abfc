"""The prompts `specdecode bench` measures on: eight categories after Spec-Bench, built
offline from text the Python installation carries, or the user's own file.

Owns: `CATEGORIES` (name -> builder of chat messages, and the structured-output constraint
where the category has one), `build_prompts` and `read_prompts_file` (a JSON-lines file of
OpenAI chat requests). Every builder is deterministic: the same Python gives the same
prompts, so two runs measure the same work. Does not own: measuring (bench.py).
"""

from __future__ import annotations

import inspect
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specdecode.config import SpecDecodeError, StructuredOutput


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    messages: list[dict[str, Any]]  # chat messages, rendered by the model's template
    structured: StructuredOutput | None = None
    text: str | None = None  # or a raw prompt, tokenized as it is


CHAT = [
    "What are three good habits for staying focused while studying?",
    "Explain the difference between weather and climate to a ten-year-old.",
    "Give me a short plan for a relaxing weekend at home.",
    "Why do leaves change colour in autumn?",
    "What should I consider when choosing a first programming language?",
    "Suggest a name for a small bakery and explain why it works.",
    "How can I keep a houseplant alive while I travel for two weeks?",
    "What is a polite way to decline an invitation to a party?",
    "Describe how a bicycle's gears make climbing a hill easier.",
    "Which questions should I ask before adopting a dog?",
]
RAG_QUESTIONS = ["Which of these functions would you use, and why?", "What do the documents say about errors?"]
MATH = "A shop sells {a} pencils for {b} dollars. How much do {c} pencils cost? Think step by step, then give the answer."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "parameters": {"type": "array", "items": {
    "type": "string"}}, "summary": {"type": "string"}}, "required": ["name", "parameters", "summary"],
    "additionalProperties": False}  # fmt: skip


def _functions() -> list[tuple[str, Callable]]:
    """Small, documented standard-library functions, in a fixed order."""
    import base64
    import fnmatch
    import posixpath
    import shlex
    import shutil

    out = []
    for module in (textwrap, shlex, fnmatch, posixpath, json, base64, shutil):
        for name, f in sorted(inspect.getmembers(module, inspect.isfunction)):
            if not name.startswith("_") and f.__module__ == module.__name__ and f.__doc__:
                try:
                    source = inspect.getsource(f)
                except OSError:  # defined where no source is kept
                    continue
                if 200 < len(source) < 2500:
                    out.append((f"{module.__name__}.{name}", f))
    if not out:
        raise SpecDecodeError("this Python keeps no standard-library sources to build prompts from; use --prompts")
    return out


def _docs() -> list[tuple[str, str]]:
    """(name, documentation) of standard-library modules, long enough to summarise."""
    import argparse
    import ast
    import copy
    import csv
    import difflib
    import heapq
    import pickle
    import tempfile
    import tokenize
    import zipfile

    modules = (difflib, heapq, argparse, csv, pickle, zipfile, copy, tokenize, ast, tempfile)
    return [(m.__name__, inspect.getdoc(m)[:2400]) for m in modules]


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def chat(n: int) -> list[BenchPrompt]:
    return [BenchPrompt("chat", _user(CHAT[i % len(CHAT)])) for i in range(n)]


def code(n: int) -> list[BenchPrompt]:
    fs = _functions()
    return [BenchPrompt("code", _user("Add type hints to this function and return the whole function:\n\n```python\n"
                                      f"{textwrap.dedent(inspect.getsource(fs[i % len(fs)][1]))}```"))
            for i in range(n)]  # fmt: skip


def summarization(n: int) -> list[BenchPrompt]:
    docs = _docs()
    return [BenchPrompt("summarization", _user(f"Summarize this documentation in three sentences:\n\n{docs[i % len(docs)][1]}"))
            for i in range(n)]  # fmt: skip


def qa(n: int) -> list[BenchPrompt]:
    fs = _functions()[::-1]
    return [BenchPrompt("qa", _user(f"{inspect.getdoc(f)}\n\nQuestion: according to this text, what does "
                                    f"{name.split('.')[-1]} do and what does it return?"))
            for name, f in (fs[i % len(fs)] for i in range(n))]  # fmt: skip


def math(n: int) -> list[BenchPrompt]:
    return [BenchPrompt("math", _user(MATH.format(a=3 + i, b=2 + 2 * i, c=7 + 5 * i))) for i in range(n)]


def rag(n: int) -> list[BenchPrompt]:
    fs = _functions()
    out = []
    for i in range(n):
        picked = [fs[(2 * i + k) % len(fs)] for k in range(3)]
        context = "\n\n".join(f"[{k + 1}] {name}: {inspect.getdoc(f)}" for k, (name, f) in enumerate(picked))
        out.append(BenchPrompt("rag", _user(f"Answer using only these documents.\n\n{context}\n\nQuestion: "
                                            f"{RAG_QUESTIONS[i % len(RAG_QUESTIONS)]}")))  # fmt: skip
    return out


def translation(n: int) -> list[BenchPrompt]:
    sentences = [inspect.getdoc(f).split("\n\n")[0].replace("\n", " ")[:300] for _, f in _functions()]
    return [BenchPrompt("translation", _user(f"Translate into French: {sentences[i % len(sentences)]}"))
            for i in range(n)]  # fmt: skip


def structured(n: int) -> list[BenchPrompt]:
    fs = _functions()[1::2]
    return [BenchPrompt("structured", _user(f"Extract the function's name, its parameters and a one-line summary "
                                            f"as JSON:\n\n{name}{inspect.signature(f)}\n{inspect.getdoc(f)}"),
                        StructuredOutput("json", SCHEMA))
            for name, f in (fs[i % len(fs)] for i in range(n))]  # fmt: skip


CATEGORIES: dict[str, Callable[[int], list[BenchPrompt]]] = {
    "chat": chat, "code": code, "summarization": summarization, "qa": qa, "math": math, "rag": rag,
    "translation": translation, "structured": structured,
}  # fmt: skip


def build_prompts(categories: list[str], per_category: int) -> list[BenchPrompt]:
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        raise SpecDecodeError(f"unknown category {unknown[0]!r}; valid: {', '.join(CATEGORIES)}")
    return [p for c in categories for p in CATEGORIES[c](per_category)]


def read_prompts_file(path: str) -> list[BenchPrompt]:
    """One JSON object per line: an OpenAI chat request ``{"messages": [...]}`` or a raw
    ``{"prompt": "..."}``, with an optional ``"category"`` (default "prompts"); or one JSON
    object of categories, each a list of user messages (``{"chat": ["...", ...], ...}``).
    Shared by `specdecode bench`, `tune` and `audit`."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecDecodeError(f"cannot read --prompts {path!r}: {getattr(e, 'strerror', None) or e}") from None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict) and whole and all(
        isinstance(v, list) and all(isinstance(t, str) for t in v) for v in whole.values()
    ):  # fmt: skip
        return [BenchPrompt(str(category), _user(t)) for category, texts in whole.items() for t in texts]
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"--prompts {path!r} line {i} is not JSON: {e.msg}") from None
        record = record if isinstance(record, dict) else {}
        messages, text = record.get("messages"), record.get("prompt")
        chat = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
        )  # fmt: skip
        if not chat and not isinstance(text, str):
            raise SpecDecodeError(f'--prompts {path!r} line {i}: needs "messages" (a list of {{role, content}} '
                                  'strings) or "prompt" (a string)')  # fmt: skip
        category = str(record.get("category", "prompts"))
        out.append(BenchPrompt(category, messages) if chat else BenchPrompt(category, [], text=text))
    if not out:
        raise SpecDecodeError(f"--prompts {path!r} holds no prompts")
    return out
