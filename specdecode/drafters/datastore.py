"""A datastore of the target's own answers, looked up as REST does (retrieval drafts).

Owns: `Datastore` (documents of token ids in one array, a suffix array over it read
backwards, `match` for the longest suffix of a context that occurs in it, `chain` for the
most frequent continuation of those occurrences, and `draft`, the rule that makes them a
draft or none), its keys (`check_datastore_keys`, `open_datastore`), its folder on disk
(`save` / `load_datastore`: ``config.json`` with the target's fingerprint and its tokenizer's
digest + ``tokens.npy``)
and `build_datastore` from token documents.
Does not own: which rows draft from it (lookup.py beside a model drafter, ngram.py) or
making the records (train/regenerate.py, train/datastore.py).

The suffix array is over the *reversed* token array, so the occurrences of a context's last
n tokens are one range that narrows as n grows: the longest match costs one pass of
binary searches over shrinking ranges (cheap even at millions of tokens), not one search
per n. It is built when the folder is loaded (numpy sorts on the first MAX_MATCH tokens of
each suffix) rather than shipped: the tokens are 2 bytes each on disk, the order and its
first two columns would add 12. A draft is a deterministic function of the context and the
store (one-hot q), so a round that takes it stays lossless.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specdecode.config import SpecDecodeError, first_line, is_real

if TYPE_CHECKING:
    from specdecode.model.loader import LoadedModel

SENTINEL = -1  # ends every document: a match or a continuation never crosses it
METHOD, TOKENS_FILE, CONFIG_FILE = "datastore", "tokens.npy", "config.json"
MAX_OCCURRENCES = 4096  # a continuation is counted over at most ~this many occurrences (cost bound)
MAX_MATCH = 8  # the longest context suffix looked up
# a draft is at most this many tokens per matched one (suffix decoding's max_spec_factor): a short
# match is a weak guess at a long continuation, and each drafted token is a verified position
SPEC_FACTOR = 1
# datastore_min_prob's default: a lower bar drafts more continuations (more tokens per round when
# they hold) but verifies more that the target rejects, each a position paid for nothing
DEFAULT_MIN_PROB = 0.4
EVIDENCE = 100  # a datastore row's evidence (`Draft.evidence`) is 100 + its match length (prompt lookup's: the length)


def suffix_order(tokens: np.ndarray, depth: int = MAX_MATCH) -> np.ndarray:
    """Start positions of the suffixes of ``tokens`` (int, >= SENTINEL) sorted by their first
    ``depth`` tokens (a suffix that ends sorts before any that goes on), ties in position order.
    A match reads at most MAX_MATCH tokens, so no order past them is needed: the ``depth`` tokens
    are packed into 64-bit keys (16 bits a token for a vocabulary under 65,534) and sorted with
    one stable sort per key, least significant first (cheaper than full prefix
    doubling, which sorts to the end of every suffix)."""
    n = len(tokens)
    ranks = np.zeros(n + depth, dtype=np.uint64)  # 0: past the end
    ranks[:n] = np.asarray(tokens, dtype=np.int64) - SENTINEL + 1  # >= 1, in the tokens' order
    bits = max(int(ranks.max()).bit_length(), 1)
    per_key = 64 // bits
    keys = []
    for first in range(0, depth, per_key):
        key = np.zeros(n, dtype=np.uint64)
        for j in range(first, min(first + per_key, depth)):
            key = (key << np.uint64(bits)) | ranks[j : j + n]
        keys.append(key)
    order = np.arange(n)
    for key in reversed(keys):
        order = order[np.argsort(key[order], kind="stable")]
    return order


def _token_range(column: np.ndarray, token: int) -> tuple[int, int]:
    """[a, b): where ``token`` lies in the sorted int32 ``column`` (the values in its dtype: int64
    ones would make searchsorted copy the whole column to int64, many times the cost of a lookup)."""
    a, b = np.searchsorted(column, np.array([token, token + 1], dtype=column.dtype))
    return int(a), int(b)


class Datastore:
    """Documents of token ids, separated by SENTINEL, searchable by their suffixes."""

    def __init__(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or (tokens.size and tokens[-1] != SENTINEL) or (tokens < SENTINEL).any():
            raise SpecDecodeError("a datastore is a 1-D array of token ids >= 0 whose documents each end with -1")
        self.tokens = tokens = tokens.astype(np.int32)  # int32 throughout: half the memory of int64
        rev = np.append(tokens[::-1], np.int32(SENTINEL))  # read backwards, a match stops at its document's start
        order = suffix_order(rev).astype(np.int32)
        order = order[rev[order] != SENTINEL]  # a match never starts on a separator
        self._rev_order = order  # [M] suffixes of the reversed array, sorted
        # [M] their first and second tokens (sorted within a first token's range): the first two
        # binary searches, over the widest ranges, gather nothing
        self._columns = (rev[order], rev[np.minimum(order + 1, len(rev) - 1)])
        self._rev = rev

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def num_documents(self) -> int:
        return int((self.tokens == SENTINEL).sum())

    def match(self, context: Sequence[int], max_n: int) -> tuple[int, np.ndarray]:
        """(n, ends): the longest n <= ``max_n`` such that the last n tokens of ``context`` occur
        in the store, and where those occurrences end (positions in ``tokens``, at most
        MAX_OCCURRENCES of them); (0, []) if not even the last token occurs. ``max_n`` is at most
        MAX_MATCH: the suffixes are sorted on that many tokens only."""
        if max_n > MAX_MATCH:
            raise ValueError(f"a datastore matches at most {MAX_MATCH} tokens, asked for {max_n}")
        rev, order = self._rev, self._rev_order
        lo, hi = _token_range(self._columns[0], context[-1]) if len(context) else (0, 0)
        n = 1 if hi > lo else 0
        while hi > lo and n < min(max_n, len(context)):
            # [hi - lo]: the next token back of each occurrence, sorted
            col = self._columns[1][lo:hi] if n == 1 else rev[order[lo:hi] + n]
            a, b = _token_range(col, context[-1 - n])
            if b == a:
                break
            lo, hi, n = lo + a, lo + b, n + 1
        if n == 0:
            return 0, np.empty(0, dtype=np.int64)
        step = -(-(hi - lo) // MAX_OCCURRENCES)  # an even sample of a common match (suffix order is not random)
        ends = len(self.tokens) - 1 - order[lo:hi:step]  # reversed start -> forward end
        return n, ends

    def chain(self, ends: np.ndarray, depth: int, min_prob: float) -> tuple[list[int], list[float]]:
        """The most frequent continuation of the occurrences ending at ``ends``, up to ``depth``
        tokens, while the share of occurrences that continue with it stays >= ``min_prob``; and
        that share after each token (its estimated probability, non-increasing)."""
        tokens, total = self.tokens, max(len(ends), 1)
        at = ends + 1
        chain: list[int] = []
        probs: list[float] = []
        for _ in range(depth):
            if at.size == 1:  # one occurrence left: the rest of its document, while its share holds
                rest = tokens[at[0] : at[0] + depth - len(chain)].tolist()
                rest = rest[: rest.index(SENTINEL)] if SENTINEL in rest else rest
                keep = len(rest) if 1 / total >= min_prob else 0
                return chain + rest[:keep], probs + [1 / total] * keep
            nxt = tokens[at]  # the array ends with SENTINEL: at never runs past it
            values, counts = np.unique(nxt, return_counts=True)
            best = int(counts.argmax())
            if values[best] == SENTINEL or counts[best] / total < min_prob:
                break
            chain.append(int(values[best]))
            probs.append(float(counts[best]) / total)
            at = at[nxt == values[best]] + 1
        return chain, probs

    def draft(self, context: Sequence[int], depth: int, min_n: int, min_prob: float) -> tuple[list[int], int]:
        """(chain, n): the most frequent continuation of the longest suffix of ``context`` that
        occurs here, matched on n >= ``min_n`` tokens, at most min(``depth``, SPEC_FACTOR · n) long,
        where at least ``min_prob`` of the occurrences go on with its first token (as c /
        (occurrences + 1): one occurrence alone is a coin flip; later tokens are not gated, as
        prompt lookup's are not); ([], 0) where there is none."""
        if depth <= 0:
            return [], 0
        n, ends = self.match(context[-MAX_MATCH:], MAX_MATCH)
        if n < min_n:
            return [], 0
        chain, shares = self.chain(ends, min(depth, SPEC_FACTOR * n), 0.0)
        if not chain or shares[0] * len(ends) / (len(ends) + 1) < min_prob:
            return [], 0
        return chain, n

    def save(
        self, out_dir: str | Path, target_fingerprint: dict[str, Any], extra: dict[str, Any] | None = None,
        tokenizer: str | None = None,
    ) -> Path:  # fmt: skip
        """Write ``config.json`` (method, the target's fingerprint, its tokenizer's digest, sizes,
        ``extra``) and ``tokens.npy``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        vocab = int(target_fingerprint["vocab_size"])
        dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max else np.int32  # SENTINEL stored as the max value
        stored = np.where(self.tokens == SENTINEL, np.iinfo(dtype).max, self.tokens).astype(dtype)
        np.save(out / TOKENS_FILE, stored)
        meta = {"specdecode_method": METHOD, "target": target_fingerprint,
                **({"tokenizer": tokenizer} if tokenizer else {}), "tokens": len(self),
                "documents": self.num_documents, **(extra or {})}  # fmt: skip
        (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return out


def fill_rows(
    store: Datastore, contexts: Sequence[Sequence[int]], found: list[list[int]], evidence: list[int],
    depths: Sequence[int], min_n: int, min_prob: float,
) -> None:  # fmt: skip
    """Give each row that has no draft (``found[b] == []``) the store's `Datastore.draft` for its
    context, in place, with EVIDENCE + n as its evidence."""
    for b, (context, depth) in enumerate(zip(contexts, depths)):
        if not found[b]:
            found[b], n = store.draft(context, depth, min_n, min_prob)
            evidence[b] = EVIDENCE + n if n else 0


def check_datastore_keys(store: object, min_prob: object, min_n: int) -> None:
    """The ``datastore`` / ``datastore_min_prob`` keys (of the drafters that take them) and the
    shortest match ``min_n`` (``prompt_lookup_min``, validated already), in one line."""
    if store is not None and not (store is True or store is False or (isinstance(store, str) and store)):
        raise SpecDecodeError(f"datastore must be a folder path or true, got {store!r}")
    if not is_real(min_prob) or not math.isfinite(min_prob) or not 0 <= min_prob <= 1:
        raise SpecDecodeError(f"datastore_min_prob must be a number in [0, 1], got {min_prob!r}")
    if not store and min_prob != DEFAULT_MIN_PROB:  # a threshold for no datastore: a forgotten key, likely
        raise SpecDecodeError("datastore_min_prob needs datastore (true, or a folder)")
    if store and min_n > MAX_MATCH:
        raise SpecDecodeError(f"a datastore matches at most {MAX_MATCH} tokens: prompt_lookup_min must be <= "
                              f"{MAX_MATCH} with it, got {min_n}")  # fmt: skip


def tokenizer_digest(tokenizer: Any) -> str:
    """A short digest of a tokenizer's vocabulary (token -> id): a datastore holds token ids, which
    mean something only under the tokenizer it was built with (two targets may share every size)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def open_datastore(store: str | bool, target: LoadedModel) -> Datastore:
    """The datastore a ``datastore`` key names: a folder, or true for the one shipped for ``target``."""
    from specdecode.drafters.learned import shipped_folder, target_fingerprint

    folder = shipped_folder(METHOD, target) if store is True else store
    if not folder:
        raise SpecDecodeError(f'no datastore ships for {target.name}: give "datastore" a folder built by '
                              "`python -m specdecode.train.datastore`")  # fmt: skip
    return load_datastore(folder, target_fingerprint(target.model), target.tokenizer)


def load_datastore(path: str | Path, target_fingerprint: dict[str, Any], tokenizer: Any = None) -> Datastore:
    """The datastore in folder ``path``; a one-line error if it is not one or was built for another
    target, or for another tokenizer (where the folder records a digest and ``tokenizer`` is given:
    folders built before the digest was recorded, the shipped one among them, have none; the
    digest, which hashes the whole vocabulary, is then not computed)."""
    folder = Path(path)
    try:
        meta = json.loads((folder / CONFIG_FILE).read_text())
        stored = np.load(folder / TOKENS_FILE)
    except (OSError, ValueError) as e:
        raise SpecDecodeError(f"datastore {str(path)!r} is not a datastore folder: {first_line(e)}") from None
    if not isinstance(meta, dict) or meta.get("specdecode_method") != METHOD:
        raise SpecDecodeError(f"datastore {str(path)!r}: its config.json is not a datastore's")
    if meta.get("target") != target_fingerprint:
        raise SpecDecodeError(f"datastore {str(path)!r} was built for another target ({meta.get('target')}, "
                              f"this one is {target_fingerprint})")  # fmt: skip
    recorded = meta.get("tokenizer")
    if recorded is not None and tokenizer is not None and recorded != (digest := tokenizer_digest(tokenizer)):
        raise SpecDecodeError(f"datastore {str(path)!r} was built with another tokenizer (vocabulary digest "
                              f"{recorded}, this target's is {digest})")  # fmt: skip
    if stored.ndim != 1 or stored.dtype not in (np.uint16, np.int32):
        raise SpecDecodeError(f"datastore {str(path)!r}: {TOKENS_FILE} is not a 1-D uint16 / int32 array")
    tokens = stored.astype(np.int64)
    tokens[stored == np.iinfo(stored.dtype).max] = SENTINEL
    if tokens.size and (tokens[-1] != SENTINEL or tokens.max() >= int(target_fingerprint["vocab_size"])):
        raise SpecDecodeError(f"datastore {str(path)!r}: {TOKENS_FILE} holds ids outside the vocabulary "
                              "or does not end a document")  # fmt: skip
    return Datastore(tokens)


def build_datastore(documents: Iterable[Sequence[int]]) -> Datastore:
    """A datastore over ``documents`` (each a list of token ids; empty ones are skipped)."""
    parts = [np.append(np.asarray(d, dtype=np.int64), SENTINEL) for d in documents if len(d)]
    if not parts:
        raise SpecDecodeError("a datastore needs at least one non-empty document")
    return Datastore(np.concatenate(parts))
