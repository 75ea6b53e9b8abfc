"""``auto``, the default speculative configuration: a method chosen from what the target has.

Owns: `resolve_auto` (the configuration "auto" stands for on a loaded target, and a line
saying why). The rules, the first that applies:

1. a draft model given (``{"method": "auto", "model": FOLDER}``): `draft_model` with it;
2. on CUDA, EAGLE weights shipped for the target (specdecode/weights): `eagle`, one model
   step per round, with prompt lookup and the target's shipped datastore (where one ships):
   there a target pass costs far more than the head's;
3. otherwise `ngram` prompt lookup. On a CPU a small target's pass costs little more than
   the EAGLE head's, whose feature bookkeeping is paid every step, so the head loses where
   nothing repeats (`specdecode bench` by category: the results page), while prompt lookup
   costs next to nothing when it finds no copy.

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


def resolve_auto(auto: AutoSpec, target: LoadedModel, learned: bool | None = None) -> tuple[SpecConfig, str]:
    """The configuration ``auto`` stands for on ``target``, and why (one line). ``learned``:
    whether a shipped learned drafter may be chosen (None: where the target runs on CUDA)."""
    if learned is None:
        learned = target.model.embed.weight.device.type == "cuda"
    if auto.model is not None:
        raw, why = {"method": "draft_model", "model": auto.model}, "a draft model was given"
    elif learned and shipped_folder("eagle", target) is not None:
        store = shipped_folder("datastore", target) is not None
        raw = {"method": "eagle", "num_steps": 1, **LOOKUP, **({"datastore": True} if store else {})}
        why = "EAGLE weights ship for this model; with prompt lookup" + (" and the shipped datastore" if store else "")
    else:
        raw = {"method": "ngram"}
        why = "prompt lookup: " + ("on CPU the learned drafter costs more than it saves" if shipped_folder(
            "eagle", target) is not None else "no learned drafter ships for this model")  # fmt: skip
    spec = parse_spec({**raw, "num_speculative_tokens": "auto"})
    return spec, f"auto: {spec.method} ({why}), adaptive budget up to {spec.num_speculative_tokens} draft tokens"
