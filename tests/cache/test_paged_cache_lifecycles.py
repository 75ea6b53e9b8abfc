"""The paged KV cache under random lifecycles: a hypothesis state machine runs random joins,
decode / verify / tree rounds with random accept counts, rollbacks, preemptions (recomputed
later), cancels and finishes, checks the block accounting after every step and, at the end,
every live sequence's K/V against a fresh prefill. (Parity pass by pass: test_paged_cache.py.)
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from specdecode.cache.block_pool import OutOfBlocks
from specdecode.core.tree import DraftTree, batch_trees, commit_paths
from tests.cache.test_paged_cache import ATOL, BS, seq_kv, toks


def test_random_lifecycles(llama):
    run_state_machine_as_test(
        lambda: Lifecycles(llama),
        settings=settings(
            max_examples=30, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


class Lifecycles(RuleBasedStateMachine):
    """Sequences join (prefill), run decode / verify / tree rounds committing random counts,
    roll back, are preempted (freed, later re-prefilled from their tokens), cancelled or
    finished, in a pool small enough to run out."""

    NUM_BLOCKS = 16  # 64 slots: a few sequences fill it

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.cache = model.new_paged_cache(self.NUM_BLOCKS, BS)
        self.live: dict[int, list[int]] = {}  # committed tokens per sequence in the cache
        self.preempted: dict[int, list[int]] = {}
        self.next_id = 0

    # -- helpers

    def _preempt(self, sid: int) -> None:
        self.cache.free_sequence(sid)
        self.preempted[sid] = self.live.pop(sid)

    def _reserve(self, batch: list[int], room: int) -> list[int]:
        """Reserve ``room`` for each row, preempting the last row until it fits (as a scheduler would)."""
        while batch:
            self.cache.set_batch(batch)
            before = (self.cache.pool.num_used, [self.cache.block_table(s) for s in batch])
            try:
                self.cache.reserve([room] * len(batch))
                return batch
            except OutOfBlocks:
                assert (self.cache.pool.num_used, [self.cache.block_table(s) for s in batch]) == before
                self._preempt(batch.pop())
        return batch

    @torch.no_grad()
    def _forward(self, batch: list[int], tokens: torch.Tensor, positions=None, block_mask=None) -> None:
        T = tokens.shape[1]
        if positions is None:
            positions = self.cache.lengths[:, None] + torch.arange(T)
        logits = self.model(tokens, positions, self.cache, block_mask=block_mask)
        assert torch.isfinite(logits).all()

    def _prefill(self, sid: int, tokens: list[int]) -> None:
        self.cache.add_sequence(sid)
        self.live[sid] = []
        if not tokens:
            return
        if not self._reserve([sid], len(tokens)):
            self.preempted[sid] = tokens  # no room even alone: waits with its tokens
            return
        self._forward([sid], torch.tensor([tokens]))
        self.cache.commit([len(tokens)])
        self.live[sid] = list(tokens)

    def _pick(self, data, max_rows: int = 4) -> list[int]:
        """A batch: 1 .. max_rows live sequences in a random order."""
        ids = data.draw(st.permutations(sorted(self.live)), label="order")
        return ids[: data.draw(st.integers(1, min(max_rows, len(ids))), label="rows")]

    # -- rules

    @initialize(lengths=st.lists(st.integers(1, 14), min_size=1, max_size=3), seed=st.integers(0, 999))
    def start(self, lengths, seed):
        for i, n in enumerate(lengths):
            self.join(n, seed + i)

    @rule(n=st.integers(1, 14), seed=st.integers(0, 999))
    def join(self, n, seed):
        self.next_id += 1
        self._prefill(self.next_id, toks(n, seed=seed).tolist())

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume(self, data):
        sid = data.draw(st.sampled_from(sorted(self.preempted)), label="resume")
        self._prefill(sid, self.preempted.pop(sid))  # recompute from its tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data(), T=st.integers(1, 5), seed=st.integers(0, 999))
    def chain_round(self, data, T, seed):
        """A decode (T = 1), verify (γ + 1) or prefill-chunk pass; each row keeps a random count."""
        batch = self._reserve(self._pick(data), T)
        if not batch:
            return
        tokens = toks(len(batch), T, seed=seed)
        self._forward(batch, tokens)
        kept = data.draw(st.lists(st.integers(0, T), min_size=len(batch), max_size=len(batch)), label="kept")
        self.cache.commit(torch.tensor(kept))
        for sid, row, n in zip(batch, tokens.tolist(), kept):
            self.live[sid] += row[:n]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), seed=st.integers(0, 999))
    def tree_round(self, data, seed):
        """A random tree per row; a random root-to-node path is accepted and compacted."""
        rows = self._pick(data, max_rows=3)
        sizes = [data.draw(st.integers(1, 6), label="nodes") for _ in rows]
        batch = self._reserve(rows, max(sizes))
        if not batch:
            return
        trees, paths = [], []
        gen = torch.Generator().manual_seed(seed)
        for b in range(len(batch)):  # _reserve drops rows from the end only
            n = sizes[b]
            parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
            tree = DraftTree.from_parents(toks(n, seed=seed + b), parents)
            trees.append(tree)
            path = [data.draw(st.integers(0, n - 1), label="accepted leaf")]
            while path[-1] != 0:
                path.append(parents[path[-1]])
            paths.append(path[::-1])
        tb = batch_trees(trees)
        self._forward(batch, tb.tokens.clamp(min=0), tb.positions(self.cache.lengths), tb.mask)
        width = max(len(p) for p in paths)
        nodes = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
        commit_paths(self.cache, nodes, torch.tensor([len(p) - 1 for p in paths]))
        for sid, tree, path in zip(batch, trees, paths):
            self.live[sid] += [int(tree.tokens[i]) for i in path]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def rollback(self, data):
        sid = data.draw(st.sampled_from(sorted(self.live)), label="rollback")
        n = data.draw(st.integers(0, len(self.live[sid])), label="to")
        self.cache.set_batch([sid])
        self.cache.truncate(torch.tensor([n]))
        del self.live[sid][n:]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(sorted(self.live)), label="preempt"))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), room=st.integers(1, 9))
    def cancel(self, data, room):
        """Cancelled between reserve and commit: the reserved room goes back with the rest."""
        sid = data.draw(st.sampled_from(sorted(self.live)), label="cancel")
        if self._reserve([sid], room):
            self.cache.free_sequence(sid)
            del self.live[sid]

    @precondition(lambda self: len(self.live) >= 2)
    @rule(data=st.data())
    def finish(self, data):
        """Some rows of a batch finish: select_rows keeps the others and frees the finished."""
        batch = self._pick(data)
        self.cache.set_batch(batch)
        keep = data.draw(st.lists(st.sampled_from(range(len(batch))), unique=True), label="keep")
        self.cache.select_rows(torch.tensor(keep, dtype=torch.long))
        assert self.cache.seq_ids == [batch[r] for r in keep]
        for r, sid in enumerate(batch):
            if r not in keep:
                del self.live[sid]

    # -- checks

    @invariant()
    def blocks_are_accounted_for(self):
        cache, pool = self.cache, self.cache.pool
        assert set(self.live).isdisjoint(self.preempted)
        tables = {sid: cache.block_table(sid) for sid in self.live}
        held = [b for t in tables.values() for b in t]
        assert len(held) == len(set(held)), "a block is owned twice"
        assert pool.num_used == len(held), "a block leaked"
        assert all(0 <= b < pool.num_blocks for b in held)
        for sid, table in tables.items():  # every step ends with a commit, truncate or free
            assert cache.seq_length(sid) == len(self.live[sid])
            assert len(table) == -(-len(self.live[sid]) // BS)
        for sid in self.preempted:
            assert sid not in cache

    def teardown(self):
        """Every live sequence's cached K/V equals a fresh prefill of its tokens."""
        for sid, tokens in self.live.items():
            if not tokens:
                continue
            n = len(tokens)
            ref = self.model.new_cache(1, n)
            with torch.no_grad():
                self.model(torch.tensor([tokens]), torch.arange(n)[None], ref)
            k, v = seq_kv(self.cache, sid)
            torch.testing.assert_close(k, ref.k[:, 0].transpose(1, 2), atol=ATOL, rtol=0)
            torch.testing.assert_close(v, ref.v[:, 0].transpose(1, 2), atol=ATOL, rtol=0)
