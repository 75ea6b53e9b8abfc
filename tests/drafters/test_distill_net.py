"""The distilled draft model: it starts as the target's first layers, and its saved state
(transformers' names) maps back onto our modules exactly, for every architecture."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters.distill_net import DistillConfig, DistillNet
from specdecode.model.loader import load_model, to_our_names
from tests.tiny import make_tiny_checkpoint


@pytest.mark.parametrize("arch", ["llama", "llama_untied", "qwen3", "gemma3"])
def test_saved_state_round_trips_through_the_loader(tmp_path, arch):
    target = load_model(str(make_tiny_checkpoint(tmp_path / arch, arch)), dtype="float32", device="cpu").model
    net = DistillNet.from_target(DistillConfig(num_layers=2), target)
    ours = net.model.state_dict()
    back = to_our_names(net.model.config, net.saved_state())
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    assert torch.equal(ours["layers.1.attn.qkv.weight"], target.state_dict()["layers.1.attn.qkv.weight"])
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert "model.embed.weight" not in trainable and "model.layers.0.mlp.down.weight" in trainable


def test_too_many_layers_to_copy_is_refused(tmp_path):
    from specdecode.config import SpecDecodeError

    target = load_model(str(make_tiny_checkpoint(tmp_path / "t")), dtype="float32", device="cpu").model
    with pytest.raises(SpecDecodeError, match="exceeds the target's 3 layers"):
        DistillNet.from_target(DistillConfig(num_layers=4), target)
    assert (
        DistillNet.from_target(DistillConfig(num_layers=4, init_from_target=False), target).model.config.num_layers == 4
    )
