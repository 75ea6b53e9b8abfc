"""`ngram`: prompt lookup decoding (model-free, deterministic: q is one-hot).

Finds the most recent earlier occurrence of the sequence's last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, longest first) in prompt + output,
and proposes the tokens that followed it. Costs a few vectorised numpy comparisons
per row and round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from specdecode.config import SpecConfig, SpecDecodeError
from specdecode.drafters.base import Draft, DrafterContext
from specdecode.engine.batch import Batch


@dataclass(frozen=True)
class NgramOptions:
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)) or not 1 <= lo <= hi:
            raise SpecDecodeError(
                f"ngram needs integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        # windows[i] = tokens[i : i + n]; the last window is the suffix itself, so skip it.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


class NgramDrafter:
    Options: ClassVar[type] = NgramOptions
    default_num_speculative_tokens: ClassVar[int] = 4

    def __init__(self, spec: SpecConfig, ctx: DrafterContext) -> None:
        self.options: NgramOptions = spec.options
        self.device = ctx.device

    def prefill(self, batch: Batch) -> None:
        pass  # stateless: every proposal is computed from the rows' tokens

    def propose(self, batch: Batch, num_tokens: int) -> Draft:
        out = np.full((len(batch), num_tokens), -1, dtype=np.int64)
        lo, hi = self.options.prompt_lookup_min, self.options.prompt_lookup_max
        for row, seq in enumerate(batch.seqs):
            found = lookup(np.asarray(seq.token_ids, dtype=np.int64), lo, hi, num_tokens)
            out[row, : len(found)] = found
        return Draft(tokens=torch.from_numpy(out).to(self.device), q=None)

    def on_verified(self, batch: Batch, num_accepted: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: list[int]) -> None:
        pass
