"""`specdecode train` bad input: one line `error: ...` on stderr, exit code 2, no traceback."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.entrypoints.cli import main
from specdecode.train.trainer import CHECKPOINT_FILE


def run_train(capsys, *argv: str) -> tuple[int, str]:
    code = main(["train", *argv])
    _, err = capsys.readouterr()
    return code, err


@pytest.fixture
def folders(tmp_path, tiny_target, corpus):
    empty_text = tmp_path / "empty_text"
    empty_text.mkdir()
    (empty_text / "blank.txt").write_text("   \n")
    no_text = tmp_path / "no_text"
    no_text.mkdir()
    (no_text / "data.bin").write_bytes(b"\x00\x01")
    other = tmp_path / "other_method"
    other.mkdir()
    torch.save({"method": "eagle", "step": 3}, other / CHECKPOINT_FILE)
    partial = tmp_path / "partial"
    partial.mkdir()
    torch.save({"method": "draft_model", "step": 3}, partial / CHECKPOINT_FILE)  # a foreign file of that name
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({"method": "draft_model", "log": object()}, pickled / CHECKPOINT_FILE)  # weights_only refuses it
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\n{"neither": 1}\n')
    return {"target": tiny_target, "corpus": corpus, "empty_text": str(empty_text), "no_text": str(no_text),
            "blank": "", "bin_file": str(no_text / "data.bin"), "pickled": str(pickled),
            "under_file": str(no_text / "data.bin" / "out"),
            "other": str(other), "partial": str(partial), "bad_jsonl": str(bad_jsonl),
            "out": str(tmp_path / "out")}  # fmt: skip


# per case: the flags it changes (None = left out) and what the error line must say
CASES = {
    "unknown method": ({"--method": "nope"}, "unknown method 'nope' to train; trainable: dflash, draft_model, eagle, eagle3, medusa, mtp"),
    "method without a net": ({"--method": "ngram"}, "has no network to train"),
    "method inheriting a net": ({"--method": "layer_skip"}, "has no network to train"),
    "missing method": ({"--method": None}, "--method is required"),
    "missing data": ({"--data": None}, "--data needs at least one"),
    "data path not found": ({"--data": "/no/such/path"}, "data path not found: /no/such/path"),
    "empty data path": ({"--data": "@blank"}, "--data has an empty path"),  # Path("") is the current folder
    "binary file named": ({"--data": "@bin_file"}, "data.bin is not a text file"),
    "no text files": ({"--data": "@no_text"}, "no text found"),
    "only blank text": ({"--data": "@empty_text"}, "no text found"),
    "bad jsonl record": ({"--data": "@bad_jsonl"}, 'bad.jsonl:2: expected {"text"'),
    "bad net-config JSON": ({"--net-config": "{num_layers: 2"}, "--net-config is not valid JSON"),
    "unknown net key": ({"--net-config": '{"depth": 2}'}, "unknown draft_model net key(s) depth"),
    "bad steps": ({"--steps": "0"}, "--steps must be an integer >= 1"),
    "resume another method": ({"--out": "@other", "--resume": ""}, "holds a checkpoint for method 'eagle', not 'draft_model'"),
    "resume without checkpoint": ({"--resume": ""}, "--resume: no checkpoint.pt"),
    "resume a foreign checkpoint": ({"--out": "@partial", "--resume": ""}, "is not a specdecode training checkpoint"),
    "resume a pickle": ({"--out": "@pickled", "--resume": ""}, "pickled/checkpoint.pt is not a specdecode training"),
    "out holds a drafter": ({"--out": "@other"}, "already holds a trained drafter (checkpoint.pt); --resume continues"),
    "out under a file": ({"--out": "@under_file"}, "cannot be made: Not a directory"),
    "seed past 2**32": ({"--seed": str(2**32)}, "--seed must be an integer in [0, 2**32)"),
    "negative seed": ({"--seed": "-1"}, "--seed must be an integer in [0, 2**32)"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2(capsys, folders, case):
    changes, message = CASES[case]
    flags = {"--method": "draft_model", "--target": "@target", "--data": "@corpus", "--out": "@out",
             "--dtype": "float32", "--device": "cpu", "--steps": "1", **changes}  # fmt: skip
    argv = ["--quiet"]
    for flag, value in flags.items():
        if value is not None:
            argv += [flag] + ([folders[value[1:]] if value.startswith("@") else value] if value else [])
    code, err = run_train(capsys, *argv)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert "Traceback" not in err


def test_cli_trains_and_prints_heldout_metrics(capsys, folders):
    code = main(["train", "--method", "draft_model", "--target", folders["target"], "--data", folders["corpus"],
                 "--out", folders["out"], "--net-config", json.dumps({"num_layers": 1}), "--steps", "4",
                 "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--dtype", "float32",
                 "--device", "cpu", "--quiet"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "held-out start (step 0)" in out and "held-out end (step 4)" in out and "alpha@1" in out


def test_init_refuses_a_net_config_that_reshapes_its_tensors(capsys, folders, tmp_path):
    common = ["--method", "medusa", "--target", folders["target"], "--data", folders["corpus"], "--steps", "1",
              "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--dtype", "float32", "--device", "cpu",
              "--quiet"]  # fmt: skip
    first = str(tmp_path / "first")
    # a top-k logit cache larger than the vocabulary keeps all of it
    code = main(["train", *common, "--out", first, "--net-config", '{"draft_vocab": 0}', "--cache-topk", "100000"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    code, err = run_train(capsys, *common, "--out", str(tmp_path / "second"), "--init", first,
                          "--net-config", '{"draft_vocab": 32}')  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "drop the --net-config keys" in err, err
    # a folder of another method is named as such (its net keys are not this method's)
    eagle = [*common[:1], "eagle", *common[2:]]
    code, err = run_train(capsys, *eagle, "--out", str(tmp_path / "third"), "--init", first)
    assert code == 2 and err.count("\n") == 1 and "holds a drafter for method 'medusa', not 'eagle'" in err, err


def test_the_trainable_methods_are_those_with_a_net():
    from specdecode.train.trainer import trainable_methods

    assert trainable_methods() == ["dflash", "draft_model", "eagle", "eagle3", "medusa", "mtp"]


def test_overwrite_replaces_what_out_holds(capsys, folders):
    common = ["--method", "medusa", "--target", folders["target"], "--data", folders["corpus"], "--steps", "1",
              "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--dtype", "float32", "--device", "cpu",
              "--quiet", "--out", folders["out"]]  # fmt: skip
    assert main(["train", *common]) == 0
    capsys.readouterr()
    code, err = run_train(capsys, *common)  # a second run into the same folder is refused...
    assert code == 2 and "already holds a trained drafter (checkpoint.pt, config.json)" in err, err
    assert main(["train", *common, "--overwrite"]) == 0  # ...unless asked
