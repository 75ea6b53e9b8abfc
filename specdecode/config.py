"""User-facing settings, validated at the edge: sampling and speculation configs.

Owns: the frozen dataclasses `SamplingParams` and `SpecConfig` (and `SamplingParams`'
validation), the budget options every method shares, and the one error type for bad input
(`SpecDecodeError`). Everything past the edge may assume its inputs are valid.
Does not own: which drafting methods exist, nor parsing a speculative config into one
(drafters/registry.py `parse_spec`, which reads each drafter's own `Options` dataclass).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

AUTO_MAX_SPECULATIVE_TOKENS = 8  # "auto": the most draft tokens a step may choose (unless a method's default is more)
MAX_SPECULATIVE_TOKENS = 32


class SpecDecodeError(ValueError):
    """Bad input. Its message is one line that names the problem."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, for a one-line error (its type's name if empty);
    a first line that only introduces the next ("Validation error for field 'x':") gets it too."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (vLLM's _SAMPLING_EPS)


def is_int(x: object) -> bool:
    """An int that is not a bool (True is an int in Python, and never means a count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _token_key(k: object) -> object:
    """A logit_bias key: an int, or a string of digits (JSON keys are strings)."""
    return int(k) if isinstance(k, str) and k.isdigit() and len(k) < 20 else k


def is_real(x: object) -> bool:
    """An int or float (not a bool) that converts to a float: 10**400 does not."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's text (vLLM's ``structured_outputs``): ``kind`` "json" (``spec``
    a JSON schema, as text or a dict), "json_object" (any JSON object), "regex", "choice" (``spec``
    a list of strings: exactly one of them) or "grammar" (Lark, or GBNF / EBNF with ``::=``).
    Whether it compiles is checked where the tokenizer is known (structured.py)."""

    kind: str
    spec: Any = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise SpecDecodeError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        spec = self.spec
        if self.kind == "json":
            if isinstance(spec, Mapping):
                spec = json.dumps(spec, sort_keys=True)
            if not isinstance(spec, str):
                raise SpecDecodeError("a json structured output needs a JSON schema (an object or its text)")
        elif self.kind == "choice":
            if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise SpecDecodeError("a choice structured output needs a non-empty list of non-empty strings")
            spec = tuple(spec)
        elif self.kind in ("regex", "grammar") and (not isinstance(spec, str) or not spec):
            raise SpecDecodeError(f"a {self.kind} structured output needs its {self.kind} as a non-empty string")
        object.__setattr__(self, "spec", spec if self.kind != "json_object" else None)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens from the target's distribution p (and the draft's q alike).

    ``temperature == 0`` is greedy, and so is a temperature below `GREEDY_BELOW` (1e-5, as in
    vLLM): dividing logits by it would overflow to inf and give NaN probabilities. ``top_k <= 0``
    and ``top_p == 1`` disable those filters. ``seed`` drives a per-request ``torch.Generator``;
    ``None`` draws one at random. ``stop`` strings end generation and are not included in the text.

    The rest as in vLLM (names, ranges and order of application; logits_process.py):
    ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] subtract per output token (once, or
    per occurrence); ``repetition_penalty`` > 0 divides a positive logit (multiplies a negative
    one) of every token in the prompt or output; ``logit_bias`` {token id: [-100, 100]} adds;
    ``min_p`` in [0, 1] drops tokens below min_p times the likeliest one's probability;
    ``min_tokens`` holds EOS and ``stop_token_ids`` back until that many tokens are out;
    ``stop_token_ids`` end generation like EOS; ``bad_words`` are never completed;
    ``allowed_token_ids`` are the only tokens that may be sampled. ``n`` independent samples of
    the prompt (sample i > 0 seeded from ``seed`` and i). ``logprobs`` k >= 0 returns each
    output token's log-probability and the k likeliest alternatives (``prompt_logprobs`` k:
    each prompt token's, the model's own, None for the first; ``logprobs_mode``:
    "raw_logprobs", the model's own distribution, as vLLM's default; "processed_logprobs",
    after penalties, bias, masks, temperature and filters). ``structured`` constrains the
    output to a JSON schema, regex, choice or grammar (`StructuredOutput`); the text it ends
    ends the output.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a dict {token id: bias} is accepted and stored sorted
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw_logprobs"
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # None is vLLM's default value
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise SpecDecodeError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if not is_real(self.temperature) or not math.isfinite(self.temperature):
            raise SpecDecodeError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise SpecDecodeError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise SpecDecodeError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise SpecDecodeError(f"top_k must be an integer: -1 or 0 (off) or >= 1, got {self.top_k!r}")
        if self.top_k >= 2**31:  # more than any vocabulary: off (as a value past int64 could not be a tensor)
            object.__setattr__(self, "top_k", 0)
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise SpecDecodeError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise SpecDecodeError(f"seed must be a 64-bit integer (in [-2**63, 2**63)), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SpecDecodeError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        self._check_processing()

    def _check_processing(self) -> None:
        if not is_int(self.n) or self.n < 1:
            raise SpecDecodeError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_real(v) or not -2.0 <= v <= 2.0:
                raise SpecDecodeError(f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not is_real(rp) or not 0 < rp < math.inf:
            raise SpecDecodeError(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise SpecDecodeError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        bias = self.logit_bias
        if bias is None:
            bias = ()
        if isinstance(bias, Mapping):
            # JSON object keys are strings ("50256": 5, as OpenAI's clients send them)
            bias = tuple((_token_key(k), v) for k, v in bias.items())
        if not isinstance(bias, (list, tuple)) or not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in bias):
            raise SpecDecodeError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        for t, v in bias:
            if not is_int(t) or t < 0:
                raise SpecDecodeError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if not is_real(v) or not -100.0 <= v <= 100.0:
                raise SpecDecodeError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {t}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in bias)))
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise SpecDecodeError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise SpecDecodeError(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is None and name == "allowed_token_ids":
                continue
            ids = () if ids is None else ids
            if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
                raise SpecDecodeError(f"{name} must be a list of token ids (integers >= 0), got {getattr(self, name)!r}")
            if name == "allowed_token_ids" and not ids:
                raise SpecDecodeError("allowed_token_ids must not be empty (null allows every token)")
            object.__setattr__(self, name, tuple(ids))
        words = () if self.bad_words is None else (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise SpecDecodeError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(words))
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or k < 0):
                raise SpecDecodeError(f"{name} must be an integer >= 0 (the alternatives to return) or null, got {k!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise SpecDecodeError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise SpecDecodeError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether p depends on more than temperature / top-k / top-p (logits_process.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words
                    or self.allowed_token_ids is not None or self.structured is not None)  # fmt: skip

    def sample_seed(self, i: int) -> int | None:
        """Sample i's seed among ``n``: the request's own for the first, a distinct 64-bit mix of
        it and i for the rest (a request with n = 1 and that seed gives sample 0)."""
        if self.seed is None or i == 0:
            return self.seed
        x = (self.seed + i * 0x9E3779B97F4A7C15) % 2**64  # splitmix64's finaliser: neighbours land far apart
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
        x ^= x >> 31
        return x - 2**64 if x >= 2**63 else x

    def visible_text(self, text: str, finished: bool = True) -> str:
        """What of a request's decoded ``text`` may be shown: up to its first stop string (not
        included, as in vLLM). While it runs, also without what a later token may change: a
        trailing run of U+FFFD (an unfinished UTF-8 character; byte-fallback tokenizers such as
        Gemma's decode each of its bytes to one) and a tail that may begin a stop string."""
        cuts = [text.index(s) for s in self.stop if s in text]
        if cuts:
            text = text[: min(cuts)]
        if finished:
            return text
        text = text.rstrip("\ufffd")
        held = 0  # the longest tail that begins a stop string; longest first, never past the text's length
        for s in self.stop:  # (every k up to len(s) would make a long stop string cost its length squared per event)
            held = next((k for k in range(min(len(s) - 1, len(text)), held, -1) if text.endswith(s[:k])), held)
        return text[: len(text) - held]


@dataclass(frozen=True)
class BudgetOptions:
    """``speculative_config`` keys: ``verify_budget`` "fixed" (γ per request, the default) or
    "adaptive"; ``max_verify_tokens`` bounds the positions one step verifies (B rows + drafts,
    split evenly; a tree row's share is a depth, however wide its levels, and lookahead's
    Jacobi branch is not counted);
    ``throughput_floor`` (adaptive only, in (0, 1], default 1): the share of the throughput
    optimum's predicted throughput the budgets keep (1: plan for throughput alone); below 1
    they trade throughput for per-user speed."""

    verify_budget: str = "fixed"
    max_verify_tokens: int | None = None
    throughput_floor: float = 1.0

    def __post_init__(self) -> None:
        if self.verify_budget not in ("fixed", "adaptive"):
            raise SpecDecodeError(f"verify_budget must be \"fixed\" or \"adaptive\", got {self.verify_budget!r}")
        m = self.max_verify_tokens
        if m is not None and (not is_int(m) or m < 1):
            raise SpecDecodeError(f"max_verify_tokens must be a positive integer, got {m!r}")
        f = self.throughput_floor
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1:
            raise SpecDecodeError(f"throughput_floor must be a number in (0, 1], got {f!r}")

    @property
    def adaptive(self) -> bool:
        """Whether the engine plans each request's drafts (and learned drafters report confidences)."""
        return self.verify_budget == "adaptive"

    @staticmethod
    def pop_from(raw: dict[str, Any]) -> "BudgetOptions":
        """Take the budget keys out of a raw speculative_config dict."""
        keys = ("verify_budget", "max_verify_tokens", "throughput_floor")
        return BudgetOptions(**{k: raw.pop(k) for k in keys if k in raw})


@dataclass(frozen=True)
class SpecConfig:
    """What vLLM calls ``speculative_config``: a method, γ, and the method's own options.

    ``options`` is the drafter's own frozen ``Options`` dataclass, so unknown keys are
    rejected where they are parsed and each method documents its keys in one place.
    """

    method: str
    num_speculative_tokens: int
    options: Any = field(default=None)
    budget: BudgetOptions = field(default_factory=BudgetOptions)  # serving: per-step verification budgets

    def to_dict(self) -> dict[str, Any]:
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.options is not None:
            out.update(dataclasses.asdict(self.options))
        out.update(dataclasses.asdict(self.budget))
        return out


@dataclass(frozen=True)
class AutoSpec:
    """``speculative_config`` "auto" (the default): the method is chosen when the target is
    loaded, from what it has (drafters/auto.py). ``model``: a draft model folder to use."""

    model: str | None = None

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise SpecDecodeError(f"auto's model must be a draft model folder, got {self.model!r}")


def parse_options(options_cls: type, raw: Mapping[str, Any], owner: str) -> Any:
    """Build a frozen options dataclass from a dict, rejecting unknown keys by name."""
    names = [f.name for f in dataclasses.fields(options_cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        budget_keys = [f.name for f in dataclasses.fields(BudgetOptions)]
        valid = ", ".join(["method", "num_speculative_tokens", *names, *budget_keys])
        raise SpecDecodeError(f"unknown key(s) {', '.join(unknown)} for {owner}; valid keys: {valid}")
    try:
        return options_cls(**raw)
    except TypeError as e:  # e.g. a wrong type caught by the dataclass itself
        raise SpecDecodeError(f"bad options for {owner}: {e}") from None
