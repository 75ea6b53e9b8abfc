"""The draft-vocabulary head: sampling and tree growth over Vd equal the same over the full
vocabulary with -inf outside it (what the drafters did before), for every filter and row kind."""

from __future__ import annotations

import pytest
import torch

from specdecode.config import SamplingParams
from specdecode.drafters.draft_tree import grow_tree
from specdecode.drafters.draft_vocab import DraftVocabHead
from specdecode.core.batch import Batch, Sequence
from specdecode.model.loader import load_model
from specdecode.core.sampling import logits_to_probs
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("t") / "target", "llama", seed=0)
    return load_model(str(path), dtype=torch.float32, device="cpu").model


def head_over(model, ids: list[int]) -> DraftVocabHead:
    head = DraftVocabHead(model, len(ids))
    counts = torch.zeros(model.config.vocab_size)
    counts[ids] = torch.arange(len(ids), 0, -1, dtype=torch.float32)
    head.prepare(counts)
    return head


def full(head: DraftVocabHead, logits: torch.Tensor, V: int) -> torch.Tensor:
    """The drafters' former route: the draft logits on the whole vocabulary, -inf elsewhere."""
    out = logits.new_full((*logits.shape[:-1], V), float("-inf"))
    return out.scatter_(-1, head.vocab_ids.expand(*logits.shape[:-1], -1), logits)


def batch_of(params: list[SamplingParams]) -> Batch:
    seqs = [Sequence(i, [1, 2], 2, p, torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    return Batch(seqs, capacity=16, device=torch.device("cpu"))


@pytest.mark.parametrize("size", [40, None], ids=["Vd<V", "Vd=V"])
def test_sampling_over_the_draft_vocabulary_is_the_full_distribution(model, size):
    V = model.config.vocab_size
    ids = sorted(torch.randperm(V, generator=torch.Generator().manual_seed(1))[: size or V].tolist())
    head = head_over(model, ids)
    params = [
        SamplingParams(temperature=0.0),  # greedy rows in a sampled batch: one-hot at the argmax
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_k=len(ids) + 3),  # past the draft vocabulary: off
        SamplingParams(temperature=0.7, top_p=0.6),
        SamplingParams(temperature=1.3, top_k=9, top_p=0.9),
    ]
    batch = batch_of(params)
    logits = torch.randn(len(params), 3, len(ids), generator=torch.Generator().manual_seed(2))  # [B, T, Vd]
    logits[0, 1, :2] = logits[0, 1].max() + 1  # an argmax tie: the lower token id wins, as over V
    tokens, q = head.sample(logits, batch, V)
    want = logits_to_probs(full(head, logits, V), batch.temperature, batch.top_k, batch.top_p)
    assert q.shape == want.shape == (len(params), 3, V)
    torch.testing.assert_close(q, want, rtol=0, atol=1e-6)
    assert (q.gather(-1, tokens[..., None]) > 0).all()  # every draft token has its q
    assert tokens[0].tolist() == want[0].argmax(-1).tolist()
    again, _ = head.sample(logits, batch_of(params), V)
    assert torch.equal(again, tokens)  # seeded per row: reproducible


def test_a_tree_over_the_draft_vocabulary_is_the_tree_over_the_full_logits(model):
    V = model.config.vocab_size
    ids = sorted(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:30].tolist())
    head = head_over(model, ids)
    table = torch.randn(V, len(ids), generator=torch.Generator().manual_seed(4))  # next-token logits by token

    def score(tokens, depths, mask, at, parent_states=None):  # over Vd
        return table[tokens.gather(1, at)], None

    def score_full(*args):
        return full(head, score(*args)[0], V), None

    root = torch.randn(2, len(ids), generator=torch.Generator().manual_seed(5))
    small = grow_tree(score, root, [7, 9], depth=3, topk=3, budget=8, vocab_ids=head.vocab_ids).tree
    big = grow_tree(score_full, full(head, root, V), [7, 9], depth=3, topk=3, budget=8).tree
    assert torch.equal(small.tokens, big.tokens) and torch.equal(small.parents, big.parents)
    assert set(small.tokens[:, 1:][small.valid[:, 1:]].tolist()) <= set(ids)
    def score2(*args):  # a draft vocabulary of 2 tokens
        return score(*args)[0][..., :2], None

    few = grow_tree(score2, root[:, :2], [7, 9], depth=2, topk=4, budget=8, vocab_ids=head.vocab_ids[:2])
    assert few.tree.tokens.shape[1] >= 2  # topk beyond the draft vocabulary: fewer children, no error
