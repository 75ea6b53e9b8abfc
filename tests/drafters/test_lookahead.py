"""The lookahead drafter without a model: window layout, pool updates, proposals, options."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdecode import SamplingParams
from specdecode.drafters.registry import parse_spec
from specdecode.config import SpecDecodeError
from specdecode.drafters.base import DrafterContext
from specdecode.drafters.lookahead import LookaheadDrafter, NgramPool, _Row, window_layout
from specdecode.core.batch import Batch
from specdecode.entrypoints.cli import main
from tests.tiny import make_tiny_checkpoint

CPU = torch.device("cpu")


def drafter(**options) -> LookaheadDrafter:
    spec = parse_spec({"method": "lookahead", **options})
    return LookaheadDrafter(spec, DrafterContext(target=None, dtype=torch.float32, device=CPU))


def batch_of(*rows: list[int], num_prompt: list[int] | None = None) -> Batch:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    seqs = [Batch.new_sequence(i, r, params, CPU) for i, r in enumerate(rows)]
    for seq, n in zip(seqs, num_prompt or [len(r) for r in rows]):
        seq.num_prompt = n
    return Batch(seqs, capacity=64, device=CPU)


def one_hot_logits(tokens: np.ndarray, vocab: int = 64) -> torch.Tensor:
    """[B, A] token ids -> [B, A, V] logits whose argmax is that token."""
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), vocab).float()


def test_window_layout_values():
    offsets, mask = window_layout(W=3, N=3)  # levels 0, 1; node k = j·3 + i
    assert offsets.tolist() == [1, 2, 3, 2, 3, 4]
    want = [
        # (0,0) (0,1) (0,2) (1,0) (1,1) (1,2)
        [1, 0, 0, 0, 0, 0],  # (0,0): level-0 column 0
        [1, 1, 0, 0, 0, 0],  # (0,1): level-0 columns 0..1
        [1, 1, 1, 0, 0, 0],  # (0,2)
        [1, 0, 0, 1, 0, 0],  # (1,0): level-0 column 0, then its own column's level 1
        [1, 1, 0, 0, 1, 0],  # (1,1)
        [1, 1, 1, 0, 0, 1],  # (1,2)
    ]
    assert mask.int().tolist() == want


@pytest.mark.parametrize("W,N", [(1, 2), (4, 2), (3, 4), (5, 5)])
def test_each_aux_node_sees_a_contiguous_run_of_positions(W, N):
    offsets, mask = window_layout(W, N)
    assert offsets.shape == (W * (N - 1),) and mask.shape == (W * (N - 1),) * 2
    for k in range(W * (N - 1)):
        seen = sorted([0] + offsets[mask[k]].tolist())  # the root at offset 0, then what it sees
        assert seen == list(range(int(offsets[k]) + 1)), k
        assert mask[k, k]


def test_propose_shapes_root_only_tree_and_aux_mask():
    d = drafter(lookahead_window=3, lookahead_ngram=3, lookahead_guess=2, pool_from_prompt=False, pool_from_output=False)
    batch = batch_of([5, 6, 7, 8], [9, 10])  # different lengths
    d.prefill(batch)
    draft = d.propose(batch, 8)
    tree, aux = draft.tree, draft.aux
    assert tree.num_nodes == 1 and tree.tokens[:, 0].tolist() == [8, 10]  # no guesses yet: root only
    A = 3 * 2
    assert aux.tokens.shape == (2, A) and aux.offsets.shape == (2, A) and aux.mask.shape == (2, A, 1 + A)
    assert aux.offsets[0].tolist() == [1, 2, 3, 2, 3, 4]
    assert aux.mask[:, :, 0].all()  # every window node sees the root
    assert torch.equal(aux.mask[0, :, 1:], window_layout(3, 3)[1])
    # the windows are drawn from each row's own prompt, deterministically
    assert set(aux.tokens[0].tolist()) <= {5, 6, 7, 8} and set(aux.tokens[1].tolist()) <= {9, 10}
    again = drafter(lookahead_window=3, lookahead_ngram=3, lookahead_guess=2, pool_from_prompt=False)
    again.prefill(batch_of([5, 6, 7, 8]))
    assert again.propose(batch_of([5, 6, 7, 8]), 8).aux.tokens[0].tolist() == aux.tokens[0].tolist()
    assert d.max_draft_tokens(8) == 2 * 2 + A and d.max_draft_tokens(1) == 2 * 1 + A


def test_pool_keeps_newest_distinct_continuations_per_key():
    pool = NgramPool(cap=2)
    pool.add(1, (2, 3))
    pool.add(1, (4, 5))
    pool.add(1, (2, 3))  # a repeat moves to the front
    assert pool.guesses(1) == [(2, 3), (4, 5)]
    pool.add(1, (6, 7))  # over the cap: the oldest goes
    assert pool.guesses(1) == [(6, 7), (2, 3)]
    assert pool.guesses(9) == [] and len(pool) == 2
    assert pool.add_sequence([1, 2, 3, 1, 2], n=3, start=0) == 3
    assert pool.guesses(2) == [(3, 1)] and pool.guesses(3) == [(1, 2)]


def test_jacobi_step_collects_ngrams_then_shifts():
    d = drafter(lookahead_window=2, lookahead_ngram=3, lookahead_guess=4, pool_from_prompt=False, pool_from_output=False)
    batch = batch_of([1, 2, 3])
    d.prefill(batch)
    row = d._rows[0]
    row.window = np.array([[10, 11], [20, 21]])  # levels 0, 1 x columns 0, 1
    row.rounds = 1  # past the N - 2 = 1 filling round
    d.propose(batch, 8)
    outs = np.zeros((1, 4), dtype=np.int64)
    outs[0, 2:] = [30, 31]  # last level (1) outputs; level 0's outputs are not used
    outs[0, :2] = [40, 41]
    d.on_verified(batch, torch.tensor([0]), one_hot_logits(outs))
    assert row.window.tolist() == [[20, 21], [30, 31]]  # shifted, new last level
    assert row.pool.guesses(10) == [(20, 30)] and row.pool.guesses(11) == [(21, 31)]
    assert d.stats.collected == 2


def test_first_rounds_only_fill_the_window():
    d = drafter(lookahead_window=1, lookahead_ngram=4, lookahead_guess=4, pool_from_prompt=False, pool_from_output=False)
    batch = batch_of([1, 2, 3])
    d.prefill(batch)
    row = d._rows[0]
    seed = int(row.window[2, 0])
    for step, out in enumerate([50, 51, 52]):  # N - 2 = 2 filling rounds, then collection
        d.on_verified(batch, torch.tensor([0]), one_hot_logits(np.array([[0, 0, out]])))
        assert len(row.pool) == (1 if step == 2 else 0)
    assert row.window[:, 0].tolist() == [50, 51, 52]
    assert row.pool.guesses(seed) == [(50, 51, 52)]  # levels 1.. are outputs; the key is a seed token


def test_propose_merges_root_guesses_into_a_tree():
    d = drafter(lookahead_window=2, lookahead_ngram=4, lookahead_guess=3, pool_from_prompt=False, pool_from_output=False)
    batch = batch_of([1, 2, 7], [3, 4])
    d.prefill(batch)
    for g in [(8, 9, 10), (8, 9, 11), (12, 13, 14), (15, 16, 17)]:  # cap 3: (8, 9, 10) is dropped
        d._rows[0].pool.add(7, g)
    draft = d.propose(batch, 8)
    tree = draft.tree
    # newest first: 15-16-17, 12-13-14, 8-9-11
    assert tree.tokens[0].tolist() == [7, 15, 16, 17, 12, 13, 14, 8, 9, 11]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 0, 4, 5, 0, 7, 8]
    assert tree.tokens[1].tolist() == [4] + [-1] * 9  # row 1 has no guess for its root
    assert draft.aux.mask.shape == (2, 6, 10 + 6)
    assert not draft.aux.mask[:, :, 1:10].any()  # window nodes see no guess
    shallow = d.propose(batch, 2)  # γ caps the depth
    assert shallow.tree.max_depth == 2 and shallow.tree.tokens[0].tolist() == [7, 15, 16, 12, 13, 8, 9]
    assert d.stats.guessed == 2 and d.stats.no_guess == 2


def test_pool_seeded_from_prompt_and_output():
    d = drafter(lookahead_ngram=3, pool_from_prompt=True, pool_from_output=True)
    batch = batch_of([1, 2, 3, 4, 5], num_prompt=[3])  # prompt 1 2 3, output so far 4 5
    d.prefill(batch)
    pool = d._rows[0].pool
    assert pool.guesses(1) == [(2, 3)] and pool.guesses(2) == [(3, 4)] and pool.guesses(3) == [(4, 5)]
    only_output = drafter(lookahead_ngram=3, pool_from_prompt=False, pool_from_output=True)
    only_output.prefill(batch)
    assert only_output._rows[0].pool.guesses(1) == [] and only_output._rows[0].pool.guesses(2) == [(3, 4)]
    batch.seqs[0].token_ids += [6]
    W = d.W
    d.on_verified(batch, torch.tensor([0]), one_hot_logits(np.zeros((1, W * 2), dtype=np.int64)))
    assert (5, 6) in pool.guesses(4)


def test_select_rows_and_joining_rows():
    d = drafter(lookahead_ngram=4, pool_from_prompt=True)
    batch = batch_of([1, 2, 3], [4, 5, 6], [7, 8, 9])
    d.prefill(batch)
    rows = d._rows
    d.select_rows([2, 0])
    assert d._rows == [rows[2], rows[0]]
    batch.select_rows([2, 0])
    batch.seqs.append(Batch.new_sequence(9, [10, 11, 12, 13], SamplingParams(temperature=0.0), CPU))
    d.prefill(batch, [2])  # a row joining at the end keeps the others' state
    assert d._rows[:2] == [rows[2], rows[0]] and d._rows[2].pool.guesses(10) == [(11, 12, 13)]
    assert d.propose(batch, 8).aux.tokens.shape[0] == 3


def test_row_window_is_drawn_from_the_prompt():
    row = _Row([3, 4], drafter(lookahead_window=6, lookahead_ngram=5).options)
    assert row.window.shape == (4, 6) and set(row.window.reshape(-1).tolist()) <= {3, 4}


@pytest.mark.parametrize(
    "options,match",
    [
        ({"lookahead_window": 0}, "lookahead_window"),
        ({"lookahead_window": 2.5}, "lookahead_window"),
        ({"lookahead_ngram": 1}, "lookahead_ngram"),
        ({"lookahead_ngram": True}, "lookahead_ngram"),
        ({"lookahead_guess": 0}, "lookahead_guess"),
        ({"lookahead_window": 60, "lookahead_guess": 60, "lookahead_ngram": 4}, "nodes per round"),
        ({"pool_from_prompt": "yes"}, "pool_from_prompt"),
        ({"lookahead_windows": 4}, "unknown key"),
        ({"window": 4, "W": 3}, "unknown key"),
    ],
)
def test_bad_options_are_one_line_errors(options, match):
    with pytest.raises(SpecDecodeError, match=match) as err:
        parse_spec({"method": "lookahead", **options})
    assert "\n" not in str(err.value)


def test_defaults_parse_and_round_trip():
    spec = parse_spec('{"method": "lookahead", "lookahead_window": 3, "lookahead_ngram": 5, "lookahead_guess": 2}')
    assert (spec.options.lookahead_window, spec.options.lookahead_ngram, spec.options.lookahead_guess) == (3, 5, 2)
    assert parse_spec(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "spec,match",
    [({"method": "lookahead", "lookahead_size": 4}, "unknown key"), ({"method": "lookahead", "lookahead_ngram": 0}, "lookahead_ngram")],
)
def test_cli_bad_lookahead_keys_exit_2(capsys, tmp_path, spec, match):
    target = make_tiny_checkpoint(tmp_path / "t", "llama", seed=0)
    capsys.readouterr()  # the checkpoint writer's progress bar
    code = main(["generate", "hi", "--model", str(target), "--max-tokens", "4", "--dtype", "float32",
                 "--speculative-config", json.dumps(spec)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and match in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1
