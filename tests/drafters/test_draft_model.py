"""`draft_model`'s chain: the q it reports is the distribution it samples each draft from,
with the request's temperature, top-k and top-p, computed by the draft model on the row's
context (the verifier's exactness rests on it; a q without top-p passed every end-to-end test)."""

from __future__ import annotations

import torch

from specdecode.config import SamplingParams
from specdecode.drafters.registry import parse_spec
from specdecode.drafters.base import DrafterContext
from specdecode.drafters.registry import create_drafter
from specdecode.core.batch import Batch
from specdecode.model.loader import load_model
from specdecode.core.sampling import logits_to_probs
from tests.tiny import make_tiny_checkpoint


def test_reported_q_is_the_filtered_draft_distribution(tmp_path):
    path = str(make_tiny_checkpoint(tmp_path / "m", "llama", seed=0))
    loaded = load_model(path, dtype="float32", device="cpu")
    spec = parse_spec({"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    drafter = create_drafter(spec, DrafterContext(target=loaded, dtype=torch.float32, device=torch.device("cpu")))
    params = [SamplingParams(temperature=0.9, top_p=0.7, seed=1),
              SamplingParams(temperature=1.2, top_k=4, top_p=0.9, seed=2),
              SamplingParams(temperature=0.7, top_k=3, seed=3)]  # fmt: skip
    prompts = [[5, 9, 3, 7], [7, 1, 2, 8, 4, 4, 6], [11, 12]]
    batch = Batch([Batch.new_sequence(i, p, sp, "cpu") for i, (p, sp) in enumerate(zip(prompts, params))],
                  capacity=64, device=torch.device("cpu"))  # fmt: skip
    drafter.prefill(batch, [0, 1, 2])
    draft = drafter.propose(batch, 2)
    assert draft.q is not None and draft.q.shape[:2] == (3, 2)
    model = loaded.model
    for b, prompt in enumerate(prompts):
        context = list(prompt)
        for k in range(2):
            cache = model.new_cache(1, len(context))
            logits = model(torch.tensor([context]), torch.arange(len(context))[None], cache)[:, -1:]  # [1, 1, V]
            want = logits_to_probs(logits, batch.temperature[b : b + 1], batch.top_k[b : b + 1], batch.top_p[b : b + 1])
            torch.testing.assert_close(draft.q[b, k], want[0, 0], atol=1e-5, rtol=1e-4)
            token = int(draft.tokens[b, k])
            assert draft.q[b, k, token] > 0  # drawn from its q's support
            context.append(token)
    filtered = (draft.q > 0).sum(-1)  # top-k / top-p cut the support: the filters are in q
    assert (filtered < model.config.vocab_size).all()
