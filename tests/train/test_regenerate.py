"""Self-distillation data: instructions are deterministic and mixed; answers come from the target."""

from __future__ import annotations

import json

from specdecode.train.regenerate import instructions, main
from tests.tiny import make_tiny_checkpoint


def test_instructions_are_seeded_and_mixed():
    a, b = instructions(30, seed=3), instructions(30, seed=3)
    assert a == b and len(a) == 30 and instructions(30, seed=4) != a
    kinds = [p.split(" ")[0] for p in a]
    assert kinds.count("Write") >= 10 and kinds.count("Summarize") >= 1  # code tasks (plus chat posts), summaries


def test_answers_are_written_as_chat_records(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "t", "llama", seed=0, max_position_embeddings=4096)
    out = tmp_path / "data.jsonl"
    common = ["--target", str(target), "--num", "3", "--max-tokens", "4", "--batch", "2", "--max-prompt-tokens", "2000"]
    assert main([*common, "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in records)
    # shards split the same instructions between parallel runs
    halves = []
    for k in range(2):
        assert main([*common, "--out", str(tmp_path / f"s{k}.jsonl"), "--shard", f"{k}/2"]) == 0
        halves += [json.loads(line) for line in (tmp_path / f"s{k}.jsonl").read_text().splitlines()]
    prompts = sorted(r["messages"][0]["content"] for r in records)
    assert sorted(r["messages"][0]["content"] for r in halves) == prompts
