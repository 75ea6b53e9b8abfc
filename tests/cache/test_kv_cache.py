"""The contiguous KV cache: a pass writes past each row's length and only `commit` keeps it,
so a rollback (`truncate`) costs nothing; one row or many write the same slots; tree paths are
compacted; rows leave and join; an overflow is one clear error; `NoCache` keeps nothing."""

from __future__ import annotations

import pytest
import torch

from specdecode.cache.kv_cache import ContiguousKVCache, NoCache

L, H, D = 2, 2, 3


def cache(batch: int, capacity: int = 8) -> ContiguousKVCache:
    return ContiguousKVCache(L, batch, H, D, capacity, torch.float32, "cpu")


def kv(batch: int, T: int, start: float) -> torch.Tensor:
    """[B, H, T, D] values that say where they came from."""
    return start + torch.arange(batch * H * T * D, dtype=torch.float32).reshape(batch, H, T, D)


def test_a_pass_writes_past_the_length_and_commit_keeps_what_was_accepted():
    c = cache(2)
    slots = c.lengths[:, None] + torch.arange(3)  # [B, 3]
    k, v = c.append(0, kv(2, 3, 0), kv(2, 3, 100), slots, 3)
    assert k.shape == (2, H, 3, D) and torch.equal(k, kv(2, 3, 0)) and torch.equal(v, kv(2, 3, 100))
    assert c.lengths.tolist() == [0, 0]  # attention never moves the lengths
    c.commit(torch.tensor([3, 1]))
    c.truncate(torch.tensor([2, 5]))  # roll row 0 back; row 1 is shorter than 5 already
    assert c.lengths.tolist() == [2, 1]
    slots = c.lengths[:, None] + torch.arange(1)
    k, _ = c.append(0, kv(2, 1, 50), kv(2, 1, 50), slots, 3)
    assert torch.equal(k[0, :, 2], kv(2, 1, 50)[0, :, 0])  # the rejected slot is overwritten
    assert torch.equal(k[1, :, 1], kv(2, 1, 50)[1, :, 0]) and torch.equal(k[1, :, 2], kv(2, 3, 0)[1, :, 2])


def test_one_row_takes_the_slice_path_and_writes_what_the_indexed_path_writes():
    one, two = cache(1), cache(2)
    new = kv(1, 3, 7)  # [1, H, 3, D]
    for c in (one, two):
        c.commit(torch.full((c.batch_size,), 2))
        rows = new.expand(c.batch_size, -1, -1, -1)
        c.append(1, rows, rows + 1, c.lengths[:, None] + torch.arange(3), 5)
    for row in (0, 1):
        assert torch.equal(one.k[1, 0], two.k[1, row]) and torch.equal(one.v[1, 0], two.v[1, row])
    assert torch.equal(one.k[1, 0, :, 2:5], new[0]) and not one.k[1, 0, :, :2].any()


def test_keep_slots_compacts_a_tree_path():
    c = cache(1)
    c.append(0, kv(1, 6, 0), kv(1, 6, 0), torch.arange(6)[None], 6)
    before = c.k[0, 0].clone()  # [H, S, D]
    c.keep_slots(0, torch.tensor([2, 4, 5]), 1)  # overlapping source and destination
    assert torch.equal(c.k[0, 0, :, 1:4], before[:, [2, 4, 5]]) and torch.equal(c.k[0, 0, :, 0], before[:, 0])


def test_rows_leave_and_join_with_their_contents():
    c = cache(3)
    c.append(0, kv(3, 2, 0), kv(3, 2, 0), torch.arange(2).expand(3, -1), 2)
    c.commit(torch.tensor([1, 2, 2]))
    row2 = c.k[:, 2].clone()
    c.select_rows(torch.tensor([2, 0]))
    assert c.batch_size == 2 and c.lengths.tolist() == [2, 1] and torch.equal(c.k[:, 0], row2)
    joined = c.concat_rows(cache(1))
    assert joined.batch_size == 3 and joined.lengths.tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match="cannot join"):
        c.concat_rows(cache(1, capacity=4))


def test_an_overflow_is_one_clear_error():
    c = cache(1, capacity=4)
    with pytest.raises(ValueError, match="KV cache overflow: need 5 slots, capacity is 4"):
        c.append(0, kv(1, 5, 0), kv(1, 5, 0), torch.arange(5)[None], 5)
    with pytest.raises(ValueError, match="overflow"):
        c.storage_index(torch.arange(5)[None], 5)
    with pytest.raises(ValueError, match="capacity >= 1"):
        cache(1, capacity=0)


def test_no_cache_hands_kv_back_and_keeps_nothing():
    c = NoCache(2, "cpu")
    k = kv(2, 3, 0)
    assert c.append(0, k, k, torch.arange(3).expand(2, -1), 3)[0] is k
    for call in (lambda: c.commit(torch.ones(2)), lambda: c.truncate(torch.zeros(2)),
                 lambda: c.keep_slots(0, torch.tensor([0]), 0)):  # fmt: skip
        with pytest.raises(RuntimeError, match="keeps nothing"):
            call()
    c.select_rows(torch.tensor([1]))
    assert c.batch_size == 1
