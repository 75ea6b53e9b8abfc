"""`specdecode audit`: passes on a lossless configuration, and catches a broken verifier (greedy
and sampled) that a user could not see in the output's text."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode import LLM
from specdecode.entrypoints import audit
from specdecode.entrypoints.cli import main
from specdecode.core.sampling import sample
from tests.engine.checks import SAMPLING_PROMPT, sampling_target
from tests.tiny import make_tiny_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = sampling_target(tmp_path_factory.mktemp("audit") / "target")
    return LLM(model=str(path), speculative_config=SPEC, dtype="float32", device="cpu")


def run(llm):
    return audit.run_audit(llm, [SAMPLING_PROMPT, SAMPLING_PROMPT[:5]], [1.0], samples=1500, positions=3, max_tokens=24)


def test_a_lossless_configuration_passes(llm):
    report = run(llm)
    assert report.passed and report.greedy_identical == [True, True]
    assert all(0 < t.detectable_tv < 0.2 for t in report.sampling[1.0])  # the test has power at this size


def accept_every_draft(p, q, draft_tokens, generator=None):
    """A broken verifier: every real draft is accepted, then a bonus token from p."""
    B, width = draft_tokens.shape
    valid = (draft_tokens >= 0).cumprod(dim=1).bool()
    n = valid.sum(dim=1)
    gens = generator if isinstance(generator, list) else [generator] * B
    last = sample(p[torch.arange(B), n], gens)
    out = torch.full((B, width + 1), -1, dtype=torch.long)
    for b in range(B):
        out[b, : n[b]] = draft_tokens[b, : n[b]]
        out[b, n[b]] = last[b]
    return out, n


def test_a_verifier_that_accepts_every_draft_fails(llm, monkeypatch):
    monkeypatch.setattr("specdecode.engine.step.rejection_sample", accept_every_draft)
    report = run(llm)
    assert not report.passed and any(not t.passed for t in report.sampling[1.0])


def test_a_greedy_verifier_that_accepts_every_draft_fails(tmp_path, monkeypatch):
    # an untied target: its greedy output varies, so some drafts are wrong (the sampling one repeats a token)
    path = make_tiny_checkpoint(tmp_path / "t", "llama", 2, tie_word_embeddings=False, num_hidden_layers=4)
    llm = LLM(model=str(path), speculative_config=SPEC, dtype="float32", device="cpu")
    prompts = [[7, 1, 2, 8, 4, 4, 6], [2, 3, 2, 3, 2, 3, 2, 3, 2]]
    assert audit.run_audit(llm, prompts, [], samples=100, positions=1, max_tokens=24).passed

    def accept_all(target_argmax, draft_tokens):
        p = torch.nn.functional.one_hot(target_argmax, llm.target.config.vocab_size).float()
        return accept_every_draft(p, None, draft_tokens)

    monkeypatch.setattr("specdecode.engine.step.greedy_verify", accept_all)
    report = audit.run_audit(llm, prompts, [], samples=100, positions=1, max_tokens=24)
    assert False in report.greedy_identical and not report.passed


def test_the_command_line(llm, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc"}) + "\n")
    monkeypatch.setattr(audit, "run_audit", lambda *a, **k: audit.AuditReport([True], {}))
    args = ["audit", "--speculative-config", json.dumps(SPEC), "--model", llm.target.path, "--prompts", str(prompts),
            "--dtype", "float32", "--json"]  # fmt: skip
    for bad, what in ((["--samples", "0"], "--samples"), (["--prompts", str(tmp_path / "none.jsonl")], "--prompts"),
                      (["--temperatures", "0"], "--temperatures")):  # fmt: skip
        assert main(args + bad) == 2
        assert what in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(args[:-1] + ["--prompts", str(empty)]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["passed"] is True
