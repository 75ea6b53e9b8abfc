"""`mtp`: DeepSeek-V3-style multi-token prediction. One module takes the target's last
hidden state of token t and the embedding of token t+1, both RMS-normed and projected
together, runs one decoder layer and predicts token t+2 through the target's LM head.
γ = 1 by default; with γ > 1 the module is chained on its own outputs. Trained with
cross-entropy only. Drafting is `eagle`'s (eagle.py); only the net differs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.eagle_net import FeatureConfig, FeatureNet


@dataclass(frozen=True)
class MtpConfig(FeatureConfig):
    norm_inputs: bool = True
    feature_loss: float = 0.0


class MtpNet(FeatureNet):
    Config: ClassVar[type] = MtpConfig
    method: ClassVar[str] = "mtp"


class MtpDrafter(EagleDrafter):
    Net: ClassVar[type[FeatureNet]] = MtpNet
    default_num_speculative_tokens: ClassVar[int] = 1
