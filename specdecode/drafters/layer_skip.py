"""`layer_skip`: self-speculation by early exit (LayerSkip), the baseline every trained
drafter must beat. The draft is the target's own first ``exit_layer`` layers followed by
its final norm and LM head: no training and no extra weights (the modules are shared),
only a KV cache for those layers. Drafting, chains and trees are `draft_model`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from specdecode.config import SpecConfig, SpecDecodeError, is_int
from specdecode.drafters.base import DrafterContext
from specdecode.drafters.draft_model import DraftModelDrafter, DraftModelOptions
from specdecode.model.masks import FULL, SLIDING
from specdecode.model.transformer import Transformer


@dataclass(frozen=True)
class LayerSkipOptions(DraftModelOptions):
    exit_layer: int | None = None  # draft with the first n layers; None = a quarter of the target's depth

    def __post_init__(self) -> None:
        if self.model is not None:
            raise SpecDecodeError("layer_skip drafts with the target's own layers; it takes no \"model\"")
        n = self.exit_layer
        if n is not None and (not is_int(n) or n < 1):
            raise SpecDecodeError(f"exit_layer must be an integer >= 1, got {n!r}")
        self.check_shape()


class LayerSkipDrafter(DraftModelDrafter):
    Options: ClassVar[type] = LayerSkipOptions
    Net: ClassVar[None] = None  # nothing to train

    def draft_network(self, spec: SpecConfig, ctx: DrafterContext) -> Transformer:
        target = ctx.target.model
        if target.shard is not None:
            raise SpecDecodeError("layer_skip runs the target's first layers as its draft, and tensor parallelism "
                                  "splits them across processes: choose another method")  # fmt: skip
        L = target.config.num_layers
        n = spec.options.exit_layer or max(1, L // 4)
        if n >= L:
            raise SpecDecodeError(f"exit_layer must be below the target's {L} layers, got {n}")
        with torch.device("meta"):  # no weights of its own: every module is the target's
            early = Transformer(replace(target.config, num_layers=n, layer_types=target.config.layer_types[:n]))
        early.embed, early.norm, early.lm_head = target.embed, target.norm, target.lm_head
        early.layers = nn.ModuleList(target.layers[:n])
        for kind in (FULL, SLIDING):
            name = f"inv_freq_{kind}"
            early.register_buffer(name, getattr(target, name), persistent=False)
        early.use_cpu_blocks()
        return early
