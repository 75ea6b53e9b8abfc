"""Tensor parallelism over torch.distributed (gloo, 2 processes, fp32 on CPU): logits equal to the
unsplit model, and greedy speculative output equal to unsplit plain greedy for ngram,
draft_model and eagle, at batch 1 and under continuous batching with joins, preemption and
an abort (the other rank's caches follow rank 0's through every rollback)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specdecode.drafters.registry import parse_spec
from specdecode.engine.serving import ServingEngine
from specdecode.model.loader import load_model
from specdecode.model.quant import parse_quantization
from specdecode.model.shard import Shard, check_tensor_parallel, split_state
from specdecode.model.tensor_parallel import launch
from tests.conformance.builders import method_specs
from tests.conformance.test_conformance import PROMPTS, TARGET
from tests.engine.checks import greedy, serve_all
from tests.tiny import make_tiny_checkpoint


def unsplit(path: str, quantization: str | None = None):
    """The whole model, through the same torch path as the shards (no fused CPU block)."""
    model = load_model(path, dtype="float32", device="cpu", progress=False, quantization=quantization).model
    model.cpu_blocks = None
    return model


def passes(model, tokens: torch.Tensor, paged: bool = False) -> list[torch.Tensor]:
    """Logits of a prefill of all but the last 3 tokens and then of 3 decode steps, on a cache the model made."""
    B, T = tokens.shape
    cache = model.new_cache(B, 32) if not paged else model.new_paged_cache(16, 4)
    if paged:
        for b in range(B):
            cache.add_sequence(b)
        cache.set_batch(list(range(B)))
    out, done = [], 0
    for width in (T - 3, 1, 1, 1):
        if paged:
            cache.reserve([width] * B)
        positions = torch.arange(done, done + width).expand(B, -1)
        out.append(model(tokens[:, done : done + width], positions, cache))
        cache.commit(torch.full((B,), width))
        done += width
    return out


# First in the file: it launches its own worlds, before the module's shared one exists.
@pytest.mark.parametrize("arch", ["llama_untied", "gemma3"])
def test_logits_equal_the_unsplit_model(tmp_path, arch):
    """Biases (kept on rank 0 only), sliding windows, soft-capping, qk-norm, and a vocabulary
    that does not split evenly (127 rows over 2 ranks), on a contiguous and a paged cache."""
    path = str(make_tiny_checkpoint(tmp_path / arch, arch, seed=1, vocab_size=127))
    tokens = torch.randint(4, 127, (2, 9), generator=torch.Generator().manual_seed(0))
    want = passes(unsplit(path), tokens)
    loaded, tp = launch(2, path, dtype="float32", device="cpu")
    try:
        for paged in (False, True):
            got = passes(loaded.model, tokens, paged)
            for g, w in zip(got, want):
                assert g.shape == w.shape
                torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    finally:
        tp.close()


def test_int4_shards_hold_whole_groups_of_the_unsplit_weights(tmp_path):
    """Quantized after the cut, each rank's int4 linears are exactly the unsplit model's int4
    linears restricted to its rows (column-parallel) or its inputs (row-parallel)."""
    path = str(make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=1))
    whole = unsplit(path, "int4")
    ranks = [load_model(path, dtype="float32", device="cpu", progress=False, quantization="int4",
                        shard=Shard(r, 2)).model for r in range(2)]  # fmt: skip

    def columns(lin) -> torch.Tensor:  # the weight, transposed: [in, out], read through the kernel
        return lin(torch.eye(lin.in_features))

    for name in ("attn.o", "mlp.down"):  # row-parallel: each rank holds a slice of the inputs
        full = columns(whole.layers[0].get_submodule(name))
        parts = [columns(m.layers[0].get_submodule(name)) for m in ranks]
        assert torch.equal(torch.cat(parts), full), name
    full = columns(whole.layers[0].mlp.gate_up)  # column-parallel: each rank's gate and up columns
    inter = full.shape[1] // 2
    for r, m in enumerate(ranks):
        got = columns(m.layers[0].mlp.gate_up)
        half = inter // 2
        want = torch.cat((full[:, r * half : (r + 1) * half], full[:, inter + r * half : inter + (r + 1) * half]), 1)
        assert torch.equal(got, want)


def test_split_state_cuts_whole_heads():
    """Each rank's q/k/v rows are its own heads, in order; the ranks' pieces make the whole."""
    from specdecode.model.model_config import ModelConfig

    cfg = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=6, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=2, max_position_embeddings=16)  # fmt: skip
    qkv = torch.arange((4 + 2 * 2) * 2, dtype=torch.float32)[:, None].expand(-1, 8)  # row i holds i
    state = {"layers.0.attn.qkv.weight": qkv, "lm_head.weight": torch.arange(10.0)[:, None].expand(-1, 8)}
    parts = [split_state(cfg, state, Shard(r, 2)) for r in range(2)]
    rows = [p["layers.0.attn.qkv.weight"][:, 0].tolist() for p in parts]
    assert rows[0] == [0, 1, 2, 3, 8, 9, 12, 13]  # q heads 0-1, k head 0, v head 0
    assert rows[1] == [4, 5, 6, 7, 10, 11, 14, 15]
    assert [p["lm_head.weight"][:, 0].tolist() for p in parts] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(Exception, match="does not divide"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(Exception, match="whole int4 groups"):
        check_tensor_parallel(cfg, 2, parse_quantization("int4"))
    with pytest.raises(Exception, match="load the .gguf with --quantization none"):
        check_tensor_parallel(cfg, 2, parse_quantization("gguf"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    arch, overrides = TARGET["arch"], {k: v for k, v in TARGET.items() if k != "arch"}
    path = str(make_tiny_checkpoint(root / "target", arch, **overrides))
    loaded, tp = launch(2, path, dtype="float32", device="cpu")
    yield root, path, loaded
    tp.close()


def run(engine: ServingEngine, prompts: list[list[int]], lengths: list[int], abort_at: int | None = None,
        accepted: list[int] | None = None) -> list[list[int]]:  # fmt: skip
    return serve_all(engine, prompts, [greedy(n) for n in lengths], abort_at, accepted)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_greedy_speculative_equals_unsplit_plain(world, method):
    root, path, loaded = world
    plain = load_model(path, dtype="float32", device="cpu", progress=False)
    spec = parse_spec(method_specs(method, root / method, path)["default"])
    want = [run(ServingEngine(plain, None, max_model_len=64), [p], [24])[0] for p in PROMPTS]
    # batch 1, then all together
    engine, accepted = ServingEngine(loaded, spec, max_model_len=64), []
    assert [run(engine, [p], [24], accepted=accepted)[0] for p in PROMPTS] == want
    assert run(engine, PROMPTS, [24] * len(PROMPTS), accepted=accepted) == want
    assert sum(accepted) > 0, "no draft was accepted: the accept path never ran"
    assert engine.stats().kv_blocks_used == 0
    # continuous batching through a pool of about one sequence: joins, preemption, an abort
    prompts = PROMPTS + [[4, 4, 4, 4], [9, 8, 7, 6, 5, 4, 3]]
    lengths = [20, 7, 33, 25, 12, 18]
    want = [run(ServingEngine(plain, None, max_model_len=64), [p], [n])[0] for p, n in zip(prompts, lengths)]
    per_seq = -(-(64 + ServingEngine(loaded, spec, max_model_len=64, block_size=4).round_room) // 4)
    engine = ServingEngine(loaded, spec, max_model_len=64, max_num_seqs=6, block_size=4, num_blocks=per_seq + 2)
    got = run(engine, prompts, lengths, abort_at=6)
    assert [g for i, g in enumerate(got) if i != 2] == [w for i, w in enumerate(want) if i != 2]
    assert engine.stats().num_preempted_total > 0
    assert engine.stats().kv_blocks_used == 0


def test_generate_and_serve_refuse_a_size_that_does_not_divide_the_heads(world):
    _, path, _ = world
    cases = [(cmd, size, says) for cmd in (["generate", "Hi"], ["serve", "--port", "0"])
             for size, says in (("3", "does not divide the model's 4 attention heads"), ("0", "must be >= 1"))]
    for cmd, size, says in cases:
        out = subprocess.run([sys.executable, "-m", "specdecode.entrypoints.cli", *cmd, "--model", path,
                              "--tensor-parallel-size", size], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_layer_skip_is_refused_on_a_split_model(world):
    """It would run the target's own first layers, which a split model holds in pieces."""
    from specdecode.config import SpecDecodeError

    _, _, loaded = world
    with pytest.raises(SpecDecodeError, match="layer_skip runs the target's first layers"):
        ServingEngine(loaded, parse_spec({"method": "layer_skip"}), max_model_len=64)
