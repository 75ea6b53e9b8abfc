"""The dflash drafter and its net on tiny random targets: KV injection equals a fresh
computation after many rounds (no rollback needed), training-mode blocks equal decoding
ones, training lowers the loss, the shape fits 10 MB for SmolLM2-135M, and bad input
gets one line.

`make_dflash` (a randomly initialised net saved as a drafter folder) is shared with
tests/engine/test_dflash_engine.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.drafters.registry import parse_spec
from specdecode.drafters.dflash import DFlashDrafter
from specdecode.drafters.dflash_net import DFlashNet, DFlashNetConfig, spread_layers
from specdecode.drafters.learned import TrainBatch, load_net, save_net
from specdecode.engine.serving import ServingEngine
from specdecode.cache.kv_cache import ContiguousKVCache
from specdecode.model.loader import load_model
from specdecode.model.transformer import ModelConfig, Transformer
from tests.learned import fit
from tests.tiny import make_tiny_checkpoint

TINY_NET = {"num_layers": 2, "block_size": 8, "intermediate_size": 48, "num_target_layers": 2}


def randomize_net_(net: DFlashNet, seed: int) -> None:
    """O(1)-scale weights on the net's own parameters (not the target's it borrows), so its
    drafts vary with the context."""
    gen = torch.Generator().manual_seed(seed)
    own = set(net.saved_state())
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name not in own:
                continue
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(noise)


def make_dflash(out: Path, target_path: str | Path, seed: int = 0, **config) -> str:
    """A randomly initialised DFlashNet for the target at ``target_path``, saved at ``out``."""
    target = load_model(str(target_path), dtype="float32", device="cpu", progress=False).model
    net = DFlashNet.from_target(DFlashNetConfig(**{**TINY_NET, **config}), target)
    randomize_net_(net, seed)
    return str(save_net(net, target, out))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = make_tiny_checkpoint(root / "target", "llama", seed=0, num_hidden_layers=4, vocab_size=12)
    return {"target": str(target), "net": make_dflash(root / "net", target, seed=1)}


@pytest.fixture(scope="module")
def loaded(ckpts):
    target = load_model(ckpts["target"], dtype="float32", device="cpu", progress=False)
    net = load_net(DFlashNet, ckpts["net"], target.model, torch.float32, torch.device("cpu"))
    return target, net


def features(target: Transformer, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The target's features [1, T, F] at ``tokens``, computed fresh in one pass."""
    t = torch.tensor([tokens])
    cache = target.new_cache(1, len(tokens))
    _, hidden = target(t, torch.arange(len(tokens))[None], cache, hidden_layers=layers)
    return torch.cat(hidden, dim=-1)


def test_spread_layers_low_to_high():
    assert spread_layers(30, 3) == (1, 14, 28)  # SmolLM2-135M
    assert spread_layers(4, 2) == (1, 2)
    assert spread_layers(3, 3) == (1,)
    assert spread_layers(1, 3) == (0,)


def test_smollm2_net_fits_10mb_and_saves_only_its_own():
    # SmolLM2-135M's shape on the meta device: nothing is allocated
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        target = Transformer(cfg)
    net = DFlashNet.from_target(DFlashNetConfig(), target)
    state = net.saved_state()
    assert [k for k in state if k.startswith(("body.embed", "body.lm_head"))] == ["body.lm_head.vocab_ids"]
    assert "mask_embed" in state and "fc.weight" in state
    params = sum(t.numel() for t in state.values())
    assert params * 2 <= 10e6, params  # bf16
    assert net.hidden_layers == (1, 14, 28) and net.body.config.intermediate_size == 512


def test_injected_context_equals_fresh_after_rounds(ckpts, loaded):
    """After many rounds with rejections, each row's context K/V are the net's projections
    of the target's features at exactly its committed tokens but the newest."""
    target, net = loaded
    spec = parse_spec({"method": "dflash", "model": ckpts["net"], "num_speculative_tokens": 6})
    engine = ServingEngine(target, spec, max_model_len=80)
    prompts = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [1]]
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=3),
              SamplingParams(temperature=0.7, max_tokens=60, ignore_eos=True, seed=4)]  # fmt: skip
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    for _ in range(12):
        engine.step()
    drafter = engine.drafter
    assert isinstance(drafter, DFlashDrafter) and len(engine.batch) == 3
    stats = [s.stats for s in engine.batch.seqs]
    assert sum(s.num_accepted_tokens for s in stats) > 0  # several tokens per round somewhere
    assert sum(s.num_draft_tokens - s.num_accepted_tokens for s in stats) > 0  # and rejections
    for b, seq in enumerate(engine.batch.seqs):
        n = len(seq.token_ids) - 1
        assert int(drafter.cache.lengths[b]) == n
        fresh = net.context_kv(features(target.model, seq.token_ids[:-1], net.hidden_layers), torch.arange(n)[None])
        table = drafter.cache.block_table(drafter.cache.seq_ids[b])
        assert len(table) == -(-n // drafter.cache.block_size)  # rejected slots' blocks went back
        for layer, (k, v) in enumerate(fresh):
            for cached, want in ((drafter.cache.k, k), (drafter.cache.v, v)):
                row = cached[layer, table].flatten(0, 1)[:n]  # [n, Hkv, D] through the block table
                torch.testing.assert_close(row.transpose(0, 1), want[0], atol=1e-5, rtol=1e-4)


def test_training_block_equals_decoding_block(loaded):
    """The differentiable training forward (many anchors per window at once) gives each
    block the logits decoding gives it over a cache holding the same context."""
    target, net = loaded
    torch.manual_seed(0)
    tokens = torch.randint(0, target.config.vocab_size, (2, 20))
    hidden = torch.cat([features(target.model, row.tolist(), net.hidden_layers) for row in tokens])  # [2, 20, F]
    rows, anchors = torch.tensor([0, 0, 1, 1, 0]), torch.tensor([0, 5, 11, 19, 13])
    trained = net.anchor_logits(tokens, hidden, rows, anchors)  # [5, S, V]
    S = net.block_size
    for r, (w, a) in enumerate(zip(rows.tolist(), anchors.tolist())):
        cache = ContiguousKVCache(net.body.config.num_layers, 1, net.body.config.num_kv_heads,
                                  net.body.config.head_dim, a + S, torch.float32, "cpu")  # fmt: skip
        slots = torch.arange(a)[None]
        for layer, (k, v) in enumerate(net.context_kv(hidden[w : w + 1, :a], slots)):
            cache.append(layer, k, v, slots, a)
        cache.commit(torch.tensor([a]))
        decoded = net.block_logits(tokens[w, a : a + 1], cache)  # [1, S, V]
        torch.testing.assert_close(trained[r], decoded[0], atol=1e-4, rtol=1e-4)


def test_training_loss_decreases(ckpts):
    torch.manual_seed(0)
    target = load_model(ckpts["target"], dtype="float32", device="cpu", progress=False).model
    net = DFlashNet.from_target(DFlashNetConfig(**{**TINY_NET, "anchors_per_window": 24}), target).train()
    # a repetitive corpus the target's distributions over which a drafter can learn
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8] * 4, [9, 3, 10, 4, 11, 5] * 4])  # [2, 24]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 20:] = False  # right padding
    with torch.no_grad():
        logits, hidden = target(tokens, torch.arange(24).expand(2, -1), target.new_cache(2, 24),
                                hidden_layers=net.hidden_layers)  # fmt: skip
    batch = TrainBatch(tokens, torch.cat(hidden, dim=-1), logits, mask, target)
    history = fit(net, batch, steps=25)
    losses, metrics = [loss for loss, _ in history], history[-1][1]
    assert losses[-1] < 0.8 * losses[0], losses
    assert {"acc@1", "acc@8", "alpha@1", "tau_greedy"} <= set(metrics)
    assert 0 <= metrics["alpha@1"] <= 1 and 1 <= metrics["tau_greedy"] <= 1 + net.block_size
    assert not any(p.requires_grad for p in target.embed.parameters())  # the borrowed head stays frozen


def test_anchors_sit_on_generated_trained_positions(loaded):
    """Blocks are rooted at trained positions whose own token was generated (serving roots a block
    at a generated token: not at the prompt's last, whose next token is an answer's): evenly over
    each window held out, at random over the batch in training (a short answer's K anchors were
    repeats of its few labels)."""
    _, net = loaded
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, 6:10] = mask[0, 14:18] = True  # two answers
    mask[1, :12] = True  # plain text, then padding
    roots = mask & torch.nn.functional.pad(mask[:, :-1], (1, 0))  # as training_loss gives them
    rows, anchors = net.eval()._anchors(roots, 4)
    assert rows.tolist() == [0] * 4 + [1] * 4
    assert anchors.view(2, 4).tolist() == [[7, 9, 15, 17], [2, 5, 7, 10]]  # the (k + 0.5)·n/K-th of n (7-9, 15-17; 1-11)
    torch.manual_seed(0)
    rows, anchors = net.train()._anchors(roots, 4)  # training: over the batch's 17 candidates, distinct
    net.eval()
    picked = set(zip(rows.tolist(), anchors.tolist()))
    assert len(picked) == 8 and all(mask[r, a] and mask[r, a - 1] for r, a in picked)


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"num_speculative_tokens": 9}, "at most its block size of 8"),
        ({"model": 3}, 'dflash "model" must be a folder path'),
        ({"model": "/nonexistent/dflash"}, "is not a folder"),
        ({"model": None}, "no dflash weights ship for"),
        ({"block_size": 4}, "unknown key(s) block_size"),
        ({"confidence_threshold": -0.1}, "confidence_threshold must be a number in [0, 1)"),
    ],
)
def test_bad_options_one_line(ckpts, loaded, spec, message):
    target, _ = loaded
    with pytest.raises(SpecDecodeError) as e:
        parsed = parse_spec({"method": "dflash", "model": ckpts["net"], **spec})
        ServingEngine(target, parsed, max_model_len=64)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_net_config_and_wrong_target_one_line(ckpts, tmp_path):
    with pytest.raises(SpecDecodeError, match="block_size must be a positive integer"):
        DFlashNetConfig(block_size=0)
    with pytest.raises(SpecDecodeError, match="position_decay"):
        DFlashNetConfig(position_decay=-1.0)
    other = make_tiny_checkpoint(
        tmp_path / "other", "llama", seed=0, hidden_size=32, num_hidden_layers=4, vocab_size=12
    )
    target = load_model(str(other), dtype="float32", device="cpu", progress=False)
    with pytest.raises(SpecDecodeError) as e:
        ServingEngine(target, parse_spec({"method": "dflash", "model": ckpts["net"], "num_speculative_tokens": 4}),
                      max_model_len=64)  # fmt: skip
    assert "was trained for a target with" in str(e.value) and "\n" not in str(e.value)


def test_trains_in_fp32_over_a_bf16_target(ckpts):
    """As the trainer does: a bf16 target, the net's trainable parameters cast to fp32."""
    target = load_model(ckpts["target"], dtype="bfloat16", device="cpu", progress=False).model
    net = DFlashNet.from_target(DFlashNetConfig(**TINY_NET), target).train()
    net.prepare(torch.ones(target.config.vocab_size))
    params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    tokens = torch.randint(0, target.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, hidden = target(tokens, torch.arange(16).expand(2, -1), target.new_cache(2, 16),
                                hidden_layers=net.hidden_layers)  # fmt: skip
    batch = TrainBatch(
        tokens, torch.cat(hidden, dim=-1).float(), logits, torch.ones_like(tokens, dtype=torch.bool), target
    )
    loss, _ = net.training_loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in params)
    assert target.embed.weight.dtype == torch.bfloat16 and target.embed.weight.grad is None
