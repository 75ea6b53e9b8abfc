"""The CLI contract: `generate` streams text and stats, `--json` is machine-readable,
`theory` reproduces the seed's table, and bad input is one line with exit code 2."""

from __future__ import annotations

import json

import pytest

from specdecode.entrypoints.cli import main
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {
        "target": str(make_tiny_checkpoint(root / "target", "llama", seed=0)),
        "other_vocab": str(make_tiny_checkpoint(root / "other", "llama", seed=1, vocab_size=200)),
    }


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("alpha,gamma,tokens,speedup", [(0.6, 4, 2.31, 1.92), (0.8, 4, 3.36, 2.80), (0.8, 8, 4.33, 3.09), (0.9, 4, 4.10, 3.41)])
def test_theory_table(capsys, alpha, gamma, tokens, speedup):
    code, out, _ = run(capsys, "theory", "--alpha", str(alpha), "--gamma", str(gamma), "--json")
    r = json.loads(out)
    assert code == 0 and round(r["tokens_per_round"], 2) == tokens and round(r["speedup"], 2) == speedup
    code, out, _ = run(capsys, "theory", "--alpha", str(alpha), "--gamma", str(gamma))
    assert f"{speedup:.2f}x" in out


def test_theory_cost_and_optimal_gamma(capsys):
    code, out, _ = run(capsys, "theory", "--alpha", "0.8", "--gamma", "4", "--c", "0.2", "--json")
    assert round(json.loads(out)["speedup"], 2) == 1.87
    code, out, _ = run(capsys, "theory", "--alpha", "0.6", "--json")
    r = json.loads(out)
    assert r["optimal_gamma"] and r["gamma"] == 4


def test_theory_both_models_at_once_and_bad_numbers(capsys):
    code, out, _ = run(capsys, "theory", "--alpha", "0.8", "--gamma", "4", "--model", "llama-3-8b", "--hardware",
                       "h100", "--json")  # fmt: skip
    r = json.loads(out)
    assert code == 0 and round(r["speedup"]["speedup"], 2) == 2.80 and r["roofline"]["positions"] == 64 * 5
    for argv in (["--alpha", "0.8", "--c", "nan"], ["--model", "llama-3-8b", "--c", "-1"]):
        code, _, err = run(capsys, "theory", *argv)
        assert code == 2 and err.startswith("error: --c must be") and err.count("\n") == 1, err
    code, out, err = run(capsys, "theory", "--alpha", "0.8", "--model", "/no/such/model")
    assert code == 2 and out == "" and err.startswith("error: model path not found")  # no formula printed first
    huge = str(10**400)  # overflowed the float formula with a traceback (exit 1)
    for argv, says in ((["--alpha", "0.5", "--gamma", huge], "gamma must be in [0, "),
                       (["--alpha", "1", "--gamma", huge], "gamma must be in [0, "),
                       (["--model", "llama-3-8b", "--batch", huge], "--batch must be in [1, "),
                       (["--model", "llama-3-8b", "--gamma", "-1"], "--batch must be in [1, ")):  # fmt: skip
        code, _, err = run(capsys, "theory", *argv)
        assert code == 2 and err.startswith(f"error: {says}") and err.count("\n") == 1, err
    code, out, _ = run(capsys, "theory", "--alpha", "0.8", "--gamma", "0", "--json")  # plain decoding, as the roofline's
    assert code == 0 and json.loads(out)["speedup"] == 1.0
    with pytest.raises(SystemExit) as exit_:  # argparse's own errors: one line too
        main(["theory", "--alpha", "x"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: argument --alpha") and err.count("\n") == 1, err


def test_generate_json_compare(capsys, tiny):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    code, out, err = run(
        capsys, "generate", "abcabcabc", "--model", tiny["target"], "--speculative-config", spec,
        "--max-tokens", "20", "--dtype", "float32", "--compare", "--json", "--ignore-eos",
    )
    assert code == 0, err
    r = json.loads(out)
    assert len(r["token_ids"]) == 20 and r["identical"] is True
    for key in ("text", "metrics", "tokens_per_s", "baseline_tokens_per_s", "speedup"):
        assert key in r
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
            "mean_accepted_length", "acceptance_rate"} <= set(r["metrics"])


def test_generate_streams_text_then_stats(capsys, tiny):
    spec = json.dumps({"method": "ngram", "prompt_lookup_min": 1})
    code, out, err = run(capsys, "generate", "hello", "--model", tiny["target"], "--speculative-config", spec,
                         "--max-tokens", "8", "--dtype", "float32")
    assert code == 0
    assert out.strip()  # the text
    assert "acceptance rate" in err and "tokens/s" in err and "acceptance by position" in err


def test_streamed_text_stops_before_a_stop_string(capsys, tiny):
    """What `generate` prints is the --json text: the stop string and what follows never show."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    argv = ["generate", "0123456789", "--model", tiny["target"], "--speculative-config", spec,
            "--max-tokens", "24", "--dtype", "float32", "--ignore-eos"]  # fmt: skip
    full = json.loads(run(capsys, *argv, "--json")[1])["text"]
    stop = full.strip()[len(full.strip()) // 2 :][:2]
    assert len(stop) == 2, full
    cut = json.loads(run(capsys, *argv, "--json", "--stop", stop)[1])["text"]
    code, out, _ = run(capsys, *argv, "--stop", stop)
    assert code == 0 and out == cut + "\n" and stop not in out


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--speculative-config", "{bad json"], "not valid JSON"),
        (["--speculative-config", '{"method": "nope"}'], "unknown speculative method 'nope'; valid: dflash, draft_model, eagle"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "num_speculative_tokens"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 33}'], "num_speculative_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--model", "/no/such/model"], "not found"),
        (["--compile", "--compile-mode", "fast"], "unknown compile mode 'fast'; supported: auto, none, default"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, tiny, extra, match):
    argv = ["generate", "hi", "--max-tokens", "4", "--dtype", "float32"]
    if "--model" not in extra:
        argv += ["--model", tiny["target"]]
    code, out, err = run(capsys, *argv, *extra)
    assert code == 2
    assert match in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")


def test_draft_with_other_vocabulary_is_refused(capsys, tiny):
    spec = json.dumps({"method": "draft_model", "model": tiny["other_vocab"]})
    code, _, err = run(capsys, "generate", "hi", "--model", tiny["target"], "--speculative-config", spec, "--dtype", "float32")
    assert code == 2 and "vocabulary" in err and len(err.strip().splitlines()) == 1


def test_prompt_longer_than_context(capsys, tiny):
    from specdecode import LLM

    ctx = LLM(model=tiny["target"], dtype="float32", speculative_config=None).max_model_len
    code, _, err = run(capsys, "generate", "a" * (ctx + 10), "--model", tiny["target"], "--dtype", "float32")
    assert code == 2 and "context" in err


def test_a_reader_that_leaves_stops_generate_quietly(tiny):
    """`specdecode generate ... | head -c 1`: the pipe closes under the streamed text; the
    command stops with 141 (128 + SIGPIPE, as a shell reports it) and no traceback."""
    import subprocess
    import sys

    argv = [sys.executable, "-c", "import sys; from specdecode.entrypoints.cli import main; sys.exit(main())",
            "generate", "hi", "--model", tiny["target"], "--dtype", "float32", "--max-tokens", "32"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first token
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()
