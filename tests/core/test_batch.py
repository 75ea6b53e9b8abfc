"""The batch's per-request state: speculation counters (α counts the drafts verification
reached), draft streams (a row's own stream only where its draft can reach), rows leaving and
joining with their sampling settings, and right-padding."""

from __future__ import annotations

import torch

from specdecode.config import SamplingParams
from specdecode.core.batch import Batch, SpecStats, pad_right

CPU = torch.device("cpu")


def batch_of(*params: SamplingParams) -> Batch:
    seqs = [Batch.new_sequence(i, [1, 2, 3 + i], p, CPU) for i, p in enumerate(params)]
    return Batch(seqs, capacity=32, device=CPU)


def test_stats_count_the_drafts_verification_reached():
    stats = SpecStats()
    stats.record(4, 1)  # rejected at the second draft: two reached
    stats.record(2, 2)  # all accepted: both reached
    stats.record(0, 0)  # no draft: not a round of speculation
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 3)
    assert stats.num_reached_tokens == 4 and stats.accepted_per_position == [2, 1, 0, 0]
    frozen = stats.snapshot()
    stats.record(4, 4)
    assert frozen.accepted_per_position == [2, 1, 0, 0] and frozen.num_drafts == 2


def test_a_row_draws_from_its_own_stream_only_where_its_draft_reaches():
    b = batch_of(*(SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)))
    own = b.generators
    assert b.draft_generators(0) == own
    drafting = torch.tensor([True, False, True])
    got = b.draft_generators(0, drafting)
    assert got[0] is own[0] and got[2] is own[2] and got[1] is not own[1]
    b.draft_limits = [1, 3, 0]
    got = b.draft_generators(1)
    assert got[1] is own[1] and got[0] is not own[0] and got[2] is not own[2]
    assert got[0] is got[2]  # one scratch stream: its draws are cut before verification


def test_rows_leave_and_join_with_their_sampling_settings():
    b = batch_of(SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=5))
    assert not b.all_greedy and b.temperature.tolist() == [0.0, 0.5] and b.top_k.tolist() == [0, 5]
    b.draft_limits = [2, 2]
    b.select_rows([0])
    assert b.all_greedy and len(b) == 1 and b.draft_limits is None  # limits are per step, set again
    rows = b.extend([Batch.new_sequence("new", [9, 8], SamplingParams(temperature=0.5, top_p=0.75), CPU)])
    assert rows == [1] and not b.all_greedy and b.top_p.tolist() == [1.0, 0.75]
    assert b.last_tokens().tolist() == [[3], [8]]
    seq = b.seqs[1]
    seq.token_ids.append(4)
    assert seq.prompt_ids == [9, 8] and seq.output_ids == [4]


def test_pad_right():
    tokens, lengths = pad_right([[5], [1, 2, 3], []], CPU)
    assert tokens.tolist() == [[5, 0, 0], [1, 2, 3], [0, 0, 0]] and lengths.tolist() == [1, 3, 0]
