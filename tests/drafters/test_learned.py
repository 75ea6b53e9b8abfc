"""What every learned drafter shares: the target features it is owed between rounds, the
training heads' row buckets, and its folder (written whole, read back with one-line errors
for a missing, malformed or foreign folder and unknown net keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from specdecode.config import SpecDecodeError
from specdecode.drafters.learned import PendingFeatures, label_rows, net_config, read_net_config, write_whole


def features(n: int, start: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 2)  # [n, F = 2]


def test_pending_features_are_taken_once_each_and_follow_their_rows():
    pending = PendingFeatures()
    pending.add_rows([features(3, 0), features(1, 10)])
    taken, starts = pending.take(leave=1)  # a prompt's features but each row's newest
    assert [t[:, 0].tolist() for t in taken] == [[0, 1], []] and starts == [0, 0]
    pending.add_verified(torch.stack([features(3, 3), features(3, 11)]), torch.tensor([1, 0]))  # [B, W, F]
    taken, starts = pending.take()
    assert [t[:, 0].tolist() for t in taken] == [[2, 3, 4], [10, 11]] and starts == [2, 0]
    pending.add_rows([features(2, 20)])
    pending.select_rows([2, 0])  # the second row left
    assert pending.consumed == [0, 5] and [len(r) for r in pending.rows] == [2, 0]
    taken, starts = pending.take([0])
    assert taken[0][:, 0].tolist() == [20, 21] and starts == [0] and pending.consumed == [2, 5]


def test_label_rows_pads_to_a_few_shapes():
    where = torch.tensor([[False, True, True], [True, False, False]])
    rows = label_rows(where, bucket=4)
    assert rows.tolist() == [1, 2, 3, 1]  # the three labels, then the first repeated
    assert label_rows(torch.zeros(2, 3, dtype=torch.bool), bucket=4).numel() == 0
    assert label_rows(torch.ones(1, 4, dtype=torch.bool), bucket=4).tolist() == [0, 1, 2, 3]


def test_a_folder_is_written_whole(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_text("old")

    def fails(part):
        part.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_whole(file, fails)
    assert file.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    write_whole(file, lambda part: part.write_text("new"))
    assert file.read_text() == "new"


@pytest.mark.parametrize(
    "content,message",
    [(None, "is not a trained drafter folder"), ("{not json", "is not valid JSON"), ("[1]", "must hold a JSON object"),
     ('{"specdecode_method": "medusa"}', "holds a drafter for method 'medusa', not 'eagle'")],
)  # fmt: skip
def test_a_bad_folder_is_one_line(tmp_path, content, message):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(SpecDecodeError, match=message) as e:
        read_net_config(tmp_path, "eagle")
    assert "\n" not in str(e.value)


@dataclass(frozen=True)
class _Config:
    num_layers: int = 1


class _Net:
    Config = _Config
    method = "toy"


def test_net_keys_are_checked_by_name():
    assert net_config(_Net, {"num_layers": 2}) == _Config(2)
    with pytest.raises(SpecDecodeError, match="unknown toy net key.* layers; valid: num_layers"):
        net_config(_Net, {"layers": 2})
    with pytest.raises(SpecDecodeError, match="must be a JSON object"):
        net_config(_Net, json.loads("[2]"))
