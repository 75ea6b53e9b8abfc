"""Self-distillation data: instructions are deterministic and mixed; answers come from the target."""

from __future__ import annotations

import json

import pytest

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
    common = ["--target", str(target), "--num", "3", "--max-tokens", "4", "--batch", "2", "--max-prompt-tokens", "2000",
              "--device", "cpu", "--dtype", "float32"]  # fmt: skip
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


def test_a_bad_dtype_or_device_is_one_line(tmp_path, capsys):
    target = make_tiny_checkpoint(tmp_path / "t", "llama", seed=0)
    capsys.readouterr()  # the checkpoint writer's progress bar
    for flag, value in (("--dtype", "float64"), ("--device", "tpu")):
        assert main(["--target", str(target), "--num", "1", "--out", str(tmp_path / "o.jsonl"), flag, value]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err and value in err


def test_instructions_keep_clear_of_the_benchmark_prompts():
    """No instruction mentions a benchmark prompt's subject, and none is a benchmark prompt."""
    from pathlib import Path

    from specdecode.train.instructions import chat_questions, names_held_out

    made = instructions(3000, seed=1) + chat_questions()
    assert not [p for p in made if names_held_out(p.split("\n")[0])]  # the instruction line; quoted texts are docs
    bench = Path(__file__).parents[2] / "benchmarks"
    prompts = {p for f in ("prompts.json", "prompts_learned.json")
               for ps in json.loads((bench / f).read_text()).values() for p in ps}  # fmt: skip
    assert not prompts & set(made)
    learned = [p for ps in json.loads((bench / "prompts_learned.json").read_text()).values() for p in ps]
    assert all(names_held_out(p) for p in learned)  # HELD_OUT names a subject of each learned-drafter prompt


def test_code_tasks_near_a_benchmark_code_prompt_are_held_out():
    """A request for Python that shares a benchmark code prompt's code without naming its subject is
    held out; the same words outside a code request, and unrelated code tasks, are not."""
    from specdecode.train.instructions import names_held_out

    near = [
        "Write a Python script to create a dictionary where each key is a word and the value is its frequency.",
        "Write a Python function that returns the input string with all the punctuation removed.",
        "Write a Python function that takes a list of words and returns the number of occurrences of each word.",
        "Write a Python class with deposit and withdraw methods.",
        "Write a Python script that reads a text file and prints its lines in reverse order.",
    ]
    apart = [
        "Tell me five fun facts about the history of banking.",  # not code
        "How many words should a cover letter have?",  # the word rule, outside code
        "Write a Python function that checks whether parentheses in a string are balanced.",
        "Write a Python function that finds the most frequent element in a list.",
        "Write a Python function `str(val)`. Convert float to string, taking the locale into account.",
    ]
    assert [names_held_out(t) for t in near] == [True] * len(near)
    assert [names_held_out(t) for t in apart] == [False] * len(apart)


def test_passages_become_texts_to_summarise(tmp_path):
    from specdecode.train.regenerate import read_passages

    story = "The village held its harvest festival on Saturday. " * 10
    path = tmp_path / "answers.jsonl"
    code = "Here it is:\n```python\ndef f():\n    return 1\n```\n" + "x " * 200
    records = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": t}]} for t in (story, code)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"messages": [{"ro')  # a run stopped mid-line
    assert read_passages([str(path)]) == [story]  # prose only; the torn last line is skipped
    made = instructions(60, seed=2, passages=read_passages([str(path)]))
    assert sum(story.strip() in p for p in made) == 1


def test_a_new_run_skips_the_instructions_earlier_runs_answered():
    from specdecode.train.regenerate import new_instructions

    earlier = set(instructions(200, seed=5))
    made = new_instructions(100, seed=5, passages=[], answered=earlier)
    assert len(made) == 100 and not earlier & set(made)
    kinds = [p.split(" ")[0] for p in made]
    assert kinds.count("Summarize") >= 10  # still a mix


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    out = str(tmp_path / "data.jsonl")
    assert main(["--out", out, "--exclude", str(tmp_path / "no.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: chat records not found: {tmp_path / 'no.jsonl'}\n"
    assert main(["--out", out, "--target", str(tmp_path / "no_model"), "--num", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    for flags, words in ((["--num", "-5"], "--num must be an integer >= 1, got -5"),
                         (["--threads", "0"], "--threads must be an integer >= 1, got 0"),
                         (["--max-tokens", "0"], "--max-tokens must be"), (["--shard", "2/2"], "--shard must be K/N")):  # fmt: skip
        assert main(["--out", out, *flags]) == 2  # before any model loads
        err = capsys.readouterr().err
        assert err.startswith(f"error: {words}") and err.count("\n") == 1, err



def test_bad_records_and_outputs_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "data.jsonl")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    (tmp_path / "strings.jsonl").write_text('{"messages": ["hi"]}\n')
    for name in ("list.jsonl", "strings.jsonl"):
        assert main(["--out", out, "--exclude", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / name}:1: expected a chat record") and err.count("\n") == 1, err
    assert main(["--out", str(tmp_path), "--num", "1"]) == 2  # a folder, refused before the model loads
    assert capsys.readouterr().err == f"error: --out {tmp_path} is a folder; name the file to write\n"


def test_odd_bytes_empty_shards_and_long_limits(tmp_path, capsys):
    from specdecode.train.regenerate import read_passages

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"messages": [{"role": "assistant", "content": "caf\xe9 au lait"}]}\n')
    assert read_passages([str(latin1)]) == ["caf\ufffd au lait"]  # replaced, as the trainer reads text
    target = str(make_tiny_checkpoint(tmp_path / "t", "llama", seed=0, max_position_embeddings=4096))
    capsys.readouterr()
    out = tmp_path / "s.jsonl"
    common = ["--target", target, "--max-tokens", "2", "--device", "cpu", "--dtype", "float32"]
    assert main([*common, "--num", "1", "--shard", "1/2", "--out", str(out)]) == 0  # nothing in this shard
    assert out.read_text() == "" and "wrote 0 chat records" in capsys.readouterr().err
    assert main([*common, "--num", "1", "--max-prompt-tokens", "5000", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --max-prompt-tokens + --max-tokens = 5002 does not fit") and err.count("\n") == 1


def test_an_answered_file_is_kept_and_flags_are_one_line(tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    out.write_text('{"messages": [{"role": "user", "content": "precious"}]}\n')
    assert main(["--out", str(out), "--num", "1"]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} holds records already; --overwrite") and err.count("\n") == 1, err
    assert "precious" in out.read_text()
    new = ["--out", str(tmp_path / "new.jsonl")]
    assert main([*new, "--temperature", "nan"]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err.startswith("error: temperature") and err.count("\n") == 1, err
    for flags in (["--num", "abc"], ["--bogus"]):  # argparse's own errors: one line too
        with pytest.raises(SystemExit) as stop:
            main([*new, *flags])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


def test_magpie_keeps_the_targets_own_requests_that_ended_and_are_new():
    """Requests the target writes after the user turn's prefix: held-out subjects, repeats,
    unfinished or near-empty ones and those already answered are dropped and drawn again."""
    from types import SimpleNamespace

    from specdecode.config import SamplingParams
    from specdecode.train.regenerate import sample_instructions

    first = [("Why do cats purr?", "stop"), ("Tell me about tides.", "stop"), ("tell me  about TIDES.", "stop"),
             ("An unfinished request that", "length"), ("Hi", "stop"), ("What is compound interest?", "stop")]
    first += [(f"Plan a hike number {i}", "stop") for i in range(4)]  # the first draw: 2 + 0 + 8 requests
    script = iter(first + [("Explain rainbows, please.", "stop")] + [("Spare " + "x" * i, "stop") for i in range(20, 40)])  # fmt: skip

    class Stub:
        def __init__(self):
            self.calls = []

        def encode_chat(self, message):
            return [1, 2, 3] + [ord(c) for c in message] + [4]

        def stream(self, prompts, params):
            self.calls.append((prompts, params))
            for i, (_, (text, reason)) in reversed(list(enumerate(zip(prompts, script)))):  # any order
                yield SimpleNamespace(index=i, new_token_ids=[ord(c) for c in text], finish_reason=reason)

        def decode(self, ids):
            return "".join(map(chr, ids))

    stub = Stub()
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16)
    kept = sample_instructions(stub, 2, seed=7, skip={"what is compound interest?"}, params=params)
    assert kept == ["Tell me about tides.", "Explain rainbows, please."] and len(stub.calls) == 2  # drawn again
    (prompts, draws), = stub.calls[:1]
    assert all(p == [1, 2, 3] for p in prompts)  # the chat up to the user's message only
    seeds = [d.seed for _, ds in stub.calls for d in ds]
    assert len(set(seeds)) == len(seeds) and all(d.temperature == 0.8 and d.max_tokens == 16 for d in draws)


def test_the_user_turn_prefix_starts_every_chat(tmp_path):
    from specdecode import LLM
    from specdecode.train.regenerate import user_turn_prefix

    target = make_tiny_checkpoint(tmp_path / "t", "llama", seed=0)
    llm = LLM(model=str(target), device="cpu", dtype="float32", speculative_config=None)
    prefix = user_turn_prefix(llm)
    for message in ("Hello", "?", "Why is the sea salty?", "  spaced"):
        ids = llm.encode_chat(message)
        assert ids[: len(prefix)] == prefix and len(ids) > len(prefix)
    text = llm.tokenizer.decode(prefix)
    assert text == llm.tokenizer.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False).split("X")[0]


def test_magpie_flags_are_checked_before_the_model_loads(tmp_path, capsys):
    out = str(tmp_path / "data.jsonl")
    passages = tmp_path / "p.jsonl"
    passages.write_text("")
    assert main(["--out", out, "--instructions", "magpie", "--passages", str(passages)]) == 2
    assert capsys.readouterr().err.startswith("error: --passages are texts for templated summaries")
    assert main(["--out", out, "--instructions", "magpie", "--instruction-max-tokens", "0"]) == 2
    assert capsys.readouterr().err == "error: --instruction-max-tokens must be an integer >= 1, got 0\n"
    assert main(["--out", out, "--instruction-start", "Write a Python"]) == 2
    assert capsys.readouterr().err.startswith("error: --instruction-start opens requests the target writes")
    assert main(["--out", out, "--instructions", "magpie", "--instruction-top-p", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "top_p" in err and err.count("\n") == 1, err


def test_magpie_requests_can_open_with_given_words():
    from types import SimpleNamespace

    from specdecode.config import SamplingParams
    from specdecode.train.regenerate import sample_instructions

    class Stub:
        def __init__(self):
            self.prompts = []

        def encode_chat(self, message):
            return [1, 2, 3] + [ord(c) for c in message] + [4]

        def tokenizer(self, text, add_special_tokens=True):
            return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}

        def stream(self, prompts, params):
            self.prompts += prompts
            for i in range(len(prompts)):
                yield SimpleNamespace(index=i, new_token_ids=[ord(c) for c in f" function number {i}."],
                                      finish_reason="stop")  # fmt: skip

        def decode(self, ids):
            return "".join(map(chr, ids))

    stub = Stub()
    kept = sample_instructions(stub, 2, 0, set(), SamplingParams(max_tokens=8), start="Write a Python")
    assert kept == ["Write a Python function number 0.", "Write a Python function number 1."]
    assert stub.prompts[0] == [1, 2, 3] + [ord(c) for c in "Write a Python"]  # no BOS inside the turn
