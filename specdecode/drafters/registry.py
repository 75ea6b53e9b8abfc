"""The registry: the ONLY place where method names are matched.

A new drafting method costs one file (a class implementing `Drafter`), one line here,
and one test file. Classes are imported lazily so that `specdecode --help` and config
validation stay fast.
"""

from __future__ import annotations

import importlib

from specdecode.config import SpecConfig, SpecDecodeError
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
        raise SpecDecodeError(f"unknown speculative method {method!r}; valid: {', '.join(method_names())}")
    module, name = _METHODS[method].split(":")
    return getattr(importlib.import_module(module), name)


def create_drafter(spec: SpecConfig, ctx: DrafterContext) -> Drafter:
    return drafter_class(spec.method)(spec, ctx)
