"""The fused CPU block (model/cpu_block.py + kernels/block_*.c): it computes what the torch
blocks compute, it is bitwise batch-invariant (alone, in a chain, a tree, a padded batch, any
cache), and it runs only where it applies; for every build of our library the host CPU runs."""

from __future__ import annotations

import pytest
import torch

from specdecode.model.cpu_block import MAX_POSITIONS
from specdecode.model.cpu_int4 import CPU_ISAS, cpu_lib
from specdecode.model.loader import load_model
from specdecode.model.quant import Int4Linear, describe_kernels, quantize_model_
from tests.tiny import make_tiny_checkpoint, root_path, small_tree

pytestmark = pytest.mark.skipif(cpu_lib() is None, reason="needs our kernels (AVX512-BF16 or AVX2, and a C compiler)")
BUILDS = [isa for isa in CPU_ISAS if cpu_lib(isa) is not None]  # an AVX512 CPU runs two, one with AMX all three


def tiny(tmp_path_factory, arch: str, dtype: str = "bfloat16", quant: str = "int4", isa: str = "auto", **config):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("cb") / arch, arch, seed=3, **config)
    return quantize_model_(load_model(str(path), dtype=dtype, device="cpu").model, quant, int4_kernel=isa)


@pytest.fixture(scope="module", params=[(w, isa) for isa in BUILDS for w in ("int4", "bf16", "int4-d64-g4", "int4-a8")],
                ids=lambda p: "-".join(p))  # fmt: skip
def model(request, tmp_path_factory):
    """Our int4 linears, plain bf16 weights (read in place by our bf16 GEMM), or int4 times int8
    activations; "d64" has head_dim 64 and 4 query heads per kv head, so RoPE's 16-lane loop
    and wider groups run."""
    weights, isa = request.param
    wide = dict(head_dim=64, num_attention_heads=4, num_key_value_heads=1) if "d64" in weights else {}
    quant = {"bf16": "none", "int4-a8": "int4-a8"}.get(weights, "int4")
    m = tiny(tmp_path_factory, "llama", quant=quant, isa=isa, **wide)
    if quant == "none":
        m.use_cpu_blocks(isa)  # bf16 weights: any build runs them
    assert m.cpu_blocks is not None and m.cpu_blocks.isa == isa
    return m


class torch_blocks:
    """Within this context the model runs its torch blocks (the reference)."""

    def __init__(self, model):
        self.model, self.saved = model, model.cpu_blocks

    def __enter__(self):
        self.model.cpu_blocks = None

    def __exit__(self, *exc):
        self.model.cpu_blocks = self.saved


def paged(model, lengths: list[int], prompts: torch.Tensor, room: int):
    """A paged cache holding ``prompts[b, :lengths[b]]`` for each row, with ``room`` more slots reserved."""
    cache = model.new_paged_cache(64, 4)
    for b in range(len(lengths)):
        cache.add_sequence(b)
    for b, n in enumerate(lengths):
        cache.set_batch([b])
        cache.reserve([n])
        model(prompts[b : b + 1, :n], torch.arange(n)[None], cache)
        cache.commit([n])
    cache.set_batch(list(range(len(lengths))))
    cache.reserve([room] * len(lengths))
    return cache


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def slack(model) -> float:
    """How far apart two bf16 roundings may take fused and torch blocks: int8 activations turn
    a last-bit difference of an input into a different int8 step now and then (x3)."""
    qkv = model.layers[0].attn.qkv
    return 3.0 if isinstance(qkv, Int4Linear) and qkv.a8 else 1.0


@torch.inference_mode()
def test_matches_torch_blocks_on_prefill_decode_and_trees(model):
    torch.manual_seed(0)
    toks = torch.randint(3, 120, (1, 24))
    outs = {}
    for name in ("fused", "torch"):
        with torch_blocks(model) if name == "torch" else torch.inference_mode():
            cache = model.new_cache(1, 64)
            pre = model(toks[:, :16], torch.arange(16)[None], cache)
            cache.commit(torch.tensor([16]))
            chain = model(toks[:, 16:20], 16 + torch.arange(4)[None], cache)
            mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)[None]
            tree = model(toks[:, 20:24], 16 + torch.tensor([[0, 1, 1, 2]]), cache, block_mask=mask)
            outs[name] = (pre, chain, tree)
    for fused, ref in zip(outs["fused"], outs["torch"]):
        assert rel(fused, ref) < 0.03 * slack(model)  # bf16 rounding in a different order, nothing more
        top2 = ref.topk(2, dim=-1).values
        clear = top2[..., 0] - top2[..., 1] > 0.25  # no near-tie that a rounding may flip
        assert clear.any() and torch.equal(fused.argmax(-1)[clear], ref.argmax(-1)[clear])


@torch.inference_mode()
def test_batch_invariant_without_being_asked(model):
    """Rows of different lengths on a paged cache, a chain pass of 5, then the same tokens one at
    a time, and one row alone: the same bits every time."""
    torch.manual_seed(1)
    toks = torch.randint(3, 120, (3, 30))
    lengths = [9, 14, 6]
    new = torch.stack([toks[b, n : n + 5] for b, n in enumerate(lengths)])
    pos = torch.tensor(lengths)[:, None] + torch.arange(5)
    together = model(new, pos, paged(model, lengths, toks, 5))
    cache = paged(model, lengths, toks, 5)
    steps = []
    for t in range(5):
        cache.reserve([1, 1, 1])
        steps.append(model(new[:, t : t + 1], pos[:, t : t + 1], cache))
        cache.commit([1, 1, 1])
    assert torch.equal(together, torch.cat(steps, dim=1))
    alone = model(new[1:2], pos[1:2], paged(model, lengths[1:2], toks[1:2], 5))
    assert torch.equal(alone, together[1:2])
    contiguous = model.new_cache(1, 64)
    model(toks[1:2, :14], torch.arange(14)[None], contiguous)
    contiguous.commit(torch.tensor([14]))
    assert torch.equal(model(new[1:2], pos[1:2], contiguous), alone)


@torch.inference_mode()
def test_tree_nodes_equal_their_paths(model):
    torch.manual_seed(2)
    prompt = torch.randint(3, 120, (1, 10))
    tokens, parents, depth, mask = small_tree()
    cache = paged(model, [10], prompt, 6)
    tree = model(tokens, 10 + depth, cache, block_mask=mask[None])
    for node in (4, 5):
        path = root_path(node, parents)
        chain = model(tokens[:, path], 10 + torch.arange(len(path))[None], paged(model, [10], prompt, 6))
        assert torch.equal(chain[0, -1], tree[0, node])


@torch.inference_mode()
def test_padded_pass_computes_the_real_tokens_only(model):
    torch.manual_seed(3)
    toks = torch.randint(3, 120, (2, 20))
    lengths = [8, 11]
    new = torch.stack([toks[b, n : n + 4] for b, n in enumerate(lengths)])
    pos = torch.tensor(lengths)[:, None] + torch.arange(4)
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    padded = model(new, pos, paged(model, lengths, toks, 4), valid=valid)
    full = model(new, pos, paged(model, lengths, toks, 4))
    assert torch.equal(padded[valid], full[valid])
    assert not padded[~valid].any()


@torch.inference_mode()
def test_hidden_states_and_embeds_input(model):
    torch.manual_seed(4)
    toks = torch.randint(3, 120, (1, 12))
    embeds = model.embed(toks)
    before = embeds.clone()
    logits, (h0, last) = model(None, torch.arange(12)[None], model.new_cache(1, 32), hidden_layers=(0, -1), embeds=embeds)
    assert torch.equal(embeds, before)  # the kernel works on its own copy of the stream
    with torch_blocks(model):
        ref, (r0, rlast) = model(None, torch.arange(12)[None], model.new_cache(1, 32), hidden_layers=(0, -1), embeds=embeds)
    assert rel(h0.float(), r0.float()) < 0.02 * slack(model)
    assert rel(last.float(), rlast.float()) < 0.03 * slack(model)
    assert torch.equal(logits, model(toks, torch.arange(12)[None], model.new_cache(1, 32)))
    # a dense view that is not row-major (the stream read as [N, H] by C): same logits
    strided = embeds.transpose(1, 2).contiguous().transpose(1, 2)  # [1, T, H], column-major rows
    assert not strided.is_contiguous()
    again = model(None, torch.arange(12)[None], model.new_cache(1, 32), embeds=strided)
    assert torch.equal(again, logits)


@pytest.mark.parametrize("arch, dtype, quant", [
    ("gemma3", "bfloat16", "int4"),  # sandwich norms, qk-norm, sliding windows
    ("qwen2", "bfloat16", "int4"),  # qkv bias
    ("llama", "float32", "int4"),  # fp32 activations
    ("llama", "bfloat16", "int8"),  # not our int4 kernel
])  # fmt: skip
def test_runs_only_where_it_applies(tmp_path_factory, arch, dtype, quant):
    m = tiny(tmp_path_factory, arch, dtype, quant)
    assert m.cpu_blocks is None
    assert "fused" not in describe_kernels(m)


@torch.inference_mode()
def test_bf16_gemm_matches_fp32_matmul(model):
    """The LM head (and the bf16 blocks' linears) through our GEMM: fp32 accumulation, one rounding."""
    torch.manual_seed(5)
    w = model.lm_head.weight
    for rows in (1, 2, 3, 4, 7):
        x = torch.randn(rows, model.lm_head.in_features, dtype=torch.bfloat16)
        got = model.cpu_blocks.head(x, model.lm_head)
        if w.dtype == torch.bfloat16 and type(model.lm_head) is torch.nn.Linear:
            want = (x.float() @ w.float().T).bfloat16()
            assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7
            assert torch.equal(got[:1], model.cpu_blocks.head(x[:1], model.lm_head))  # row-invariant
        else:  # an int4 head: the module's own kernel
            assert torch.equal(got, model.lm_head(x))


@torch.inference_mode()
def test_long_passes_run_the_torch_blocks(model):
    """Past MAX_POSITIONS (a long prefill chunk, a big batch) SDPA and oneDNN win: the torch blocks run."""
    H = model.config.hidden_size
    assert model.cpu_blocks.applies(torch.zeros(MAX_POSITIONS, H, dtype=torch.bfloat16), model, False)
    assert not model.cpu_blocks.applies(torch.zeros(2, MAX_POSITIONS // 2 + 1, H, dtype=torch.bfloat16), model, False)
    toks = torch.randint(3, 120, (1, MAX_POSITIONS + 6), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(toks.shape[1])[None]
    got = model(toks, pos, model.new_cache(1, 128))
    with torch_blocks(model):
        assert torch.equal(got, model(toks, pos, model.new_cache(1, 128)))


@torch.inference_mode()
def test_batch_invariant_runs_every_pass_through_the_kernel(model):
    """With batch_invariant=True a pass longer than MAX_POSITIONS runs the kernel too, so its
    positions equal the same tokens decoded one at a time (the torch blocks would round apart)."""
    T = MAX_POSITIONS + 6
    toks = torch.randint(3, 120, (1, 4 + T), generator=torch.Generator().manual_seed(7))
    cache = model.new_cache(1, 4 + T)
    model(toks[:, :4], torch.arange(4)[None], cache)
    cache.commit(torch.tensor([4]))
    long = model(toks[:, 4:], 4 + torch.arange(T)[None], cache, batch_invariant=True)
    steps = []
    for t in range(4, 4 + T):
        steps.append(model(toks[:, t : t + 1], torch.tensor([[t]]), cache))
        cache.commit(torch.tensor([1]))
    assert torch.equal(long, torch.cat(steps, dim=1))


def test_kernels_report_it(model):
    assert describe_kernels(model).endswith(f"fused CPU blocks ({model.cpu_blocks.isa})")
    with torch.enable_grad():
        assert not model.cpu_blocks.applies(model.embed.weight[:1], model, False)  # autograd: the torch blocks


@torch.inference_mode()
def test_swapped_or_moved_weights_are_never_read_stale(tmp_path_factory):
    """The structs point into the weights they were built from: swapping a linear drops them,
    moving the weights makes the pass refuse, and use_cpu_blocks() builds them again."""
    from specdecode.config import SpecDecodeError
    from specdecode.model.quant import set_submodule

    m = tiny(tmp_path_factory, "llama", quant="none")
    step = lambda: m(torch.tensor([[5, 6]]), torch.arange(2)[None], m.new_cache(1, 8))  # noqa: E731
    lin = m.layers[1].mlp.down
    set_submodule(m, "layers.1.mlp.down", Int4Linear.from_weight(lin.weight.detach().float()))
    assert m.cpu_blocks is None
    assert m.use_cpu_blocks()  # int4 and bf16 linears mixed: both are the kernel's
    step()
    m.to(torch.float32).to(torch.bfloat16)  # new storage for every weight
    with pytest.raises(SpecDecodeError, match="moved after use_cpu_blocks"):
        step()
    assert m.use_cpu_blocks()
    step()


def test_a_cache_the_kernel_cannot_write_runs_the_torch_blocks(model):
    """The kernel writes bf16 K/V in place: an fp32 cache (or one elsewhere) is not its to
    write, and `Transformer.forward` then runs the torch blocks."""
    fp32 = model.new_cache(1, 8)
    fp32.k, fp32.v = fp32.k.float(), fp32.v.float()
    assert not model.cpu_blocks.fits(fp32.storage_index(torch.zeros(1, 1, dtype=torch.long), 1))
    assert model.cpu_blocks.fits(model.new_cache(1, 8).storage_index(torch.zeros(1, 1, dtype=torch.long), 1))
