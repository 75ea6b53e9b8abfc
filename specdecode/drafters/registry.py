"""The registry: the ONLY place where method names are matched, and where a speculative
config is parsed (`parse_spec`: the method's name, γ, the shared budget keys, then the
method's own `Options`).

A new drafting method costs one file (a class implementing `Drafter`) and one line here;
the conformance suite (tests/conformance) then tests it. Classes are imported lazily so that
`specdecode --help` and config validation stay fast.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.config import (
    AUTO_MAX_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS, AutoSpec, BudgetOptions, SpecConfig, SpecDecodeError, is_int,
    parse_options,
)  # fmt: skip

if TYPE_CHECKING:
    from specdecode.drafters.base import Drafter, DrafterContext

_METHODS: dict[str, str] = {
    "dflash": "specdecode.drafters.dflash:DFlashDrafter",
    "draft_model": "specdecode.drafters.draft_model:DraftModelDrafter",
    "eagle": "specdecode.drafters.eagle:EagleDrafter",
    "eagle3": "specdecode.drafters.eagle3:Eagle3Drafter",
    "layer_skip": "specdecode.drafters.layer_skip:LayerSkipDrafter",
    "lookahead": "specdecode.drafters.lookahead:LookaheadDrafter",
    "medusa": "specdecode.drafters.medusa:MedusaDrafter",
    "mtp": "specdecode.drafters.mtp:MtpDrafter",
    "ngram": "specdecode.drafters.ngram:NgramDrafter",
    "suffix": "specdecode.drafters.suffix:SuffixDrafter",
}


def method_names() -> list[str]:
    return sorted(_METHODS)


def drafter_class(method: object) -> type[Drafter]:
    if not isinstance(method, str) or method not in _METHODS:
        raise SpecDecodeError(f"unknown speculative method {method!r}; valid: {', '.join(method_names())}, or auto")
    module, name = _METHODS[method].split(":")
    return getattr(importlib.import_module(module), name)


def create_drafter(spec: SpecConfig, ctx: DrafterContext) -> Drafter:
    """The method's drafter; wrapped in lookup.py's `LookupDrafter` where its keys ask for prompt
    lookup or a datastore beside it."""
    drafter = drafter_class(spec.method)(spec, ctx)
    if not getattr(spec.options, "lookup_on", False):
        return drafter
    from specdecode.drafters.lookup import LookupDrafter

    lookup = spec.options.lookup(ctx.target)  # after the drafter's own checks: a datastore takes a second to load
    return LookupDrafter(drafter, lookup, spec.num_speculative_tokens, ctx.device)


def parse_spec(value: "str | Mapping[str, Any] | SpecConfig | AutoSpec | None") -> "SpecConfig | AutoSpec | None":
    """Parse a JSON string or dict as given on the CLI / API, or check a `SpecConfig`.
    ``None`` (or "none") means no speculation; "auto" (or ``{"method": "auto"}``, with an
    optional draft ``model``) an `AutoSpec`, resolved once the target is loaded (auto.py)."""
    if value is None or isinstance(value, AutoSpec):
        return value
    if isinstance(value, str) and value.strip().lower() in ("none", "auto"):
        return AutoSpec() if value.strip().lower() == "auto" else None
    if isinstance(value, SpecConfig):  # built by hand (it is exported): validated as its dict would be
        if value.options is not None and not dataclasses.is_dataclass(value.options):
            raise SpecDecodeError(
                "SpecConfig options must be the method's Options dataclass; or pass a dict to parse_spec"
            )
        value = value.to_dict()
    if isinstance(value, str) and value.startswith("@"):  # a file holding the JSON (what `specdecode tune` writes)
        try:
            value = Path(value[1:]).expanduser().read_text()
        except OSError as e:
            raise SpecDecodeError(f"cannot read the speculative config file {value[1:]!r}: {e.strerror or e}") from None
        if value.strip().lower() in ("none", "auto"):
            return parse_spec(value.strip())
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"speculative config is not valid JSON: {e.msg} at char {e.pos}") from None
    if not isinstance(value, Mapping):
        raise SpecDecodeError("speculative config must be a JSON object like {\"method\": \"ngram\"}")
    raw = dict(value)
    method = raw.pop("method", None)
    if method is None:
        raise SpecDecodeError(f"speculative config needs a \"method\"; valid: {', '.join(method_names())}, or auto")
    if method == "auto":
        if set(raw) - {"model"}:
            raise SpecDecodeError(f"unknown key(s) {', '.join(sorted(set(raw) - {'model'}))} for method 'auto'; "
                                  "valid keys: method, model (a draft model folder)")  # fmt: skip
        return AutoSpec(**raw)
    cls = drafter_class(method)  # raises with the valid names
    gamma = raw.pop("num_speculative_tokens", cls.default_num_speculative_tokens)
    fixed_given = raw.get("verify_budget") == "fixed"
    budget = BudgetOptions.pop_from(raw)
    if gamma == "auto":  # at most AUTO_MAX, each step's length chosen from the measured verify cost
        if fixed_given:
            raise SpecDecodeError(
                'num_speculative_tokens "auto" chooses γ with the adaptive budget; drop verify_budget "fixed"'
            )
        gamma = max(cls.default_num_speculative_tokens, AUTO_MAX_SPECULATIVE_TOKENS)
        budget = dataclasses.replace(budget, verify_budget="adaptive")
    if not is_int(gamma) or not 1 <= gamma <= MAX_SPECULATIVE_TOKENS:
        raise SpecDecodeError(
            f'num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] or "auto", got {gamma!r}'
        )
    options = parse_options(cls.Options, raw, f"method {method!r}")
    return SpecConfig(method=method, num_speculative_tokens=gamma, options=options, budget=budget)
