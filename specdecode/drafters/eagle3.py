"""`eagle3`: EAGLE-3, feature fusion of a low, a middle and a high target layer, trained
with training-time test (three unrolled draft steps, the drafter feeding on its own
outputs) and no feature regression. Drafting is `eagle`'s (eagle.py); only the net differs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.eagle_net import FeatureConfig, FeatureNet


@dataclass(frozen=True)
class Eagle3Config(FeatureConfig):
    feature_loss: float = 0.0
    train_steps: int = 3


class Eagle3Net(FeatureNet):
    Config: ClassVar[type] = Eagle3Config
    method: ClassVar[str] = "eagle3"

    @staticmethod
    def default_layers(num_layers: int) -> tuple[int, ...]:
        return (min(1, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))  # low, middle, high


class Eagle3Drafter(EagleDrafter):
    Net: ClassVar[type[FeatureNet]] = Eagle3Net
