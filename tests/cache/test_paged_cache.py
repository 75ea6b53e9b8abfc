"""The paged KV cache: the same logits as the contiguous cache, and no block lost or shared.

Parity runs the same passes through `PagedKVCache` (blocks of 4, so every sequence spans
many) and `ContiguousKVCache`: prefill, decode, a ragged batch, a γ+1 verify pass with
partial commits, and a tree pass compacted by `commit_paths`; then the pool's bookkeeping.
Random lifecycles (a hypothesis state machine): test_paged_cache_lifecycles.py.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.cache.block_pool import BlockPool, OutOfBlocks
from specdecode.model.loader import load_model
from specdecode.model.transformer import Transformer
from specdecode.cache.paged_cache import PagedKVCache
from specdecode.core.tree import DraftTree, batch_trees, commit_paths
from tests.tiny import make_tiny_checkpoint

VOCAB = 128
BS = 4  # block size: small, so that sequences span many blocks
ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    """A tiny fp32 model: llama, and gemma3 (sliding window 6, so passes run past it)."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    return load_model(str(folder), dtype=torch.float32, device="cpu", progress=False).model


def toks(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


class Twin:
    """The same passes through a contiguous cache and a paged one; every pass checks the logits."""

    def __init__(self, model, ids: list, num_blocks: int = 64, capacity: int = 64) -> None:
        self.model, self.ids = model, list(ids)
        self.ref = model.new_cache(len(ids), capacity)
        self.paged = model.new_paged_cache(num_blocks, BS)
        for sid in ids:
            self.paged.add_sequence(sid)
        self.paged.set_batch(self.ids)

    @torch.no_grad()
    def run(self, tokens, positions=None, block_mask=None, batch_invariant=False) -> torch.Tensor:
        B, T = tokens.shape
        if positions is None:
            positions = self.ref.lengths[:, None] + torch.arange(T)
        self.paged.reserve([T] * B)
        want = self.model(tokens, positions, self.ref, block_mask=block_mask, batch_invariant=batch_invariant)
        got = self.model(tokens, positions, self.paged, block_mask=block_mask, batch_invariant=batch_invariant)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        return got

    def commit(self, counts) -> None:
        self.ref.commit(torch.as_tensor(counts))
        self.paged.commit(torch.as_tensor(counts))
        assert self.paged.lengths.tolist() == self.ref.lengths.tolist()
        check_tight(self.paged)
        check_same_kv(self.paged, self.ref, self.ids)


def seq_kv(cache: PagedKVCache, sid) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's committed K/V [L, length, Hkv, D], read through its block table."""
    n, table = cache.seq_length(sid), cache.block_table(sid)
    L, _, _, H, D = cache.k.shape
    k = cache.k[:, table].reshape(L, len(table) * BS, H, D)[:, :n]
    v = cache.v[:, table].reshape(L, len(table) * BS, H, D)[:, :n]
    return k, v


def check_same_kv(paged: PagedKVCache, ref, ids: list) -> None:
    for row, sid in enumerate(ids):
        n = int(ref.lengths[row])
        k, v = seq_kv(paged, sid)
        torch.testing.assert_close(k, ref.k[:, row, :, :n].transpose(1, 2), atol=ATOL, rtol=0)
        torch.testing.assert_close(v, ref.v[:, row, :, :n].transpose(1, 2), atol=ATOL, rtol=0)


def check_tight(cache: PagedKVCache) -> None:
    """After a commit or truncate: each sequence holds exactly ceil(length / block_size) blocks."""
    for sid in cache.seq_ids:
        assert len(cache.block_table(sid)) == -(-cache.seq_length(sid) // BS), sid


# ---- parity with the contiguous cache --------------------------------------------------


def test_prefill(model):
    twin = Twin(model, ["a"])
    twin.run(toks(1, 23, seed=0))
    twin.commit([23])
    assert twin.paged.block_table("a") == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("interleaved", [False, True])
def test_incremental_decode(model, interleaved):
    """Prefill 10, decode 9 one at a time, then chunks of 3. Interleaved: a second sequence takes
    every other block, so the tables are not contiguous and the gather path runs."""
    twin = Twin(model, ["a"])
    other = 0
    seq = toks(1, 31, seed=1)
    steps = [(0, 10)] + [(i, i + 1) for i in range(10, 19)] + [(i, i + 3) for i in range(19, 31, 3)]
    for lo, hi in steps:
        twin.run(seq[:, lo:hi])
        twin.commit([hi - lo])
        if interleaved:  # grab the next free block for a bystander
            twin.paged.add_sequence(other := other + 1)
            twin.paged.set_batch([other])
            twin.paged.reserve([1])
            twin.paged.set_batch(["a"])
    table = twin.paged.block_table("a")
    contiguous = table == list(range(table[0], table[0] + len(table)))
    assert contiguous != interleaved


def test_ragged_batch(model):
    """Three sequences of different lengths in one right-padded prefill, then a 4-token chunk."""
    twin = Twin(model, ["a", "b", "c"])
    twin.run(toks(3, 13, seed=2))
    twin.commit([5, 9, 13])
    twin.run(toks(3, 4, seed=3))
    twin.commit([4, 2, 3])
    twin.run(toks(3, 1, seed=4))
    twin.commit([1, 1, 1])
    assert twin.paged.lengths.tolist() == [10, 12, 17]


def test_verify_pass_with_partial_commit(model):
    """γ = 4: a 5-token verify pass, rows keep 1, 5 and 3; the rejected room goes back to the pool."""
    twin = Twin(model, ["a", "b", "c"])
    twin.run(toks(3, 7, seed=5))
    twin.commit([7, 7, 7])
    used = twin.paged.pool.num_used
    twin.run(toks(3, 5, seed=6))
    assert twin.paged.pool.num_used > used  # room for the drafts
    twin.commit([1, 5, 3])  # 8, 12, 10 slots: 2 + 3 + 3 blocks
    assert twin.paged.pool.num_used == 8
    twin.run(toks(3, 5, seed=7))
    twin.commit([2, 0, 4])


def test_tree_pass_with_compaction(model):
    """A tree pass per row, an accepted path off the first branch moved into place by keep_slots."""
    twin = Twin(model, ["a", "b"])
    twin.run(toks(2, 6, seed=8))
    twin.commit([6, 3])
    t = toks(2, 7, seed=9)
    trees = batch_trees(
        [
            DraftTree.from_parents(t[0], [-1, 0, 0, 1, 2, 4, 4]),  # path 0-2-4-6
            DraftTree.from_parents(t[1, :5], [-1, 0, 1, 0, 3]),  # path 0-3-4
        ]
    )
    with torch.no_grad():
        positions = trees.positions(twin.ref.lengths)
        twin.run(trees.tokens.clamp(min=0), positions, block_mask=trees.mask)
    nodes = torch.tensor([[0, 2, 4, 6], [0, 3, 4, -1]])
    num_accepted = torch.tensor([3, 2])
    commit_paths(twin.ref, nodes, num_accepted)
    commit_paths(twin.paged, nodes, num_accepted)
    assert twin.paged.lengths.tolist() == [10, 6]
    check_tight(twin.paged)
    check_same_kv(twin.paged, twin.ref, twin.ids)
    twin.run(toks(2, 3, seed=10))  # the compacted history is what the next pass sees
    twin.commit([3, 3])


def test_batch_invariant_pass(llama):
    twin = Twin(llama, ["a", "b"])
    twin.run(toks(2, 9, seed=11), batch_invariant=True)
    twin.commit([9, 4])
    twin.run(toks(2, 3, seed=12), batch_invariant=True)
    twin.commit([3, 1])


def test_select_rows_and_truncate(llama):
    """select_rows keeps rows in the order given and frees the others; truncate frees the tail."""
    twin = Twin(llama, ["a", "b", "c"])
    twin.run(toks(3, 9, seed=13))
    twin.commit([9, 5, 7])  # 3 + 2 + 2 blocks
    paged = twin.paged
    assert paged.pool.num_used == 7
    rows = torch.tensor([2, 0])
    twin.ref.select_rows(rows)
    paged.select_rows(rows)
    twin.ids = ["c", "a"]
    assert paged.seq_ids == ["c", "a"] and "b" not in paged and paged.pool.num_used == 5
    twin.run(toks(2, 2, seed=14))
    twin.commit([2, 1])
    paged.truncate(torch.tensor([3, 100]))
    twin.ref.truncate(torch.tensor([3, 100]))
    assert paged.lengths.tolist() == [3, 10] and paged.pool.num_used == 1 + 3
    assert paged.max_length() == twin.ref.max_length() == 10  # the host's copy, the device's
    check_tight(paged)
    twin.run(toks(2, 2, seed=15))  # the rolled-back slots are written afresh
    twin.commit([2, 2])


# ---- the pool and the bookkeeping ------------------------------------------------------


def test_block_pool():
    pool = BlockPool(6, 4)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert (a, b) == ([0, 1], [2, 3, 4]) and pool.num_free == 1 and pool.num_used == 5
    with pytest.raises(OutOfBlocks) as err:
        pool.allocate(2)
    assert (err.value.needed, err.value.free) == (2, 1) and pool.num_free == 1
    pool.free(b)
    assert pool.allocate(3) == b  # freed blocks come back first, in order
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free([2, 2])
    with pytest.raises(ValueError, match="double free"):
        pool.free([3, 0])  # 0 is free: nothing is freed, 3 included
    assert pool.num_used == 3
    with pytest.raises(ValueError, match="not a block id"):
        pool.free([6])
    assert pool.allocate(0) == []


def test_reserve_is_atomic(llama):
    cache = llama.new_paged_cache(5, BS)
    for sid in "abc":
        cache.add_sequence(sid)
    cache.set_batch(["a"])
    cache.reserve([7])  # 2 blocks
    cache.set_batch(["a", "b", "c"])
    tables = [cache.block_table(s) for s in "abc"]
    with pytest.raises(OutOfBlocks) as err:
        cache.reserve([1, 5, 5])  # 0 + 2 + 2 more blocks, 3 free: nothing is allocated
    assert (err.value.needed, err.value.free) == (4, 3)
    assert [cache.block_table(s) for s in "abc"] == tables and cache.pool.num_used == 2
    cache.reserve([1, 4, 8])  # 0 + 1 + 2: exactly what is free
    assert cache.pool.num_free == 0


def test_rows_that_give_back_their_room_get_the_same_blocks_again(llama):
    """A round reserves room for drafts on every row, and the commit frees what the rejected
    ones held; the next round must hand each row its own blocks back, not its neighbour's (a
    decode batch swapping blocks every step scatters each row's cache and slows its passes)."""
    cache = llama.new_paged_cache(32, BS)
    rows = ["a", "b", "c"]
    for sid in rows:
        cache.add_sequence(sid)
    cache.set_batch(rows)
    cache.reserve([1, 1, 1])
    cache.commit([1, 1, 1])
    for step in range(2):  # lengths 1 and 2, then 2 and 3: three blocks hold either + 9
        cache.reserve([9, 9, 9])  # room for 8 drafts: a second and a third block each
        tables = [cache.block_table(s) for s in rows]
        cache.commit([1, 1, 1])  # every draft rejected: the second and third blocks go back
        cache.reserve([9, 9, 9])
        assert [cache.block_table(s) for s in rows] == tables, step
        cache.commit([0, 0, 0])


def test_write_past_reservation_raises(llama):
    cache = llama.new_paged_cache(8, BS)
    cache.add_sequence("a")
    cache.set_batch(["a"])
    cache.reserve([3])
    cache.reserve([2])  # holds enough already: no-op
    assert cache.pool.num_used == 1
    with pytest.raises(ValueError, match="reserve"), torch.no_grad():
        llama(toks(1, 5, seed=0), torch.arange(5)[None], cache)
    with pytest.raises(ValueError, match="cannot commit"):
        cache.commit([5])


def test_sequences(llama):
    cache = llama.new_paged_cache(8, BS)
    assert (cache.k.shape, cache.k.dtype) == ((3, 8, BS, 2, 16), torch.float32)
    cache.add_sequence("a")
    cache.add_sequence(7)
    with pytest.raises(ValueError, match="already"):
        cache.add_sequence("a")
    with pytest.raises(KeyError):
        cache.set_batch(["a", "zz"])
    with pytest.raises(ValueError, match="twice"):
        cache.set_batch(["a", "a"])
    cache.set_batch([7, "a"])
    cache.reserve(torch.tensor([9, 1]))
    assert cache.blocks_needed(7, 9) == 0 and cache.blocks_needed(7, 13) == 1 and cache.blocks_needed("a", 0) == 0
    cache.free_sequence(7)  # leaves the batch too
    assert cache.seq_ids == ["a"] and cache.lengths.tolist() == [0] and cache.pool.num_used == 1
    cache.free_sequence(7)  # unknown: no-op
    cache.free_sequence("a")
    assert cache.seq_ids == [] and cache.pool.num_used == 0


def test_new_paged_cache_follows_the_model(llama):
    model = Transformer(llama.config).to(torch.bfloat16)
    cache = model.new_paged_cache(4, 8)
    assert isinstance(cache, PagedKVCache) and cache.pool.block_size == 8
    assert cache.k.dtype == torch.bfloat16 and cache.k.shape == (3, 4, 8, 2, 16) == cache.v.shape
