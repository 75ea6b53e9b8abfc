"""The feature net of eagle / eagle3 / mtp without the engine: training lowers the loss,
training-time test matches what drafting computes, files hold only the net's own weights,
and bad folders or configs get one line."""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM
from specdecode.config import SpecDecodeError
from specdecode.drafters.eagle3 import Eagle3Net
from specdecode.drafters.eagle_net import FeatureConfig, FeatureNet
from specdecode.drafters.learned import load_net, net_config, save_net
from specdecode.drafters.mtp import MtpNet
from specdecode.cache.kv_cache import NoCache
from specdecode.model.loader import load_model
from tests.learned import target_samples, train_batch, train_net
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("t") / "target", "llama", seed=0)
    return str(path), load_model(str(path), dtype=torch.float32, device="cpu").model


@pytest.mark.parametrize("cls", [FeatureNet, Eagle3Net, MtpNet])
def test_training_lowers_loss_and_raises_acceptance(target, cls):
    _, model = target
    net = cls.from_target(cls.Config(draft_vocab=0), model)
    history = train_net(net, model, steps=30, seed=1)
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]
    assert history[-1]["alpha@1"] > history[0]["alpha@1"]


def test_eagle3_fuses_three_layers_and_unrolls_three_steps(target):
    _, model = target
    net = Eagle3Net.from_target(Eagle3Net.Config(), model)
    assert len(net.hidden_layers) == 3 and net.config.train_steps == 3
    _, metrics = net.training_loss(train_batch(model, target_samples(model, 2, 10), net.hidden_layers))
    assert {"acc@1", "acc@2", "acc@3", "alpha@1"} <= set(metrics)


def test_training_time_test_sees_what_drafting_sees(target):
    """Step 2 of the unrolled loss equals a second draft step: the entry (own output, next
    token) over the cached true entries."""
    _, model = target
    torch.manual_seed(0)
    net = Eagle3Net.from_target(Eagle3Net.Config(train_steps=2, draft_vocab=0), model)
    tokens = target_samples(model, 1, 9)
    batch = train_batch(model, tokens, net.hidden_layers)
    T, n = tokens.shape[1], tokens.shape[1] - 2
    g = net.fuse(batch.hidden[:, :n])
    with torch.no_grad():
        out1 = net._unrolled([g], [tokens[:, 1 : 1 + n]], n)
        out2 = net._unrolled([g, out1], [tokens[:, 1 : 1 + n], tokens[:, 2 : 2 + n]], n)
        logits2 = net.body.head_logits(net.body.norm(out2))  # as training_loss applies the head
        for t in (0, 3, n - 1):  # drafting after the true entries 0..t
            cache = net.body.new_cache(1, T + 2)
            _, out = net(g[:, : t + 1], tokens[:, 1 : t + 2], torch.arange(t + 1)[None], cache)
            cache.commit(torch.tensor([t + 1]))
            step2, _ = net(out[:, t : t + 1], tokens[:, t + 2 : t + 3], torch.tensor([[t + 1]]), cache)
            torch.testing.assert_close(step2[0, 0], logits2[0, n + t], rtol=1e-4, atol=1e-4)


def test_the_loss_is_the_drafts_cross_entropy_where_labels_are(target):
    """training_loss runs the head only where a label is; it equals the soft cross-entropy of
    the drafting forward's logits at every entry, averaged over the labelled ones."""
    _, model = target
    torch.manual_seed(0)
    net = FeatureNet.from_target(FeatureConfig(draft_vocab=24, feature_loss=0.0), model)
    tokens = target_samples(model, 2, 12)
    net.prepare(torch.bincount(tokens.flatten(), minlength=model.config.vocab_size))
    batch = train_batch(model, tokens, net.hidden_layers)
    batch.mask[:, :4] = False  # prompts
    batch.mask[1, 8] = False  # a user turn
    B, T = tokens.shape
    with torch.no_grad():
        loss, metrics = net.training_loss(batch)
        logits, _ = net(batch.hidden[:, :-1], tokens[:, 1:], torch.arange(T - 1).expand(B, -1), NoCache(B, "cpu"))
    valid = batch.mask[:, :-1] & batch.mask[:, 1:]  # entry t drafts token t + 2 from label t + 1
    p = batch.probs_at(net.head.vocab_ids)[:, 1:]  # [B, T-1, Vd]
    ce = -(p * logits.float().log_softmax(-1)).sum(-1)
    assert float(loss) == pytest.approx(float(ce[valid].mean()), rel=1e-5)
    hit = net.head.vocab_ids[logits.argmax(-1)] == batch.argmax()[:, 1:]
    assert metrics["acc@1"] == pytest.approx(float(hit[valid].float().mean()))


def test_saved_folder_holds_only_the_nets_weights(target, tmp_path):
    _, model = target
    net = FeatureNet.from_target(FeatureConfig(draft_vocab=50), model)
    net.prepare(torch.arange(model.config.vocab_size))  # the 50 largest counts: ids 78..127
    out = save_net(net, model, tmp_path / "eagle")
    loaded = load_net(FeatureNet, out, model, torch.float32, torch.device("cpu"))
    assert loaded.head.vocab_ids.tolist() == list(range(78, 128))
    assert [k for k in loaded.saved_state() if "embed" in k or "lm_head" in k] == ["body.lm_head.vocab_ids"]
    head = model.lm_head.weight[78:128]
    torch.testing.assert_close(loaded.head.linear.weight, head)  # rebuilt from the target
    assert model.embed.weight.dtype == torch.float32  # the borrowed target was not cast


@pytest.mark.parametrize("cls", [FeatureNet, Eagle3Net, MtpNet])
def test_loaded_in_bf16_the_rope_frequencies_stay_fp32(target, tmp_path, cls):
    """As the target's (and as in training): a bf16 frequency table is off by 2 radians at
    position 1000 (it was cast with the weights)."""
    _, model = target
    out = save_net(cls.from_target(net_config(cls, {}), model), model, tmp_path / "net")
    loaded = load_net(cls, out, model, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    tables = {n: b for n, b in loaded.named_buffers() if "inv_freq" in n}
    assert tables and all(b.dtype == torch.float32 for b in tables.values()), {n: b.dtype for n, b in tables.items()}
    assert model.embed.weight.dtype == torch.float32  # the borrowed target was not cast


def test_bad_folders_and_configs_get_one_line(target, tmp_path):
    path, model = target
    net = MtpNet.from_target(MtpNet.Config(), model)
    mtp_dir = save_net(net, model, tmp_path / "mtp")
    cases = [
        ({"method": "eagle", "model": str(mtp_dir)}, "holds a drafter for method 'mtp'"),
        ({"method": "eagle", "model": str(tmp_path / "nowhere")}, "is not a folder"),
        ({"method": "eagle"}, "no eagle weights ship"),
        ({"method": "eagle", "topk": 0}, "topk must be"),
        ({"method": "eagle", "confidence_threshold": 1.0}, r"confidence_threshold must be a number in \[0, 1\)"),
        ({"method": "eagle", "confidence_threshold": "high"}, "confidence_threshold must be"),
        ({"method": "eagle", "confidence_threshold": 0.5, "topk": 2}, "applies to chains"),
    ]
    for spec, words in cases:
        with pytest.raises(SpecDecodeError, match=words):
            LLM(model=path, speculative_config=spec, dtype="float32", device="cpu")
    other = load_model(str(make_tiny_checkpoint(tmp_path / "other", "llama", hidden_size=32)), dtype=torch.float32,
                       device="cpu").model  # fmt: skip
    with pytest.raises(SpecDecodeError, match="trained for a target"):
        load_net(MtpNet, mtp_dir, other, torch.float32, torch.device("cpu"))
    with pytest.raises(SpecDecodeError, match="unknown eagle net key"):
        net_config(FeatureNet, {"layers": 3})
    with pytest.raises(SpecDecodeError, match="outside the target"):
        FeatureNet.from_target(FeatureConfig(feature_layers=(7,)), model)


def test_a_draft_vocabulary_outside_the_targets_gets_one_line(target, tmp_path):
    from safetensors.torch import load_file, save_file

    _, model = target
    net = FeatureNet.from_target(FeatureConfig(draft_vocab=50), model)
    net.prepare(torch.arange(model.config.vocab_size))
    folder = save_net(net, model, tmp_path / "eagle")
    state = load_file(str(folder / "model.safetensors"))
    state["body.lm_head.vocab_ids"][5] = model.config.vocab_size + 7  # was an IndexError while loading
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(SpecDecodeError, match=r"vocab_ids must be token ids in \[0, 128\)"):
        load_net(FeatureNet, folder, model, torch.float32, torch.device("cpu"))


def test_a_broken_folder_gets_one_line(target, tmp_path):
    """What a write that died leaves (no or a truncated weights file) and a config that is JSON
    but no object: one line naming the folder, not a traceback."""
    path, model = target
    folder = save_net(MtpNet.from_target(MtpNet.Config(), model), model, tmp_path / "mtp")
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    for broken, words in ((b"", "cannot read model.safetensors"), (whole[:100], "cannot read model.safetensors")):
        weights.write_bytes(broken)
        with pytest.raises(SpecDecodeError, match=words) as e:
            LLM(model=path, speculative_config={"method": "mtp", "model": str(folder)}, dtype="float32", device="cpu")
        assert "\n" not in str(e.value)
    weights.unlink()
    with pytest.raises(SpecDecodeError, match="cannot read model.safetensors"):
        load_net(MtpNet, folder, model, torch.float32, torch.device("cpu"))
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(SpecDecodeError, match="must hold a JSON object"):
        load_net(MtpNet, folder, model, torch.float32, torch.device("cpu"))


def test_a_folder_rewritten_by_a_run_that_dies_does_not_load(target, tmp_path, monkeypatch):
    """Writing into a trained folder again: the new config.json comes last, so a write that
    dies on the weights leaves no config beside the old weights (it loaded, silently mixed)."""
    import specdecode.drafters.learned as learned

    _, model = target
    folder = save_net(MtpNet.from_target(MtpNet.Config(), model), model, tmp_path / "mtp")
    old = (folder / "model.safetensors").read_bytes()

    def disk_full(state, filename):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    with pytest.raises(OSError):
        save_net(MtpNet.from_target(MtpNet.Config(), model), model, folder, extra={"trained": {"steps": 6}})
    monkeypatch.undo()
    assert not (folder / "config.json").exists() and (folder / "model.safetensors").read_bytes() == old
    with pytest.raises(SpecDecodeError, match="not a trained drafter folder"):
        load_net(MtpNet, folder, model, torch.float32, torch.device("cpu"))
    assert learned.save_net(MtpNet.from_target(MtpNet.Config(), model), model, folder).is_dir()
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]  # no leftovers


def test_confidence_head_learns_the_acceptance_chance(target, tmp_path):
    """Trained with the drafter on sum(min(p, q)), the chance rejection sampling accepts the
    token; saved and loaded with the net (the engine test checks the budget receives it)."""
    _, model = target
    net = FeatureNet.from_target(FeatureConfig(draft_vocab=0, confidence_head=True, train_steps=2), model)
    history = train_net(net, model, steps=40, seed=2)
    assert history[-1]["conf_err@1"] < 0.6 * history[0]["conf_err@1"]
    assert "conf_err@2" in history[-1]
    path = save_net(net, model, tmp_path / "eagle")
    assert "confidence.weight" in load_net(FeatureNet, path, model, torch.float32, torch.device("cpu")).state_dict()


def test_nets_without_a_confidence_head_load_as_before(target, tmp_path):
    _, model = target
    net = FeatureNet.from_target(FeatureConfig(draft_vocab=0), model)
    assert net.confidence is None and not any(k.startswith("confidence") for k in net.saved_state())
