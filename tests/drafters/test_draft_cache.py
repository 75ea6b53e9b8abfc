"""A drafter's own paged cache (`DraftKVCache`): it grows on demand, gives back rejected
slots' and dropped rows' blocks, and its K/V equal a fresh prefill's through all of it."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters.draft_cache import DraftKVCache
from specdecode.model.loader import load_model
from tests.tiny import make_tiny_checkpoint

VOCAB = 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)
    return load_model(str(folder), dtype=torch.float32, device="cpu", progress=False).model


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, cache: DraftKVCache, rows: list[list[int]], keep: list[int]) -> torch.Tensor:
    """One padded pass over the batch writing ``rows[b]`` past each row's length; commits
    ``keep[b]`` of them (the rest are rolled back); returns logits [B, T, V]."""
    T = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    positions = cache.lengths[:, None] + torch.arange(T)
    logits = model(tokens, positions, cache)
    cache.commit(keep)
    return logits


def fresh_last_logits(model, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(tokens))
    return model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)[0, -1]


def test_grows_rolls_back_and_matches_fresh_prefill(model):
    cache = DraftKVCache(model, num_blocks=1, block_size=4)
    held: list[list[int]] = []  # each row's committed tokens

    def check_blocks() -> None:
        for sid, tokens in zip(cache.seq_ids, held):
            assert cache.seq_length(sid) == len(tokens)
            assert len(cache.block_table(sid)) == -(-len(tokens) // 4)  # nothing past the length

    prompts = [toks(5, 1), toks(9, 2)]
    with cache.only(cache.join_rows(2)):  # joining rows prefill alone
        run(model, cache, prompts, [5, 9])
    held += prompts
    assert cache.pool.num_blocks > 1  # it grew from one block
    check_blocks()

    drafts = [toks(3, 3), toks(3, 4)]  # a verify-like pass: row 0 keeps 1, row 1 all 3
    run(model, cache, drafts, [1, 3])
    held[0] += drafts[0][:1]
    held[1] += drafts[1]
    check_blocks()

    late = toks(6, 5)
    with cache.only(cache.join_rows(1)):  # a row joins while the others hold their K/V
        run(model, cache, [late], [6])
    held.append(late)
    assert cache.batch_size == 3
    cache.truncate([len(held[0]), len(held[1]) - 2, len(held[2])])  # row 1 rolls back 2
    held[1] = held[1][:-2]
    check_blocks()

    cache.select_rows([0, 2])  # row 1 leaves: its blocks go back
    held = [held[0], held[2]]
    check_blocks()
    used = sum(len(cache.block_table(s)) for s in cache.seq_ids)
    assert cache.pool.num_used == used

    nxt = [toks(1, 6), toks(1, 7)]
    logits = run(model, cache, nxt, [1, 1])
    for b, (tokens, new) in enumerate(zip(held, nxt)):
        torch.testing.assert_close(logits[b, 0], fresh_last_logits(model, tokens + new), atol=1e-5, rtol=1e-4)

    cache.select_rows([])
    assert cache.pool.num_used == 0  # nothing leaked
