"""The block pool: reference-counted block ids handed out lowest first and given back in
order, all-or-nothing allocation, double frees refused, growth, and the prefix cache's
registered blocks (kept evictable after their last holder, evicted oldest first, a sequence's
tail before its prefix)."""

from __future__ import annotations

import pytest

from specdecode.cache.block_pool import BlockPool, OutOfBlocks

BS = 4


def test_blocks_come_out_lowest_first_and_back_in_the_order_given():
    pool = BlockPool(5, BS)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and (pool.num_free, pool.num_used) == (2, 3)
    pool.free(a)
    assert pool.allocate(3) == a  # a sequence that gives back its room and reserves again keeps its blocks
    assert pool.allocate(0) == [] and pool.allocate(2) == [3, 4] and pool.num_free == 0


def test_allocation_is_all_or_nothing_and_bad_frees_free_nothing():
    pool = BlockPool(3, BS)
    a = pool.allocate(2)
    with pytest.raises(OutOfBlocks) as e:
        pool.allocate(2)
    assert (e.value.needed, e.value.free, pool.num_free) == (2, 1, 1)
    for bad, message in (([a[0], a[0]], "listed twice"), ([a[0], 2], "double free"), ([7], "not a block id"),
                         ([-1], "not a block id")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            pool.free(bad)
        assert [pool.refs(b) for b in a] == [1, 1] and pool.num_free == 1
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(0, BS)


def test_grown_blocks_come_out_after_the_free_ones():
    pool = BlockPool(2, BS)
    (held,) = pool.allocate(1)
    pool.grow(2)
    assert pool.num_blocks == 4 and pool.num_free == 3
    assert pool.allocate(3) == [1, 2, 3] and pool.refs(held) == 1


def test_pool_keeps_released_cached_blocks_until_it_needs_them():
    pool = BlockPool(4, BS)
    a = pool.allocate(3)
    pool.register(a[0], "k0")
    pool.register(a[1], "k1")
    pool.free(a)  # a[2] is free again; a[0], a[1] wait, evictable
    assert (pool.num_free, pool.num_used, pool.num_cached) == (4, 0, 2)
    assert pool.lookup("k0") == (a[0], 0) and pool.lookup("k1") == (a[1], 1)
    pool.share(a[0])  # held again: no longer evictable
    assert (pool.refs(a[0]), pool.num_free) == (1, 3)
    got = pool.allocate(3)  # two free, then the oldest released cached block: a[1] (a[0] is held)
    assert a[1] in got and a[0] not in got and pool.lookup("k1") is None and pool.num_cached == 1
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.free([a[0]])
    pool.free(got)
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[0]])


def test_pool_evicts_a_sequence_tail_before_its_prefix():
    pool = BlockPool(3, BS)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, i)
    pool.free(blocks)
    (first,) = pool.allocate(1)
    assert first == blocks[2] and pool.lookup(0) is not None and pool.lookup(2) is None


def test_register_keeps_the_first_block_of_a_key():
    pool = BlockPool(3, BS)
    a, b = pool.allocate(2)
    uid = pool.register(a, "k")
    assert pool.register(b, "k", extra="features") == uid and not pool.is_registered(b)
    assert pool.extra(a) == "features"  # filled in where the first had none
    with pytest.raises(ValueError, match="free"):
        pool.register(2, "other")
    with pytest.raises(ValueError, match="not cached"):
        pool.share(b)
