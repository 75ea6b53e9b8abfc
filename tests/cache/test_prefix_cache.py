"""Automatic prefix caching in the paged KV cache: matching, sharing, copy on write, eviction.

The unit tests pin the cache's rules (the pool's: test_block_pool.py); `SharedLifecycles` runs the paged
cache's random lifecycles (test_paged_cache_lifecycles.py) with sharing: sequences join
from prefixes of earlier ones, blocks are published at random moments, rolled back into,
evicted, and every live sequence's K/V must still equal a fresh prefill.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

from specdecode.cache.block_pool import OutOfBlocks
from specdecode.cache.prefix_cache import PrefixCachingKVCache
from tests.cache.test_paged_cache import ATOL, BS, seq_kv, toks
from tests.cache.test_paged_cache_lifecycles import Lifecycles


def cache_for(model, num_blocks: int) -> PrefixCachingKVCache:
    return model.new_paged_cache(num_blocks, BS, cls=PrefixCachingKVCache)


@torch.no_grad()
def prefill(cache, model, sid, tokens: list[int]) -> int:
    """Join ``sid`` from the cache's longest match, compute the rest, publish; returns the hit."""
    cache.add_sequence(sid)
    hit = cache.match_prefix(sid, tokens, len(tokens) - 1)
    cache.set_batch([sid])
    rest = tokens[hit:]
    cache.reserve([len(rest)])
    model(torch.tensor([rest]), torch.arange(hit, len(tokens))[None], cache)
    cache.commit([len(rest)])
    cache.publish(sid, tokens)
    return hit


def fresh_kv(model, tokens: list[int]):
    ref = model.new_cache(1, len(tokens))
    with torch.no_grad():
        model(torch.tensor([tokens]), torch.arange(len(tokens))[None], ref)
    return ref.k[:, 0].transpose(1, 2), ref.v[:, 0].transpose(1, 2)


def test_a_shared_prompt_is_computed_once_and_reads_the_same_kv(llama):
    cache = cache_for(llama, 16)
    system = toks(10, seed=1).tolist()  # two full blocks and a half
    a, b = system + toks(3, seed=2).tolist(), system + toks(5, seed=3).tolist()
    assert prefill(cache, llama, "a", a) == 0
    assert prefill(cache, llama, "b", b) == 8  # the two full blocks of the shared part
    assert cache.block_table("a")[:2] == cache.block_table("b")[:2]
    assert cache.block_table("a")[2] != cache.block_table("b")[2]
    assert (cache.queries, cache.hits) == (len(a) + len(b), 8)
    for sid, tokens in (("a", a), ("b", b)):
        k, v = seq_kv(cache, sid)
        want_k, want_v = fresh_kv(llama, tokens)
        torch.testing.assert_close(k, want_k, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, want_v, atol=ATOL, rtol=0)


def test_the_last_prompt_token_is_always_computed(llama):
    cache = cache_for(llama, 16)
    tokens = toks(8, seed=4).tolist()  # exactly two blocks
    prefill(cache, llama, "a", tokens)
    assert prefill(cache, llama, "b", tokens) == 4  # not 8: the last token's logits are needed


def test_keys_name_the_whole_prefix(llama):
    """The same block of tokens after a different prefix is another block."""
    cache = cache_for(llama, 16)
    x, y, z = (toks(4, seed=s).tolist() for s in (5, 6, 7))
    prefill(cache, llama, "a", x + z + [9])
    assert prefill(cache, llama, "b", y + z + [9]) == 0


def test_rollback_into_a_shared_block_copies_it(llama):
    cache = cache_for(llama, 16)
    tokens = toks(9, seed=8).tolist()
    prefill(cache, llama, "a", tokens)
    prefill(cache, llama, "b", tokens)  # shares blocks 0 and 1
    shared = cache.block_table("b")[1]
    cache.set_batch(["b"])
    cache.truncate([6])  # into the shared block 1
    with pytest.raises(ValueError, match="shared block"), torch.no_grad():
        llama(toks(1, 1, seed=0), torch.tensor([[6]]), cache)
    cache.reserve([2])  # copy on write
    own = cache.block_table("b")[1]
    assert own != shared and cache.pool.refs(shared) == 1
    new = toks(2, seed=9).tolist()
    with torch.no_grad():
        llama(torch.tensor([new]), torch.tensor([[6, 7]]), cache)
    cache.commit([2])
    for sid, want in (("a", tokens), ("b", tokens[:6] + new)):
        torch.testing.assert_close(seq_kv(cache, sid)[0], fresh_kv(llama, want)[0], atol=ATOL, rtol=0)


def test_rollback_into_an_unshared_cached_block_uncaches_it(llama):
    cache = cache_for(llama, 16)
    tokens = toks(9, seed=10).tolist()
    prefill(cache, llama, "a", tokens)
    block = cache.block_table("a")[1]
    cache.set_batch(["a"])
    cache.truncate([6])
    assert not cache.pool.is_registered(block)
    cache.add_sequence("b")
    assert cache.match_prefix("b", tokens, 8) == 4


def test_copy_on_write_is_counted_before_anything_changes(llama):
    cache = cache_for(llama, 4)
    tokens = toks(9, seed=11).tolist()
    prefill(cache, llama, "a", tokens)  # 3 blocks
    prefill(cache, llama, "b", tokens)  # shares two, holds one more: none free
    cache.set_batch(["b"])
    cache.truncate([6])  # into shared block 1; b's third block goes back: 1 free
    tables = cache.block_table("b")
    with pytest.raises(OutOfBlocks) as err:
        cache.reserve([3])  # one more block and a copy of block 1
    assert (err.value.needed, err.value.free) == (2, 1) and cache.block_table("b") == tables
    cache.reserve([2])  # the copy alone fits
    assert cache.block_table("b")[0] == tables[0] and cache.block_table("b")[1] != tables[1]
    assert cache.pool.num_free == 0


def test_features_kept_beside_blocks_limit_a_match(llama):
    cache = cache_for(llama, 16)
    tokens = toks(13, seed=12).tolist()
    cache.add_sequence("a")
    cache.set_batch(["a"])
    cache.reserve([13])
    with torch.no_grad():
        llama(torch.tensor([tokens]), torch.arange(13)[None], cache)
    cache.commit([13])
    cache.publish("a", tokens, extra=lambda i: f"f{i}" if i < 2 else None)
    cache.add_sequence("b")
    assert cache.match_prefix("b", tokens, 12, usable=lambda extra: extra is not None) == 8


# ---- random lifecycles with sharing -----------------------------------------------------


def test_random_lifecycles_with_prefix_caching(llama):
    run_state_machine_as_test(
        lambda: SharedLifecycles(llama),
        settings=settings(
            max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


class SharedLifecycles(Lifecycles):
    """`Lifecycles` over a prefix-caching cache: joins match what is cached, blocks are
    published at random moments, and a join may reuse a prefix of any sequence seen."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.cache = cache_for(model, self.NUM_BLOCKS)
        self.seen: list[list[int]] = []

    def _prefill(self, sid: int, tokens: list[int]) -> None:
        self.cache.add_sequence(sid)
        self.live[sid] = []
        if not tokens:
            return
        hit = self.cache.match_prefix(sid, tokens, len(tokens) - 1)
        self.live[sid] = tokens[:hit]
        rest = tokens[hit:]
        if not self._reserve([sid], len(rest)):
            self.preempted[sid] = tokens
            return
        self._forward([sid], torch.tensor([rest]))
        self.cache.commit([len(rest)])
        self.live[sid] = list(tokens)
        self.cache.publish(sid, tokens)
        self.seen.append(list(tokens))

    @precondition(lambda self: self.seen or self.live)
    @rule(data=st.data(), n=st.integers(0, 6), seed=st.integers(0, 999))
    def join_shared(self, data, n, seed):
        """A new sequence: a prefix of one seen (a chat's next turn, a shared system prompt) and more."""
        pool = self.seen + list(self.live.values())
        source = data.draw(st.sampled_from(pool), label="source")
        keep = data.draw(st.integers(0, len(source)), label="prefix")
        self.next_id += 1
        self._prefill(self.next_id, source[:keep] + toks(n, seed=seed).tolist())

    @precondition(lambda self: self.live)
    @rule()
    def publish(self):
        for sid, tokens in self.live.items():
            self.cache.publish(sid, tokens)
            self.seen.append(list(tokens))

    @invariant()
    def blocks_are_accounted_for(self):
        cache, pool = self.cache, self.cache.pool
        assert set(self.live).isdisjoint(self.preempted)
        tables = {sid: cache.block_table(sid) for sid in self.live}
        held = [b for t in tables.values() for b in t]
        for b in set(held):
            assert pool.refs(b) == held.count(b), f"block {b}: {pool.refs(b)} holds for {held.count(b)} holders"
        assert pool.num_used == len(set(held)), "a block leaked"
        assert pool.num_free + pool.num_used == pool.num_blocks
        for sid, table in tables.items():
            n = len(self.live[sid])
            assert cache.seq_length(sid) == n and len(table) == -(-n // BS)
        for sid in self.preempted:
            assert sid not in cache

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        """After every step, not only at the end: a write into a shared block shows at once."""
        self.teardown()
