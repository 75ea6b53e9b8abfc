"""The target's outputs for training (specdecode/train/target_outputs.py): the cached top-k form."""

from __future__ import annotations

from dataclasses import replace

import torch

from specdecode.drafters.learned import TrainBatch
from specdecode.model.loader import load_model
from specdecode.train import target_outputs


def test_top_k_batches_read_as_the_dense_logits_they_keep(tiny_target):
    """The cache keeps the target's top k logits (`target_top`, the head run in chunks); a batch
    holding only those reads as the dense batch with -inf outside them: the same probabilities
    at any token ids, the same greedy token, the same full logits."""
    target = load_model(tiny_target, dtype="float32", device="cpu", progress=False).model
    V = target.config.vocab_size
    tokens = torch.randint(4, V, (3, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 20, dtype=torch.bool)
    dense = target_outputs.target_batch(target, tokens, mask, (1,))
    for k in (V, 5):
        hidden, values, ids = target_outputs.target_top(target, tokens, (1,), k, chunk=7)  # chunks across rows
        assert torch.allclose(hidden, dense.hidden)
        kept = dense.logits.topk(k, dim=-1)
        assert torch.allclose(values, kept.values, atol=1e-5) and torch.equal(ids, kept.indices)
        cut = torch.full_like(dense.logits, float("-inf")).scatter_(-1, ids, values)
        ref = replace(dense, logits=cut)
        top = TrainBatch(tokens, hidden, None, mask, target, top=(values, ids.to(torch.int32)))
        some = torch.tensor([0, 3, 7, V - 1, 11])  # any ids, in any order
        assert torch.allclose(top.probs_at(some), ref.probs_at(some), atol=1e-6)
        assert torch.equal(top.argmax(), ref.argmax())
        assert torch.equal(top.full_logits(), cut)
