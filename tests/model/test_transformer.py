"""Parity of our Transformer with transformers on tiny random checkpoints of every architecture.

Every check compares against transformers running the plain, uncached sequence:
prefill, incremental decoding through the cache (one token and chunks), ragged
batches with right padding, tree masks, and Gemma3 past its sliding window.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.config import SpecDecodeError
from specdecode.model.loader import load_model
from specdecode.model.rope import RopeConfig, rope_frequencies
from specdecode.model.masks import attention_queries
from specdecode.model.transformer import ModelConfig
from tests.tiny import ARCHS, make_tiny_checkpoint, tiny_hf_config

ATOL = 1e-4
VOCAB = 128


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(our model, transformers' model) for one tiny architecture, fp32."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    ours = load_model(str(folder), dtype="float32", device="cpu", progress=False).model
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return ours, ref


def tokens_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def reference(ref, seq: torch.Tensor) -> torch.Tensor:
    """transformers' logits [T, V] for one plain sequence."""
    return ref(seq[None]).logits[0].float()


@torch.no_grad()
def step(model, cache, tokens, positions, block_mask=None, commit=None):
    out = model(tokens, positions, cache, block_mask=block_mask)
    cache.commit(torch.as_tensor(commit if commit is not None else [tokens.shape[1]] * tokens.shape[0]))
    return out


def test_prefill_matches(pair):
    ours, ref = pair
    seq = tokens_of(24, 0)
    got = step(ours, ours.new_cache(1, 32), seq[None], torch.arange(24)[None])[0]
    torch.testing.assert_close(got, reference(ref, seq), atol=ATOL, rtol=0)


def test_incremental_decode_matches(pair):
    """Prefill 12, decode 8 one at a time, then chunks of 4: 32 tokens, past Gemma's window of 6."""
    ours, ref = pair
    seq = tokens_of(32, 1)
    want = reference(ref, seq)
    cache = ours.new_cache(1, 40)
    got = [step(ours, cache, seq[None, :12], torch.arange(12)[None])[0]]
    for i in range(12, 20):
        got.append(step(ours, cache, seq[None, i : i + 1], torch.tensor([[i]]))[0])
    for i in range(20, 32, 4):
        got.append(step(ours, cache, seq[None, i : i + 4], torch.arange(i, i + 4)[None])[0])
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)
    assert int(cache.lengths[0]) == 32


def test_ragged_batch_matches(pair):
    """Rows with different cache lengths, right-padded, in prefill and in a 4-token chunk."""
    ours, ref = pair
    lens, new = [5, 9, 13], [4, 2, 3]  # valid tokens per row in the second pass
    seqs = [tokens_of(n + k, 10 + b) for b, (n, k) in enumerate(zip(lens, new))]
    cache = ours.new_cache(3, 24)
    T = max(lens)
    tokens = torch.zeros(3, T, dtype=torch.long)  # right padding with token 0
    for b, n in enumerate(lens):
        tokens[b, :n] = seqs[b][:n]
    first = step(ours, cache, tokens, torch.arange(T).expand(3, T), commit=lens)
    tokens = torch.zeros(3, 4, dtype=torch.long)
    for b, (n, k) in enumerate(zip(lens, new)):
        tokens[b, :k] = seqs[b][n : n + k]
    positions = torch.tensor(lens)[:, None] + torch.arange(4)
    second = step(ours, cache, tokens, positions, commit=new)
    for b, (n, k) in enumerate(zip(lens, new)):
        want = reference(ref, seqs[b])
        torch.testing.assert_close(first[b, :n], want[:n], atol=ATOL, rtol=0)
        torch.testing.assert_close(second[b, :k], want[n : n + k], atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == [n + k for n, k in zip(lens, new)]


# Parent pointers of a 7-node tree (-1 = child of the last committed token).
PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Ancestor-or-self mask: a node's row is its parent's row OR itself."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def test_tree_mask_matches_paths(pair):
    """Each node's logits equal its root-to-node path run as a plain sequence; two rows, ragged prefixes."""
    ours, ref = pair
    prefix_lens = [8, 11]  # past Gemma's window, so sliding layers see depth-based positions
    prefixes = [tokens_of(n, 20 + b) for b, n in enumerate(prefix_lens)]
    nodes = torch.stack([tokens_of(len(PARENTS), 30 + b) for b in range(2)])
    cache = ours.new_cache(2, 24)
    tokens = torch.zeros(2, max(prefix_lens), dtype=torch.long)
    for b, p in enumerate(prefixes):
        tokens[b, : len(p)] = p
    step(ours, cache, tokens, torch.arange(tokens.shape[1]).expand(2, -1), commit=prefix_lens)
    mask = tree_mask(PARENTS)
    depth = mask.sum(-1) - 1
    positions = torch.tensor(prefix_lens)[:, None] + depth
    got = step(ours, cache, nodes, positions, block_mask=mask.expand(2, -1, -1), commit=[0, 0])
    for b in range(2):
        for i in range(len(PARENTS)):
            path = nodes[b][mask[i]]  # ancestors in index order = root-to-node order
            want = reference(ref, torch.cat([prefixes[b], path]))[-1]
            torch.testing.assert_close(got[b, i], want, atol=ATOL, rtol=0)


def test_logits_at_and_hidden_layers(pair):
    ours, ref = pair
    seq = tokens_of(10, 3)
    full = step(ours, ours.new_cache(1, 16), seq[None], torch.arange(10)[None])
    at = torch.tensor([[9, 2]])
    with torch.no_grad():
        logits, (h0, h_last) = ours(seq[None], torch.arange(10)[None], ours.new_cache(1, 16), logits_at=at,
                                    hidden_layers=(0, -1))  # fmt: skip
        hf = ref(seq[None], output_hidden_states=True).hidden_states
        head = ours.lm_head(h_last[:, at[0]]).float()
    torch.testing.assert_close(logits, full[:, at[0]])
    torch.testing.assert_close(h0, hf[1], atol=ATOL, rtol=0)  # residual stream after layer 0
    if ours.config.final_logit_softcap is None:
        torch.testing.assert_close(logits, head)


def test_new_cache_shape_and_dtype(pair):
    ours, _ = pair
    cache = ours.new_cache(2, 7)
    c = ours.config
    assert cache.k.shape == (c.num_layers, 2, c.num_kv_heads, 7, c.head_dim)
    assert cache.k.dtype == ours.embed.weight.dtype and cache.lengths.tolist() == [0, 0]


def test_bf16_close_to_fp32(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "gemma3")
    seq = tokens_of(16, 4)[None]
    outs = []
    for dtype in ("float32", "bf16"):
        m = load_model(str(folder), dtype=dtype, device="cpu", progress=False).model
        assert m.embed.weight.dtype == (torch.float32 if dtype == "float32" else torch.bfloat16)
        outs.append(step(m, m.new_cache(1, 16), seq, torch.arange(16)[None]))
    assert outs[1].dtype == torch.float32
    assert (outs[0] - outs[1]).abs().max() < 0.1 * outs[0].abs().max()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logits_in_the_heads_dtype_for_an_argmax(tmp_path, arch):
    """``fp32_logits=False`` (a greedy pass) leaves bf16 logits as the head gave them, the same
    values the default converts to fp32, and the same argmax; a soft-capped head (Gemma) still
    returns fp32, since its cap is computed there."""
    from specdecode.core.sampling import argmax

    m = load_model(str(make_tiny_checkpoint(tmp_path, arch)), dtype="bf16", device="cpu", progress=False).model
    seq = tokens_of(12, 5)[None]
    with torch.inference_mode():
        full = m(seq, torch.arange(12)[None], m.new_cache(1, 16))
        raw = m(seq, torch.arange(12)[None], m.new_cache(1, 16), fp32_logits=False)
    assert full.dtype == torch.float32
    assert raw.dtype == (torch.float32 if arch == "gemma3" else torch.bfloat16)
    assert torch.equal(raw.float(), full)
    assert torch.equal(argmax(raw), full.argmax(dim=-1))


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
         "beta_fast": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    ],
)  # fmt: skip
def test_rope_frequencies_match_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tiny_hf_config("llama_untied", rope_parameters=dict(params), max_position_embeddings=256)
    want, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    got, scale = rope_frequencies(RopeConfig.from_hf(dict(params), 256), 16)
    torch.testing.assert_close(got, want)
    assert scale == pytest.approx(want_scale)


def test_unsupported_configs_raise():
    with pytest.raises(SpecDecodeError, match="dynamic"):
        ModelConfig.from_hf(tiny_hf_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 1e4}))  # fmt: skip
    from transformers import GPT2Config

    with pytest.raises(SpecDecodeError, match="supported: llama"):
        ModelConfig.from_hf(GPT2Config())


@pytest.mark.parametrize("drafts", [[4, 0, 2], [4, 0, 0, 0, 0, 0]], ids=["padded", "split"])
def test_packed_pass_equals_padded_pass(pair, drafts):
    """Rows with fewer real tokens than the widest: with ``valid`` the linears run on the real
    tokens only (and, when few rows draft, attention computes only their extra queries); the
    logits there, and what the cache keeps, equal the padded pass's."""
    ours, _ = pair
    B = len(drafts)
    prompts = [tokens_of(n, 3 + b) for b, n in enumerate([9, 5, 12, 7, 3, 10][:B])]
    draft_len = torch.tensor(drafts)  # real new tokens per row: 1 + draft
    width = 5
    split = attention_queries(B, int((draft_len > 0).sum()), width) < B * width
    assert split == (B == 6)  # both ways attention runs are covered
    new = torch.stack([tokens_of(width, 10 + b) for b in range(B)])
    valid = torch.arange(width)[None, :] < (1 + draft_len)[:, None]
    out = []
    for packed in (False, True):
        cache = ours.new_cache(B, 32)
        for b, p in enumerate(prompts):  # ragged prefill, one row at a time through a sub-cache view
            row = ours.new_cache(1, 32)
            ours(p[None], torch.arange(len(p))[None], row)
            cache.k[:, b], cache.v[:, b] = row.k[:, 0], row.v[:, 0]
        cache.commit(torch.tensor([len(p) for p in prompts]))
        positions = cache.lengths[:, None] + torch.arange(width)
        with torch.no_grad():
            logits = ours(new, positions, cache, valid=valid if packed else None)
        cache.commit(1 + draft_len)
        out.append((logits, cache))
    (dense, c0), (packed, c1) = out
    torch.testing.assert_close(packed[valid], dense[valid], atol=ATOL, rtol=0)
    assert (packed[~valid] == 0).all()
    with torch.no_grad():  # packed=True: the same logits, the real positions' only (no [B, T, V] of padding)
        positions = c1.lengths[:, None] - (1 + draft_len)[:, None] + torch.arange(width)
        c1.truncate(c1.lengths - (1 + draft_len))
        real_only = ours(new, positions, c1, valid=valid, packed=True)
    assert real_only.shape == (int(valid.sum()), packed.shape[-1])
    torch.testing.assert_close(real_only, packed[valid], atol=0, rtol=0)
    for b in range(B):
        n = int(c0.lengths[b])
        torch.testing.assert_close(c1.k[:, b, :, :n], c0.k[:, b, :, :n], atol=ATOL, rtol=0)


def test_a_model_off_the_cpu_does_not_probe_our_c_library(tmp_path, monkeypatch):
    """A model on CUDA (here: meta) gets no fused CPU block, and does not compile or probe the
    kernels for it (that ran gcc at every load on a GPU machine)."""
    import specdecode.model.cpu_block as cpu_block
    from specdecode.model.loader import load_model
    from tests.tiny import make_tiny_checkpoint

    model = load_model(str(make_tiny_checkpoint(tmp_path / "m", "llama")), dtype="bfloat16", device="cpu").model

    def probe(*args):
        raise AssertionError("probed the CPU's instruction sets for a model off the CPU")

    monkeypatch.setattr(cpu_block, "cpu_isa", probe)
    assert not model.to("meta").use_cpu_blocks()
