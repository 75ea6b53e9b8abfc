"""One round, step by step, with a scripted drafter: what is accepted, what is emitted, what
the drafter is told and what the target's cache keeps."""

from __future__ import annotations

import pytest
import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters.base import Draft
from specdecode.engine.serving import ServingEngine
from specdecode.model.loader import load_model
from tests.engine.checks import serve_all
from tests.tiny import make_tiny_checkpoint

PROMPT = [3, 9, 4, 1, 7]


class Scripted:
    """Proposes the target's own next tokens for ``good`` positions, then a wrong one."""

    hidden_layers = ()

    def __init__(self, truth: list[int], good: int) -> None:
        self.truth, self.good, self.told = truth, good, []

    def max_draft_tokens(self, num_tokens: int) -> int:
        return num_tokens

    def prefill(self, batch, rows, hidden=None) -> None:
        pass

    def propose(self, batch, num_tokens: int) -> Draft:
        done = len(batch.seqs[0].token_ids) - len(PROMPT)  # tokens generated so far
        right = self.truth[done : done + self.good]
        wrong = [(self.truth[done + len(right)] + 1) % 64] if done + len(right) < len(self.truth) else []
        chain = (right + wrong)[:num_tokens]
        return Draft(tokens=torch.tensor([chain + [-1] * (num_tokens - len(chain))]))

    def on_verified(self, batch, num_accepted, aux_logits=None, hidden=None) -> None:
        self.told.append(int(num_accepted[0]))

    def select_rows(self, rows) -> None:
        pass


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("step") / "m", "llama", seed=0, vocab_size=64)
    return load_model(str(path), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def truth(target):
    plain = ServingEngine(target, None, max_model_len=64)
    return serve_all(plain, [PROMPT], [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])[0]


@pytest.mark.parametrize("good", [0, 2, 4])
def test_a_round_accepts_the_right_prefix_then_emits_the_targets_token(target, truth, good):
    drafter = Scripted(truth, good)
    engine = ServingEngine(target, SpecConfig("scripted", 4), max_model_len=64, drafter=drafter)
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    first = engine.step()  # prefill: the first token, then the first round
    assert [t for e in first for t in e.new_token_ids] == truth[: 2 + min(good, 4)]
    assert drafter.told[0] == min(good, 4)  # accepted drafts: the right ones, up to the wrong one
    seq = engine.running["r"].seq
    assert engine.cache.seq_length("r") == len(seq.token_ids) - 1  # the newest token's K/V come next round
    rest = []
    while engine.has_unfinished():
        rest += [t for e in engine.step() for t in e.new_token_ids]
    assert truth[: 2 + min(good, 4)] + rest == truth  # every later round too
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks  # the finished request left no block
