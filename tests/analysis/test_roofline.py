"""The roofline reproduces the seed's Llama-3-8B / H100 figures (section 10.6.2)."""

import json

import pytest

from specdecode.config import SpecDecodeError
from specdecode.entrypoints.cli import main
from specdecode.analysis.roofline import HARDWARE, MODELS, Roofline, resolve_hardware


def test_seed_figures():
    r = Roofline(MODELS["llama-3-8b"], HARDWARE["h100"])
    assert r.model.layers * r.model.layer_matrix_params * 2 == pytest.approx(1.396e10, rel=2e-3)
    assert r.model.head_params * 2 == pytest.approx(1.05e9, rel=2e-3)
    assert r.flops_per_position == pytest.approx(1.50e10, rel=3e-3)
    assert r.weight_read_s * 1e3 == pytest.approx(4.79, abs=0.005)
    assert round(r.threshold_positions) == 316
    assert r.compute_s(64 * 5) * 1e3 == pytest.approx(4.85, abs=0.005)
    assert r.compute_s(5) * 1e3 == pytest.approx(0.08, abs=0.005)  # one request, γ = 4: deep in the bandwidth regime
    assert r.step_s(5) == r.weight_read_s and r.step_s(320) > r.weight_read_s


def test_cli_roofline(capsys):
    assert main(["theory", "--model", "llama-3-8b", "--hardware", "h100", "--batch", "64", "--gamma", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert round(r["threshold_positions"]) == 316 and r["positions"] == 320 and not r["verification_free"]
    assert main(["theory", "--model", "llama-3-8b", "--hardware", "h100", "--batch", "63", "--gamma", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verification_free"]


def test_bad_hardware():
    with pytest.raises(SpecDecodeError, match="valid: h100"):
        resolve_hardware("tpu9")
    assert main(["theory"]) == 2


def test_a_folder_with_only_a_config_gives_the_roofline(tmp_path, capsys):
    """The roofline reads the shapes only: a config.json alone (no weights) is enough, and its
    figures equal the built-in Llama-3-8B preset's for the same shapes."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["theory", "--hardware", "h100", "--batch", "64", "--gamma", "4", "--json"]
    assert main([*args, "--model", str(tmp_path)]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert main([*args, "--model", "llama-3-8b"]) == 0
    preset = json.loads(capsys.readouterr().out)
    assert mine["threshold_positions"] == pytest.approx(preset["threshold_positions"])
    assert mine["flops_per_position"] == pytest.approx(preset["flops_per_position"])
