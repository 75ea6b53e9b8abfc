"""Per registered method: the tiny artifacts it needs and its configurations for the
conformance suite. Owns no assertion.

`method_specs` gives each method's default configuration (only what it cannot run without,
such as a drafter folder, is filled in) and, where the method drafts trees, a tree. A method
registered without a builder here fails `test_every_registered_method_has_a_builder` with
the one thing to add.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from specdecode.model.loader import load_model
from tests.tiny import early_exit_checkpoint

MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def _ngram(root: Path, target: str) -> dict[str, dict]:
    return {"default": {"method": "ngram"},
            "tree": {"method": "ngram", "max_matches": 4, "num_draft_tokens": 10}}  # fmt: skip


def _suffix(root: Path, target: str) -> dict[str, dict]:
    return {"default": {"method": "suffix"}}


def _lookahead(root: Path, target: str) -> dict[str, dict]:
    return {"default": {"method": "lookahead"}}


def _layer_skip(root: Path, target: str) -> dict[str, dict]:
    return {"default": {"method": "layer_skip"}, "tree": {"method": "layer_skip", "exit_layer": 2, "topk": 2}}


def _draft_model(root: Path, target: str) -> dict[str, dict]:
    draft = str(early_exit_checkpoint(target, root / "draft", 2))
    return {"default": {"method": "draft_model", "model": draft},
            "tree": {"method": "draft_model", "model": draft, "topk": 3, "num_draft_tokens": 9}}  # fmt: skip


def _feature_net(method: str) -> Callable[[Path, str], dict[str, dict]]:
    def build(root: Path, target: str) -> dict[str, dict]:
        from specdecode.drafters.eagle3 import Eagle3Net
        from specdecode.drafters.eagle_net import FeatureNet
        from specdecode.drafters.mtp import MtpNet
        from tests.learned import trained_folder

        cls = {"eagle": FeatureNet, "eagle3": Eagle3Net, "mtp": MtpNet}[method]
        model = load_model(target, dtype="float32", device="cpu", progress=False).model
        net = str(trained_folder(cls, model, root / method, draft_vocab=0))
        return {"default": {"method": method, "model": net},
                "tree": {"method": method, "model": net, "topk": 3, "num_draft_tokens": 8}}  # fmt: skip

    return build


def _medusa(root: Path, target: str) -> dict[str, dict]:
    from specdecode.drafters.learned import save_net
    from tests.drafters.test_medusa import random_medusa

    model = load_model(target, dtype="float32", device="cpu", progress=False).model
    net = str(save_net(random_medusa(model, seed=0), model, root / "medusa"))
    return {"default": {"method": "medusa", "model": net},
            "tree": {"method": "medusa", "model": net, "speculative_token_tree": MEDUSA_TREE}}  # fmt: skip


def _dflash(root: Path, target: str) -> dict[str, dict]:
    from tests.drafters.test_dflash import make_dflash

    # a block as long as the default num_speculative_tokens (16)
    return {"default": {"method": "dflash", "model": make_dflash(root / "dflash", target, seed=2, block_size=16)}}


BUILDERS: dict[str, Callable[[Path, str], dict[str, dict]]] = {
    "dflash": _dflash,
    "draft_model": _draft_model,
    "eagle": _feature_net("eagle"),
    "eagle3": _feature_net("eagle3"),
    "layer_skip": _layer_skip,
    "lookahead": _lookahead,
    "medusa": _medusa,
    "mtp": _feature_net("mtp"),
    "ngram": _ngram,
    "suffix": _suffix,
}


def method_specs(method: str, root: Path, target: str) -> dict[str, dict]:
    """``method``'s configurations for the target at ``target``, artifacts built under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    return BUILDERS[method](root, target)
