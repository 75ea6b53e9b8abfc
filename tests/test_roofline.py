"""The roofline reproduces the seed's Llama-3-8B / H100 figures (section 10.6.2)."""

import json

import pytest

from specdecode.config import SpecDecodeError
from specdecode.entrypoints.cli import main
from specdecode.roofline import HARDWARE, MODELS, Roofline, resolve_hardware


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
