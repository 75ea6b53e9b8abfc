"""The `medusa` drafter without the engine: its net (shape, size, saved state, training
loss), its per-row feature state, its options' one-line errors, and typical acceptance."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.drafters.registry import parse_spec
from specdecode.drafters.base import DrafterContext
from specdecode.drafters.learned import TrainBatch, save_net
from specdecode.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaNet
from specdecode.model.transformer import ModelConfig, Transformer
from specdecode.core.batch import Batch
from specdecode.cache.kv_cache import NoCache
from specdecode.model.loader import load_model
from specdecode.core.verify import TypicalAcceptance, greedy_verify, typical_verify
from tests.learned import fit
from tests.tiny import make_tiny_checkpoint


def random_medusa(target, num_heads: int = 4, num_layers: int = 1, seed: int = 0, scale: float = 0.3) -> MedusaNet:
    """A MedusaNet with non-zero heads (a fresh one starts as the identity plus a shift)."""
    net = MedusaNet.from_target(MedusaConfig(num_heads=num_heads, num_layers=num_layers), target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.heads.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    return net


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    target = load_model(str(make_tiny_checkpoint(root / "target", "llama", seed=0)), dtype=torch.float32, device="cpu")
    folder = save_net(random_medusa(target.model), target.model, root / "medusa")
    return target, str(folder), root


def make_drafter(target, spec: dict) -> MedusaDrafter:
    ctx = DrafterContext(target=target, dtype=torch.float32, device=torch.device("cpu"))
    return MedusaDrafter(parse_spec({"method": "medusa", **spec}), ctx)


def test_net_is_small_and_saves_only_its_heads():
    # SmolLM2-135M's shape on the meta device: nothing is allocated
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        net = MedusaNet(MedusaConfig(), Transformer(cfg))
    state = net.saved_state()
    assert all(k.startswith("heads.") for k in state if k != "head.vocab_ids")
    assert sum(t.numel() for t in state.values()) * 2 <= 10e6  # bf16 bytes
    small = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=8, max_position_embeddings=64)  # fmt: skip
    net = MedusaNet(MedusaConfig(), Transformer(small))
    assert all(not b.linear.weight.any() for head in net.heads for b in head)  # Medusa's init


def test_features_follow_rows(setup):
    target, folder, _ = setup
    drafter = make_drafter(target, {"model": folder, "num_speculative_tokens": 3})
    H = target.config.hidden_size
    feats = [torch.randn(n, H) for n in (4, 2, 5)]
    batch = Batch([], capacity=64, device=torch.device("cpu"))
    seqs = [
        Batch.new_sequence(i, list(range(3, 4 + len(f))), SamplingParams(temperature=0.0), "cpu")
        for i, f in enumerate(feats)
    ]
    rows = batch.extend(seqs[:2])
    drafter.prefill(batch, rows, feats[:2])
    rows = batch.extend(seqs[2:])
    drafter.prefill(batch, rows, feats[2:])
    assert torch.equal(drafter.last, torch.stack([f[-1] for f in feats]))
    draft = drafter.propose(batch, 3)
    assert draft.tokens.shape == (3, 3) and draft.q is None
    # head k on the newest feature, through the target's LM head
    net = drafter.net
    want = net.head.vocab_ids[net.logits(net(feats[1][-1], 3)).argmax(dim=-1)]
    assert torch.equal(draft.tokens[1], want)
    hidden = torch.randn(3, 4, H)  # root + up to 3 accepted drafts
    drafter.on_verified(batch, torch.tensor([0, 3, 1]), None, hidden)
    assert torch.equal(drafter.last, hidden[[0, 1, 2], [0, 3, 1]])
    batch.select_rows([2, 0])
    drafter.select_rows([2, 0])
    assert torch.equal(drafter.last, hidden[[2, 0], [1, 0]])


def test_static_tree_takes_each_heads_top_k(setup):
    target, folder, _ = setup
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    drafter = make_drafter(target, {"model": folder, "speculative_token_tree": tree})
    assert drafter.max_draft_tokens(4) == 6
    seq = Batch.new_sequence(0, [5, 9, 3], SamplingParams(temperature=0.0), "cpu")
    batch = Batch([seq], capacity=64, device=torch.device("cpu"))
    feat = torch.randn(2, target.config.hidden_size)
    drafter.prefill(batch, [0], [feat])
    draft = drafter.propose(batch, 4)
    net = drafter.net
    ranked = net.head.vocab_ids[net.logits(net(feat[-1], 3)).topk(2, dim=-1).indices]  # [3, 2]
    want = [3, ranked[0, 0], ranked[0, 1], ranked[1, 0], ranked[1, 1], ranked[1, 0], ranked[2, 0]]
    assert draft.tree.tokens[0].tolist() == [int(t) for t in want]
    assert draft.tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 3]
    default = make_drafter(target, {"model": folder, "speculative_token_tree": "default", "num_speculative_tokens": 2})
    assert max(default.tree.depth) == 2 and default.max_draft_tokens(2) == 38  # mc_sim_7b_63 cut to 2 levels


def one_line_error(fn) -> str:
    with pytest.raises(SpecDecodeError) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_options_get_one_line(setup, tmp_path):
    target, folder, root = setup
    parse = lambda **kw: parse_spec({"method": "medusa", "model": folder, **kw})
    assert "acceptance" in one_line_error(lambda: parse(acceptance="greedy"))
    assert "posterior_threshold" in one_line_error(lambda: parse(acceptance="typical", posterior_threshold=0))
    assert "chain" in one_line_error(lambda: parse(acceptance="typical", speculative_token_tree=[[0]]))
    # exact acceptance ignores them: refused rather than silently unused
    assert 'applies to acceptance "typical"' in one_line_error(lambda: parse(posterior_threshold=0.2))
    assert 'applies to acceptance "typical"' in one_line_error(lambda: parse(acceptance="exact", posterior_alpha=0.5))
    assert parse(posterior_alpha=0.3).options.acceptance == "exact"  # the default, spelled out, is fine
    assert "speculative_token_tree" in one_line_error(lambda: parse(speculative_token_tree=[[0, 0]]))
    assert "4 heads" in one_line_error(lambda: make_drafter(target, {"model": folder, "num_speculative_tokens": 5}))
    deep = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert "5 deep" in one_line_error(lambda: make_drafter(target, {"model": folder, "speculative_token_tree": deep}))
    deeper_than_gamma = {"model": folder, "speculative_token_tree": deep[:4], "num_speculative_tokens": 2}
    assert "is 4 deep but num_speculative_tokens is 2" in one_line_error(lambda: make_drafter(target, deeper_than_gamma))
    assert "rank 200" in one_line_error(
        lambda: make_drafter(target, {"model": folder, "speculative_token_tree": [[200]]})
    )
    assert "not a folder" in one_line_error(lambda: make_drafter(target, {"model": str(tmp_path / "missing")}))
    other = tmp_path / "eagle"
    other.mkdir()
    meta = json.loads((root / "medusa" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**meta, "specdecode_method": "eagle"}))
    assert "a drafter for method 'eagle'" in one_line_error(lambda: make_drafter(target, {"model": str(other)}))
    assert "no medusa weights ship" in one_line_error(lambda: make_drafter(target, {}))
    assert "num_heads" in one_line_error(lambda: MedusaConfig(num_heads=0))


def test_training_loss_decreases(setup):
    target, _, _ = setup
    model = target.model
    torch.manual_seed(0)
    tokens = torch.randint(3, target.config.vocab_size, (4, 24))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 18:] = False
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits, (hidden,) = model(tokens, positions, NoCache(4, "cpu"), hidden_layers=(-1,))
    batch = TrainBatch(tokens=tokens, hidden=hidden, logits=logits, mask=mask, target=model)
    net = MedusaNet.from_target(MedusaConfig(num_heads=3), model)
    history = fit(net, batch, steps=15)
    losses, metrics = [loss for loss, _ in history], history[-1][1]
    assert losses[-1] < 0.9 * losses[0]
    assert set(metrics) == {"acc@1", "acc@2", "acc@3", "alpha@1"}
    assert 0 <= metrics["alpha@1"] <= 1
    assert all(p.grad is None for p in model.parameters())  # the borrowed LM head stays frozen


def test_typical_verify():
    V = 5
    # greedy (one-hot p): the same as greedy_verify
    argmax = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]])
    p = torch.nn.functional.one_hot(argmax, V).float()
    drafts = torch.tensor([[1, 2, 0], [0, 1, -1]])
    out, n = typical_verify(p, drafts, 0.09, 0.3)
    want_out, want_n = greedy_verify(argmax, drafts)
    assert torch.equal(out, want_out) and torch.equal(n, want_n)
    # a flat p (H = log 5): bound = min(0.09, 0.3 / 5) = 0.06 < 0.2, so any draft is kept,
    # which is what makes it lossy; a peaked p rejects its unlikely tokens
    flat = torch.full((1, 3, V), 1 / V)
    out, n = typical_verify(flat, torch.tensor([[4, 3]]), 0.09, 0.3, torch.Generator().manual_seed(0))
    assert n.tolist() == [2] and out[0, :2].tolist() == [4, 3]
    peaked = torch.tensor([[[0.96, 0.01, 0.01, 0.01, 0.01]] * 2])
    out, n = typical_verify(peaked, torch.tensor([[2]]), 0.09, 0.3, torch.Generator().manual_seed(0))
    assert n.tolist() == [0] and out[0, 1].item() == -1
    # as the rule a draft carries: the same decision, flagged lossy
    rule = TypicalAcceptance(0.09, 0.3)
    assert rule.lossy
    got = rule(flat, torch.tensor([[4, 3]]), [torch.Generator().manual_seed(0)])
    want = typical_verify(flat, torch.tensor([[4, 3]]), 0.09, 0.3, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
