"""`specdecode bench` end to end on a tiny model: the table, the JSON's documented fields,
the plots, the user's own prompts, and one line with exit code 2 for bad input."""

from __future__ import annotations

import json

import pytest

from specdecode.entrypoints.bench_prompts import CATEGORIES, build_prompts
from specdecode.entrypoints.cli import main
from tests.tiny import make_tiny_checkpoint

ROW_FIELDS = {"method", "spec", "auto", "category", "temperature", "batch_size", "prompts", "tokens_per_s",
              "plain_tokens_per_s", "speedup", "speedup_min", "speedup_max", "speedup_ci95", "alpha", "tau",
              "acceptance_by_position", "c", "predicted_speedup", "identical"}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("bench") / "target", "llama", seed=0))


def test_every_category_builds_distinct_prompts():
    for category in CATEGORIES:
        prompts = build_prompts([category], 3)
        assert len(prompts) == 3 and {p.category for p in prompts} == {category}
        assert len({p.messages[0]["content"] for p in prompts}) == 3, category
    assert all(p.structured is not None for p in build_prompts(["structured"], 2))


def test_quick_run_writes_table_json_and_plots(tiny, tmp_path, capsys):
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    code = main(["bench", "--model", tiny, "--quick", "--categories", "chat", "math", "--max-tokens", "12",
                 "--methods", "auto", '{"method": "ngram", "num_speculative_tokens": 3}', "--batch-sizes", "1", "2",
                 "--json", str(out), "--plot-dir", str(plots), "--dtype", "float32"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "| chat |" in text and "auto: ngram" in text
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2  # methods × batch sizes × categories
    for r in rows:
        assert ROW_FIELDS <= set(r) and r["identical"] is True and r["speedup"] > 0 and 0 <= r["alpha"] <= 1
    assert {r["method"] for r in rows} == {"auto", '{"method":"ngram","num_speculative_tokens":3}'}
    assert (plots / "speedup.png").stat().st_size > 0 and (plots / "acceptance.png").stat().st_size > 0


def test_own_prompts_and_sampling(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    lines = [{"messages": [{"role": "user", "content": "abc abc abc abc"}], "category": "mine"},
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "xyz xyz"}]},
             {"prompt": "a raw prompt, a raw prompt", "category": "mine"}]  # fmt: skip
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "b.json"
    code = main(["bench", "--model", tiny, "--prompts", str(prompts), "--methods", "ngram", "--temperatures", "0.8",
                 "--max-tokens", "8", "--repeats", "2", "--busy", "0", "1", "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert code == 0 and {(r["category"], r["busy"]): r["prompts"] for r in rows} == {
        ("mine", 0): 2, ("prompts", 0): 1, ("mine", 1): 2, ("prompts", 1): 1}
    assert all(r["identical"] is None and r["temperature"] == 0.8 for r in rows)
    assert "| busy |" in text and "plain decoding beside 1 busy process(es): " in text


def test_categories_file_and_a_named_results_section(tiny, tmp_path, capsys):
    """A JSON object of categories (as benchmarks/prompts_learned.json) is a prompts file too, and
    --section writes its own section of the results page, leaving the others."""
    prompts, page = tmp_path / "p.json", tmp_path / "results.md"
    prompts.write_text(json.dumps({"chat": ["hello there", "what is up"], "code": ["def f(x): return x"]}))
    page.write_text("# Results\n\n<!-- bench:start -->\nkept\n<!-- bench:end -->\n")
    code = main(["bench", "--model", tiny, "--prompts", str(prompts), "--methods", "ngram",
                 'n3={"method": "ngram", "num_speculative_tokens": 3}', "--max-tokens", "6", "--repeats", "1",
                 "--results", str(page), "--section", "learned"])  # fmt: skip
    capsys.readouterr()
    text = page.read_text()
    assert code == 0 and "kept" in text and "<!-- learned:start -->" in text and "| code | ngram |" in text
    assert "| code | n3 |" in text  # a labelled configuration
    assert "## Speculation by category: learned" in text


@pytest.mark.parametrize("argv,says", [
    (["--categories", "poetry"], "unknown category 'poetry'"),
    (["--methods", "eagle9"], "unknown method 'eagle9' for --methods"),
    (["--methods", '{"method": "ngram", "gamma": 2}'], "unknown key(s) gamma"),
    (["--per-category", "0"], "--per-category and --repeats must be >= 1"),
    (["--temperatures", "-1"], "--temperatures must be"),
    (["--batch-sizes", "0"], "--batch-sizes must be >= 1"),
    (["--repeats", "0"], "--per-category and --repeats must be >= 1"),
    (["--busy", "-1"], "--busy must be numbers of processes"),
    (["--section", "My Section"], "--section must be lowercase"),
    (["--prompts", "MISSING"], "cannot read --prompts"),
    (["--prompts", "EMPTY"], "holds no prompt"),
    (["--prompts", "BAD"], "line 1 is not JSON"),
    (["--prompts", "NOMSG"], 'line 1: needs "messages"'),
])  # fmt: skip
def test_bad_input_is_one_line(tiny, tmp_path, capsys, argv, says):
    files = {"MISSING": tmp_path / "missing.jsonl", "EMPTY": tmp_path / "empty.jsonl", "BAD": tmp_path / "bad.jsonl",
             "NOMSG": tmp_path / "nomsg.jsonl"}  # fmt: skip
    files["EMPTY"].write_text("\n")
    files["BAD"].write_text("{nope\n")
    files["NOMSG"].write_text('{"text": "hi"}\n')
    argv = [str(files[a]) if a in files else a for a in argv]
    code = main(["bench", "--model", tiny, *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and says in err and err.count("\n") == 1, err
