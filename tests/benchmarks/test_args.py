"""The benchmark scripts' command lines (benchmarks/args.py): a bad value is one line `error: ...`
with exit code 2 from argparse, before any model loads; the library's errors are one line too
(`run`), and Ctrl-C exits 130 quietly."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from specdecode.config import SpecDecodeError

BENCH = Path(__file__).parents[2] / "benchmarks"


def _module(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import args, timing, load, bench_core as top-level modules
    spec = importlib.util.spec_from_file_location(f"bench_args_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def args(monkeypatch):
    return _module("args", monkeypatch)


def test_int_types_refuse_what_is_out_of_range(args):
    assert args.positive_int("3") == 3 and args.nonneg_int("0") == 0 and args.decode_tokens("2") == 2
    for parse, bad in ((args.positive_int, "0"), (args.positive_int, "-1"), (args.positive_int, "x"),
                       (args.positive_int, "1.5"), (args.nonneg_int, "-1"), (args.decode_tokens, "1")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be an integer >= .*, got '{bad}'"):
            parse(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="a decode rate"):
        args.decode_tokens("1")


def test_float_types_refuse_what_is_out_of_range(args):
    assert args.nonneg_float("0.7") == 0.7 and args.unit_float("0") == 0.0 and args.unit_float("1") == 1.0
    for bad in ("-0.1", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite number >= 0"):
            args.nonneg_float(bad)
    for bad in ("-0.1", "1.5", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"in \[0, 1\]"):
            args.unit_float(bad)


def test_out_path_needs_its_folder_before_the_run(args, tmp_path):
    assert args.out_path(str(tmp_path / "out.json")) == str(tmp_path / "out.json")
    assert args.out_path("out.json") == "out.json"  # the working directory
    with pytest.raises(argparse.ArgumentTypeError, match="no folder"):
        args.out_path(str(tmp_path / "missing" / "out.json"))


def test_run_gives_library_errors_as_one_line_and_ctrl_c_quietly(args, capsys):
    assert args.run(lambda: 0) == 0

    def bad() -> int:
        raise SpecDecodeError("num_speculative_tokens must be an integer in [1, 32], got 0")

    assert args.run(bad) == 2
    assert capsys.readouterr().err == "error: num_speculative_tokens must be an integer in [1, 32], got 0\n"

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert args.run(interrupted) == 130
    assert capsys.readouterr() == ("", "")

    def broken() -> int:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):  # not bad input: its traceback stays
        args.run(broken)


@pytest.mark.parametrize(
    "script, argv, says",
    [
        ("bench_core", ["--gamma", "0"], "argument --gamma: must be an integer >= 1, got '0'"),
        ("bench_core", ["--max-tokens", "1"], "argument --max-tokens: must be an integer >= 2"),
        ("bench_match", ["--max-tokens", "-1"], "argument --max-tokens: must be an integer >= 1, got '-1'"),
        ("bench_lookahead", ["--configs", "2,5"], "argument --configs: a config is W,N,G"),
        ("bench_lookahead", ["--configs", "2,1,4"], "lookahead_ngram must be an integer in [2, 16]"),
        ("bench_lookahead", ["--kinds", "code"], "argument --kinds: unknown kind 'code'; choose from chat, input_"),
        ("bench_serving", ["--repeats", "0"], "argument --repeats: must be an integer >= 1"),
        ("bench_serving", ["--clients", "4", "0"], "argument --clients: must be an integer >= 1, got '0'"),
        ("bench_serving", ["--clients", "-1"], "argument --clients: must be an integer >= 1, got '-1'"),
        ("bench_quant", ["--modes", "foo"], "argument --modes: 'foo': unsupported quantization 'foo'"),
        ("bench_quant", ["--modes", "int8@stock"], "'int8@stock': @KERNEL goes with int4* or gguf"),
        ("bench_quant", ["--positions", "1,0"], "argument --positions: must be an integer >= 1, got '0'"),
        ("bench_tree", ["--positions", "1"], "argument --positions: must be an integer >= 2"),
        ("bench_tree", ["--max-tokens", "1"], "argument --max-tokens: must be an integer >= 2"),
        ("bench_suffix", ["--prompts", "0"], "argument --prompts: must be an integer >= 1, got '0'"),
        ("bench_auto_gamma", ["--gammas", "2", "0"], "argument --gammas: must be an integer >= 1"),
        ("bench_confidence", ["--confidence-threshold", "2"], "argument --confidence-threshold: must be a number in"),
        ("bench_block", ["--device", "tpu"], "argument --device: must be cpu, cuda or cuda:N, got 'tpu'"),
        ("bench_kernels", ["--rounds", "0"], "argument --rounds: must be an integer >= 1"),
        ("bench_fastpath", ["--threads", "0"], "argument --threads: must be an integer >= 1"),
    ],
)
def test_bad_argv_is_one_line_and_exit_2_before_any_model_loads(script, argv, says, monkeypatch, capsys):
    module = _module(script, monkeypatch)

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    for name in ("LLM", "load_model", "load"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, no_model)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and err.endswith(f"(see {script}.py --help)\n")
    assert says in err


def test_parsed_values_are_what_the_scripts_used_before(monkeypatch):
    lookahead = _module("bench_lookahead", monkeypatch)
    assert lookahead.parse_config("2,5,4,noprompt") == {
        "method": "lookahead", "lookahead_window": 2, "lookahead_ngram": 5, "lookahead_guess": 4,
        "pool_from_prompt": False, "pool_from_output": True,
    }  # fmt: skip
    assert lookahead.config_arg("4,4,4,noprompt,nooutput") == "4,4,4,noprompt,nooutput"  # args.configs keeps the text
    quant = _module("bench_quant", monkeypatch)
    assert quant.modes_arg("none,int8,int4@stock,int4,gguf@stock,gguf,gguf@planes")[-1] == "gguf@planes"
    assert quant.positions_arg("1,2,5,9,16") == [1, 2, 5, 9, 16]


def test_a_closed_loop_with_no_client_is_refused_not_run_forever(monkeypatch):
    load = _module("load", monkeypatch)
    for clients, requests in ((0, 8), (-1, 8), (4, 0)):
        with pytest.raises(ValueError, match="clients >= 1 and num_requests >= 1"):
            load.ClosedLoop(None, [], clients, requests, 8)


class _Reached(Exception):
    """Raised where a script would load a model (or build kernels): its arguments were taken."""


@pytest.mark.parametrize(
    "script, argv",
    [(path.stem, []) for path in sorted(BENCH.glob("bench_*.py"))]
    + [
        ("bench_lookahead", ["--configs", "2,5,4", "4,4,4,noprompt,nooutput", "--kinds", "chat"]),
        ("bench_quant", ["--modes", "none,gguf@planes,int4-g64@stock", "--positions", "1,5", "--new-tokens", "2"]),
        ("bench_serving", ["--clients", "1", "4", "--requests-per-client", "0", "--adaptive-floors", "0.9"]),
        ("bench_tree", ["--positions", "2", "--max-tokens", "2"]),
    ],
)
def test_the_defaults_and_valid_argv_still_parse(script, argv, monkeypatch):
    import torch

    module = _module(script, monkeypatch)

    def reached(*a, **k):
        raise _Reached

    for name in ("LLM", "load_model", "load", "build", "default_model_path"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, reached)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process's threads stay as they are
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(_Reached):
        module.main()
