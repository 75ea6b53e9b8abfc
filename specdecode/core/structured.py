"""Structured output: a grammar's token masks, along the committed output and along drafts.

Owns: compiling a `StructuredOutput` (JSON schema, JSON object, regex, choice, Lark or GBNF
grammar) with llguidance, a maintained grammar engine, into one request's `Grammar`; the
allowed tokens after the committed output plus any draft prefix (`Grammar.mask`, the
matcher advanced along the prefix and rolled back); how many draft tokens it allows
(`Grammar.allows`), so that a deterministic draft is cut where it leaves the grammar.
Does not own: where masks apply among the other processing (logits_process.py), or
when the engine advances a request's grammar (engine/step.py).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import torch

from specdecode.config import SpecDecodeError, StructuredOutput, first_line

_TOKENIZERS: dict[tuple, tuple[Any, Any]] = {}  # (id(tokenizer), vocab, eos) -> (tokenizer, llguidance's)


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of a Hugging Face tokenizer (slow to build: once per tokenizer)."""
    import llguidance
    import llguidance.hf

    key = (id(tokenizer), vocab_size, tuple(eos_ids))
    if key not in _TOKENIZERS:  # the tokenizer is kept with it, so its id is not reused
        try:  # byte-level BPE and SentencePiece-style decoders: each token's exact bytes
            ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
        except ValueError:  # other decoders (a character-level one): each token's text
            ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTexts(tokenizer, vocab_size, eos_ids)))
        _TOKENIZERS[key] = (tokenizer, ll)
    return _TOKENIZERS[key][1]


class _TokenTexts:
    """A tokenizer as llguidance's generic wrapper reads it: every token's bytes, specials apart."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        specials = set(tokenizer.all_special_ids)
        self.tokens = [b"" if i in specials or i >= len(tokenizer) else tokenizer.decode([i]).encode("utf-8")
                       for i in range(vocab_size)]  # fmt: skip
        self.special_token_ids = sorted(i for i in specials if i < vocab_size)
        self.eos_token_id = list(eos_ids)[0] if eos_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of a structured output."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if so.kind == "json":
        return LLMatcher.grammar_from_json_schema(so.spec)
    if so.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
    if so.kind == "regex":
        return LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":  # Lark string literals take JSON's escapes
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.spec))
    lark = gbnf_to_lark(so.spec) if "::=" in so.spec else so.spec
    return LLMatcher.grammar_from_lark(lark)


class Grammar:
    """One request's matcher, in step with its committed output."""

    def __init__(self, so: StructuredOutput, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        from llguidance import LLMatcher

        ll = _ll_tokenizer(tokenizer, vocab_size, eos_ids)
        try:
            text = grammar_text(so)
        except Exception as e:  # llguidance's parsers raise on malformed input
            raise SpecDecodeError(f"structured output: invalid {so.kind}: {first_line(e)}") from None
        self.matcher = LLMatcher(ll, text)
        if self.matcher.is_error():
            raise SpecDecodeError(f"structured output: invalid {so.kind}: {first_line(self.matcher.get_error())}")
        self.vocab_size = vocab_size
        if not self._bits().any():
            raise SpecDecodeError(f"structured output: the {so.kind} allows no output")

    def _bits(self) -> np.ndarray:
        """[V] uint8: 1 where a token may come next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size]

    def mask(self, prefix: Sequence[int]) -> torch.Tensor | None:
        """[V] bool: the tokens allowed after the committed output and ``prefix``; None where the
        prefix itself leaves the grammar (a position verification never reaches)."""
        n = self.matcher.try_consume_tokens(list(prefix)) if prefix else 0
        try:
            return torch.from_numpy(self._bits().astype(bool)) if n == len(prefix) else None
        finally:
            if n:
                self.matcher.rollback(n)

    def allows(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar allows after the committed output."""
        n = self.matcher.try_consume_tokens(list(tokens)) if tokens else 0
        if n:
            self.matcher.rollback(n)
        return n

    def advance(self, token: int) -> None:
        """Commit a token (one the grammar refuses, such as EOS past its end, changes nothing)."""
        self.matcher.try_consume_tokens([token])

    @property
    def done(self) -> bool:
        """The grammar has ended: nothing may follow (its EOS included)."""
        return self.matcher.is_stopped()
