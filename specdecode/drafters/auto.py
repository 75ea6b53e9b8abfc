"""``auto``, the default speculative configuration: a method chosen from what the target has.

Owns: `resolve_auto` (the configuration "auto" stands for on a loaded target, and a line
saying why). The rules, the first that applies:

1. a draft model given (``{"method": "auto", "model": FOLDER}``): `draft_model` with it;
2. EAGLE weights shipped for the target (specdecode/weights): `eagle`, one model step per
   round, with prompt lookup and the target's shipped datastore (where one ships): the
   learned head guesses free text, and copies take over wherever the output repeats the
   prompt or a known answer;
3. otherwise: `ngram` prompt lookup (with the shipped datastore, where one ships).

Each plans every step's drafts with the adaptive budget (γ "auto"): a request drafts only
as far as the measured verify cost says pays, so where nothing repeats it decodes plainly.
Does not own: the methods (their modules) or parsing (registry.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdecode.config import AutoSpec, SpecConfig
from specdecode.drafters.learned import shipped_folder
from specdecode.drafters.registry import parse_spec

if TYPE_CHECKING:
    from specdecode.model.loader import LoadedModel

LOOKUP = {"prompt_lookup_max": 5}  # vLLM's prompt-lookup default span


def resolve_auto(auto: AutoSpec, target: LoadedModel) -> tuple[SpecConfig, str]:
    """The configuration ``auto`` stands for on ``target``, and why (one line)."""
    store = shipped_folder("datastore", target) is not None
    copies = {**LOOKUP, "datastore": True} if store else dict(LOOKUP)
    with_store = " and the shipped datastore" if store else ""
    if auto.model is not None:
        raw, why = {"method": "draft_model", "model": auto.model}, "a draft model was given"
    elif shipped_folder("eagle", target) is not None:
        raw = {"method": "eagle", "num_steps": 1, **copies}
        why = f"EAGLE weights ship for this model; with prompt lookup{with_store}"
    else:
        raw = {"method": "ngram", **({"datastore": True} if store else {})}
        why = f"no learned drafter ships for this model: prompt lookup{with_store}"
    spec = parse_spec({**raw, "num_speculative_tokens": "auto"})
    return spec, f"auto: {spec.method} ({why}), adaptive budget up to {spec.num_speculative_tokens} draft tokens"
