"""`specdecode train` end to end on a tiny target: training lowers held-out loss and raises
acceptance, a resumed run ends where an uninterrupted one does, and the distilled draft
model loads as a `draft_model` drafter whose greedy output equals plain greedy."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.model.loader import load_model
from specdecode.train import target_outputs, trainer
from specdecode.train.config import TrainConfig
from specdecode.train.trainer import CHECKPOINT_FILE, LOG_FILE, train
from tests.tiny import make_tiny_checkpoint

# the smallest net of each method for the tiny target (vocabulary 128, 3 layers)
TINY_NETS = {
    "draft_model": {"num_layers": 1},
    "medusa": {"num_heads": 2},
    "eagle": {"draft_vocab": 0},
    "eagle3": {"draft_vocab": 0},
    "mtp": {"draft_vocab": 0},
    "dflash": {"num_layers": 1, "block_size": 4, "anchors_per_window": 4},
}


def config(target: str, corpus: str, out: Path, method: str = "draft_model", **overrides) -> TrainConfig:
    base = TrainConfig(
        method=method, data=(corpus,), out=str(out), target=target, net_config=TINY_NETS[method],
        steps=30, batch_size=4, seq_len=64, lr=3e-3, warmup=3, eval_every=0, eval_batches=2, save_every=10,
        dtype="float32", device="cpu", progress=False,
    )  # fmt: skip
    return replace(base, **overrides)


@pytest.mark.parametrize("method", TINY_NETS)
def test_training_lowers_heldout_loss_and_raises_acceptance(tiny_target, corpus, tmp_path, method):
    log = train(config(tiny_target, corpus, tmp_path / "out", method))
    start, end = log["start"], log["end"]
    assert end["step"] == 30 and end["loss"] < 0.8 * start["loss"], (start, end)
    metric = "alpha@1" if "alpha@1" in start else "acc@1"
    assert end[metric] > start[metric] + 0.02, (start, end)
    saved = json.loads((tmp_path / "out" / LOG_FILE).read_text())
    assert saved["start"] == start and saved["end"] == end
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()


def test_resume_ends_identical_to_an_uninterrupted_run(tiny_target, corpus, tmp_path, monkeypatch):
    whole = train(config(tiny_target, corpus, tmp_path / "whole", steps=20))
    real_rows = trainer.batch_rows

    def crash_at_step_13(step, *args):
        if step == 13:
            raise KeyboardInterrupt
        return real_rows(step, *args)

    monkeypatch.setattr(trainer, "batch_rows", crash_at_step_13)
    cfg = config(tiny_target, corpus, tmp_path / "cut", steps=20)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(trainer, "batch_rows", real_rows)
    saved = torch.load(tmp_path / "cut" / CHECKPOINT_FILE, weights_only=True)
    assert saved["step"] == 10  # the last periodic checkpoint before the crash
    resumed = train(replace(cfg, resume=True))
    assert resumed["train_loss"] == whole["train_loss"] and len(resumed["train_loss"]) == 20
    assert resumed["start"] == whole["start"] and resumed["end"] == whole["end"]
    a = torch.load(tmp_path / "whole" / CHECKPOINT_FILE, weights_only=True)
    b = torch.load(tmp_path / "cut" / CHECKPOINT_FILE, weights_only=True)
    assert b["step"] == 20 and a["net"].keys() == b["net"].keys()
    assert not any("embed" in k or "lm_head" in k for k in b["net"])  # frozen (and tied) tensors stay out
    assert all(torch.equal(a["net"][k], b["net"][k]) for k in a["net"])


def test_distilled_draft_model_loads_and_is_lossless(tiny_target, corpus, tmp_path):
    from specdecode import LLM
    from specdecode.model.loader import load_model

    out = tmp_path / "draft"
    train(config(tiny_target, corpus, out, steps=20, net_config={"num_layers": 2}))
    assert load_model(str(out), dtype="float32", device="cpu").config.num_layers == 2
    llm = LLM(model=tiny_target, speculative_config={"method": "draft_model", "model": str(out), "num_speculative_tokens": 3},
              dtype="float32", device="cpu")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [llm.tokenize("the cat sat on"), llm.tokenize("a dog ran far away and")]
    spec = llm.generate(prompts, params)
    plain = llm.generate(prompts, params, speculative=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0


@pytest.mark.parametrize("method", TINY_NETS)
def test_cached_target_outputs_train_every_net(tiny_target, corpus, tmp_path, method):
    """--cache-topk: later epochs reuse the first epoch's target outputs; with K = V the
    labels are the target's own, so the run equals an uncached one."""
    V = load_model(tiny_target, dtype="float32", device="cpu").config.vocab_size
    plain = train(config(tiny_target, corpus, tmp_path / "plain", method, steps=12, eval_every=0))
    cached = train(config(tiny_target, corpus, tmp_path / "cached", method, steps=12, eval_every=0, cache_topk=V))
    assert cached["end"]["loss"] == pytest.approx(plain["end"]["loss"], rel=1e-3)
    top4 = train(config(tiny_target, corpus, tmp_path / "top4", method, steps=12, eval_every=0, cache_topk=4))
    assert all(math.isfinite(x) for x in top4["train_loss"]) and top4["end"]["loss"] < top4["start"]["loss"]


def test_resume_accepts_the_same_partial_net_config(tiny_target, corpus, tmp_path):
    """The checkpoint stores the resolved config (eagle's feature layers filled in); the
    keys given again must match it, and a changed key is refused."""
    cfg = config(tiny_target, corpus, tmp_path / "e", "eagle", steps=4, eval_every=0, save_every=2)
    train(cfg)
    log = train(replace(cfg, steps=6, resume=True))
    assert log["end"]["step"] == 6
    with pytest.raises(SpecDecodeError, match="differs from the checkpoint"):
        train(replace(cfg, steps=8, resume=True, net_config={"draft_vocab": 5}))
    # nothing left to train is said, not done quietly (the output was rewritten as it was)
    with pytest.raises(SpecDecodeError, match="already at step 6; give --steps above it"):
        train(replace(cfg, steps=6, resume=True))
    with pytest.raises(SpecDecodeError, match="trained .* s already; give --time-limit above it"):
        train(replace(cfg, steps=8, resume=True, time_limit=1e-6))


def test_resume_with_init_compares_the_folders_keys_under_the_given_ones(tiny_target, corpus, tmp_path):
    """--init DIR --net-config K --resume: K is compared as the first run resolved it, over the
    folder's net config (a key only the folder sets is no difference)."""
    first = tmp_path / "first"
    train(config(tiny_target, corpus, first, "eagle", steps=2, eval_every=0,
                 net_config={"draft_vocab": 0, "train_steps": 2}))  # fmt: skip
    cfg = config(tiny_target, corpus, tmp_path / "deeper", "eagle", steps=2, eval_every=0, init=str(first),
                 finetune=True, net_config={"num_layers": 2})  # fmt: skip
    train(cfg)
    log = train(replace(cfg, steps=3, resume=True))
    assert log["end"]["step"] == 3 and log["net"]["train_steps"] == 2
    with pytest.raises(SpecDecodeError, match="differs from the checkpoint"):
        train(replace(cfg, steps=4, resume=True, net_config={"num_layers": 3}))


def test_resume_refuses_other_data_settings(tiny_target, corpus, tmp_path):
    """--seed shuffles the files and so picks the held-out documents: resuming under another
    one trained on the old held-out text and evaluated on trained text, without a word."""
    cfg = config(tiny_target, corpus, tmp_path / "e", "medusa", steps=4, eval_every=0, save_every=2)
    train(cfg)
    (tmp_path / "more.txt").write_text("more text " * 50)
    twin = str(make_tiny_checkpoint(tmp_path / "twin", "llama", seed=1))  # the same shape: the same fingerprint
    for change in ({"seed": 1}, {"batch_size": 3}, {"seq_len": 24}, {"max_tokens": 5000}, {"heldout": 0.2},
                   {"data": (corpus, str(tmp_path / "more.txt"))}, {"target": twin}):  # fmt: skip
        with pytest.raises(SpecDecodeError, match=f"--{next(iter(change)).replace('_', '-')} was"):
            train(replace(cfg, steps=6, resume=True, **change))
    log = train(replace(cfg, steps=6, resume=True, data=(corpus + "/.",), target=tiny_target + "/.", eval_every=3,
                        threads=1))  # free to change  # fmt: skip
    assert log["end"]["step"] == 6


def test_resume_refuses_a_corpus_that_now_reads_differently(tiny_target, corpus, tmp_path):
    """The same flags over text that changed (or is read differently since): other windows."""
    import shutil

    mine = shutil.copytree(corpus, tmp_path / "corpus")
    cfg = config(tiny_target, str(mine), tmp_path / "e", "medusa", steps=4, eval_every=0, save_every=2)
    train(cfg)
    first = sorted(p for p in mine.rglob("*") if p.is_file())[0]
    first.write_text(first.read_text() + " and some more words at the end")
    with pytest.raises(SpecDecodeError, match="the corpus now reads as"):
        train(replace(cfg, steps=6, resume=True))


def test_resume_refuses_a_checkpoint_from_before_answer_only_labels(tiny_target, corpus, tmp_path):
    """A checkpoint whose log lacks the newer corpus counts was trained on other windows and labels."""
    cfg = config(tiny_target, corpus, tmp_path / "e", "medusa", steps=4, eval_every=0, save_every=2)
    train(cfg)
    path = tmp_path / "e" / CHECKPOINT_FILE
    ckpt = torch.load(path, weights_only=True)
    for key in ("train_windows", "train_trained", "heldout_trained", "chats_trained_whole"):
        del ckpt["log"]["corpus"][key]
    torch.save(ckpt, path)
    with pytest.raises(SpecDecodeError, match="the corpus now reads as"):
        train(replace(cfg, steps=6, resume=True))


def test_chat_records_with_prompts_longer_than_a_window_train(tiny_target, tmp_path):
    """Windows holding only a prompt are left out, so held-out batches always hold labels (the
    first held-out windows were all prompt: division by zero); every net trains on the answers."""
    records = [{"messages": [{"role": "user", "content": f"tell me {i} " + "please " * 12},
                             {"role": "assistant", "content": f"the cat sat on mat {i}"}]} for i in range(12)]  # fmt: skip
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    for method in ("eagle", "dflash", "draft_model"):
        cfg = config(tiny_target, str(tmp_path / "data"), tmp_path / method, method, steps=3, seq_len=32,
                     batch_size=2, eval_batches=1, heldout=0.25)  # fmt: skip
        log = train(cfg)
        assert all(math.isfinite(v) for v in log["end"].values()), log["end"]
        c = log["corpus"]
        assert c["chats_trained_whole"] == 0 and 0 < c["train_trained"] < c["train_tokens"] / 2


def test_time_limit_ends_the_run_and_its_schedule(tiny_target, corpus, tmp_path):
    cfg = config(tiny_target, corpus, tmp_path / "out", method="medusa", steps=10**6, time_limit=0.5)
    assert cfg.learning_rate(50, elapsed=0.0) > 0.99 * cfg.lr  # early on both counts: near the peak
    assert cfg.learning_rate(50, elapsed=0.5) == pytest.approx(cfg.lr / 10)  # time is up: the floor
    log = train(cfg)
    assert 0 < log["end"]["step"] < 10**6 and log["train_seconds"] >= 0.5
    assert json.loads((tmp_path / "out" / LOG_FILE).read_text())["end"]["step"] == log["end"]["step"]
    with pytest.raises(SpecDecodeError, match="--time-limit"):
        replace(cfg, time_limit=0)


def test_init_trains_only_what_the_folder_lacks(tiny_target, corpus, tmp_path):
    """A confidence head added to a trained eagle: the loaded weights stay as they were."""
    from safetensors.torch import load_file

    first = tmp_path / "eagle"
    train(config(tiny_target, corpus, first, method="eagle", steps=10))
    cfg = config(tiny_target, corpus, tmp_path / "with_head", method="eagle", steps=15, lr=1e-2, init=str(first),
                 net_config={"confidence_head": True})  # fmt: skip
    log = train(cfg)
    before, after = load_file(str(first / "model.safetensors")), load_file(str(tmp_path / "with_head" / "model.safetensors"))
    assert set(after) - set(before) == {"confidence.weight", "confidence.bias"}
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert log["end"]["conf_err@1"] < log["start"]["conf_err@1"]
    with pytest.raises(SpecDecodeError, match="--init .* not a trained drafter folder"):
        replace(cfg, init=str(tmp_path))


def test_finetune_continues_training_the_folder(tiny_target, corpus, tmp_path):
    """--init with --finetune: the run starts where the folder ended and trains its weights."""
    from safetensors.torch import load_file

    first = tmp_path / "eagle"
    trained = train(config(tiny_target, corpus, first, method="eagle", steps=10, lr=1e-2))
    cfg = config(tiny_target, corpus, tmp_path / "more", method="eagle", steps=10, lr=1e-2, init=str(first),
                 finetune=True)  # fmt: skip
    log = train(cfg)
    assert log["start"]["loss"] == pytest.approx(trained["end"]["loss"], rel=1e-3)  # not a fresh net
    assert log["end"]["loss"] < log["start"]["loss"]
    before, after = load_file(str(first / "model.safetensors")), load_file(str(tmp_path / "more" / "model.safetensors"))
    assert set(before) == set(after) and not all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(SpecDecodeError, match="--finetune needs --init"):
        replace(cfg, init=None)


def test_init_with_more_layers_starts_as_the_folder_and_trains_the_new_one(tiny_target, corpus, tmp_path):
    """--init a one-layer eagle with num_layers 2 (--finetune): the new top layer starts as the
    identity, so the run's first held-out figures are the folder's, and then it trains."""
    from safetensors.torch import load_file

    first = tmp_path / "eagle"
    trained = train(config(tiny_target, corpus, first, method="eagle", steps=10, lr=1e-2,
                           net_config={"draft_vocab": 0, "num_layers": 1}))  # fmt: skip
    cfg = config(tiny_target, corpus, tmp_path / "deeper", method="eagle", steps=10, lr=1e-2, init=str(first),
                 finetune=True, net_config={"draft_vocab": 0, "num_layers": 2})  # fmt: skip
    log = train(cfg)
    for k in ("loss", "acc@1", "alpha@1"):
        assert log["start"][k] == pytest.approx(trained["end"][k], rel=1e-3), (k, log["start"], trained["end"])
    assert log["end"]["loss"] < log["start"]["loss"]
    after = load_file(str(tmp_path / "deeper" / "model.safetensors"))
    assert after["body.layers.1.attn.o.weight"].abs().sum() > 0 and after["body.layers.1.mlp.down.weight"].abs().sum() > 0


def tiny_net_and_chat(tiny_target: str, method: str) -> tuple:
    """(target, a fresh ``method`` net, tokens [2, 24], mask [2, 24]) with the mask of two chat
    records: prompts, a one-token user turn between answers, EOS and padding."""
    from specdecode.drafters.learned import net_config

    target = load_model(tiny_target, dtype="float32", device="cpu", progress=False).model
    V = target.config.vocab_size
    cls = trainer.net_class(method)
    torch.manual_seed(0)
    net = cls.from_target(net_config(cls, TINY_NETS[method]), target).eval()
    net.prepare(torch.ones(V, dtype=torch.long))
    tokens = torch.randint(4, V, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[:, :8] = False  # the prompts
    mask[1, 14] = False  # a second user turn, one token long (a draft of 2 could cross it)
    mask[0, 22:] = False  # the record's last positions (EOS, padding)
    return target, net, tokens, mask


@pytest.mark.parametrize("method", TINY_NETS)
def test_positions_not_trained_on_do_not_move_the_loss(tiny_target, method):
    """A chat record's prompt positions (mask False) are context only: the target's logits there
    are no label for any net, while a trained position's are."""
    target, net, tokens, mask = tiny_net_and_chat(tiny_target, method)
    batch = target_outputs.target_batch(target, tokens, mask, net.hidden_layers)
    noise = 5 * torch.randn(batch.logits.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loss, metrics = net.training_loss(batch)
        untrained = net.training_loss(replace(batch, logits=batch.logits + noise * (~mask)[..., None]))
        trained = net.training_loss(replace(batch, logits=batch.logits + noise * mask[..., None]))
    assert float(untrained[0]) == pytest.approx(float(loss), rel=1e-6) and untrained[1] == pytest.approx(metrics)
    assert float(trained[0]) != pytest.approx(float(loss), rel=1e-3)
    if method != "draft_model":  # (a distilled model learns every labelled position's distribution)
        # the prompt's last position: its logits give the answer's first token, which the target
        # samples itself, so no drafter learns them (nor a draft across the user turn before it)
        first = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=True)  # [B, T]
        with torch.no_grad():
            moved = net.training_loss(replace(batch, logits=batch.logits + noise * first[..., None]))
        assert float(moved[0]) == pytest.approx(float(loss), rel=1e-6), method


@pytest.mark.parametrize("method", TINY_NETS)
def test_the_cache_runs_the_targets_head_only_where_labels_are(tiny_target, method):
    """`TargetCache` keeps the top k only at trained positions (a placeholder elsewhere): every
    net's loss and metrics are those of the top k kept everywhere."""
    from specdecode.drafters.learned import TrainBatch

    target, net, tokens, mask = tiny_net_and_chat(tiny_target, method)
    batches = []
    for where in (None, mask):
        hidden, values, ids = target_outputs.target_top(target, tokens, net.hidden_layers, 6, chunk=5, mask=where)
        batches.append(TrainBatch(tokens, hidden, None, mask, target, top=(values, ids.to(torch.int32))))
    assert not torch.equal(batches[0].top[0], batches[1].top[0])  # the placeholder is there
    assert torch.equal(batches[0].top[0][mask], batches[1].top[0][mask])
    with torch.no_grad():
        torch.manual_seed(2)  # (dflash draws its anchors)
        everywhere = net.training_loss(batches[0])
        torch.manual_seed(2)
        labels_only = net.training_loss(batches[1])
    assert float(labels_only[0]) == pytest.approx(float(everywhere[0]), rel=1e-6)
    assert labels_only[1] == pytest.approx(everywhere[1])


@pytest.mark.parametrize("method", ["eagle", "medusa", "dflash"])
def test_bf16_mixed_precision_trains_fp32_weights(tiny_target, corpus, tmp_path, method, monkeypatch):
    """--bf16: the net's training pass runs under autocast (its matmuls see bfloat16), the loss
    still falls, and the weights and optimizer it updates stay fp32."""
    seen: list[torch.dtype] = []
    linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        out = linear(x, w, b)
        seen.append(out.dtype)  # autocast casts below F.linear: its output shows the matmul's dtype
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", spy)  # nn.Linear calls F.linear
    log = train(config(tiny_target, corpus, tmp_path / "out", method, bf16=True))
    assert log["end"]["loss"] < 0.8 * log["start"]["loss"], (log["start"], log["end"])
    assert torch.bfloat16 in seen  # autocast on: the net's linears run in bf16 during training
    ckpt = torch.load(tmp_path / "out" / CHECKPOINT_FILE, weights_only=False)
    assert all(t.dtype == torch.float32 for t in ckpt["net"].values() if t.is_floating_point())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="glibc on Linux")
def test_keep_freed_memory_is_accepted_by_glibc():
    """`specdecode train` asks glibc to keep freed memory: glibc accepts both options. (Whether a
    later block then reuses the kept pages depends on where other allocations landed in the
    heap, which varies from process to process, so no fault count is asserted.) In a child
    process: the setting is process-wide."""
    import subprocess
    import sys

    script = "from specdecode.train.malloc import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
