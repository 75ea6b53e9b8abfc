"""The training loop of `specdecode train`: a frozen target teaches a drafter's net.

Owns: resolving the method's net (its drafter's ``Net``), AdamW with the config's schedule,
held-out evaluation at the start, every ``eval_every`` steps and at the end, checkpoints
(``checkpoint.pt``: the net's trainable tensors, optimizer, step, RNG and log; written
every ``save_every`` steps and at the end) and resume from them, and writing the drafter
folder and ``train_log.json``.
Does not own: the target's outputs each `TrainBatch` is made of (target_outputs.py), the
nets and their losses (drafters/*, drafters/distill_net.py), the folder format
(drafters/learned.py), reading the corpus (corpus.py).

The batch at step s is a pure function of (seed, s): epoch e = s·B // N draws its own
seeded permutation of the N windows. With the RNG state in the checkpoint, a resumed run
therefore takes the same steps as an uninterrupted one. Target outputs are recomputed
each step unless ``cache_topk`` > 0: a whole distribution costs V floats per token (49k
for SmolLM2), so `TargetCache` keeps only the features (bf16) and the top-k logits of
each training window in memory; the soft labels are then the target's distribution
renormalised over its top k tokens. The target runs the first epoch, the net alone after.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdecode.config import SpecDecodeError, first_line
from specdecode.drafters.learned import (
    TrainBatch,
    net_config,
    read_net,
    read_net_config,
    save_net,
    target_fingerprint,
    write_whole,
)
from specdecode.model.transformer import Transformer
from specdecode.train.malloc import keep_freed_memory
from specdecode.train.config import CHECKPOINT_FILE, TrainConfig
from specdecode.train.corpus import Windows, find_files, read_corpus
from specdecode.drafters.distill_net import DistillNet
from specdecode.train.target_outputs import TargetCache, target_batch

LOG_FILE = "train_log.json"


def trainable_methods() -> list[str]:
    """The registry's methods whose drafter declares a Net of its own (layer_skip inherits one)."""
    from specdecode.drafters.registry import drafter_class, method_names

    return [m for m in method_names() if getattr(getattr(drafter_class(m), "Net", None), "method", None) == m]


def net_class(method: str) -> type:
    """The ``Net`` of ``method``'s drafter class, or a one-line error."""
    from specdecode.drafters.registry import drafter_class, method_names

    if method not in method_names():
        raise SpecDecodeError(f"unknown method {method!r} to train; trainable: {', '.join(trainable_methods())}")
    try:
        cls = drafter_class(method)
    except ImportError as e:
        raise SpecDecodeError(f"method {method!r} is not available: {e}") from None
    net = getattr(cls, "Net", None)  # only learned drafters declare one
    if net is None or net.method != method:  # (layer_skip inherits draft_model's, untrained)
        raise SpecDecodeError(f"method {method!r} has no network to train; trainable: {', '.join(trainable_methods())}")
    return net


def batch_rows(step: int, batch_size: int, num_windows: int, seed: int) -> Tensor:
    """Window indices of step ``step``: sample i is window perm_e[i mod N] of epoch e = i // N."""
    rows = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(i, num_windows)
        perm = torch.randperm(num_windows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        rows.append(int(perm[pos]))
    return torch.tensor(rows)


def evaluate(net: Any, target: Transformer, windows: Windows, cfg: TrainConfig) -> dict[str, float]:
    """Held-out loss and metrics, averaged over the trained positions (in chat records: where the
    assistant writes, as served) of the first ``eval_batches`` batches."""
    net.eval()
    sums: dict[str, float] = {}
    total = 0
    for start in range(0, min(len(windows), cfg.eval_batches * cfg.batch_size), cfg.batch_size):
        end = start + cfg.batch_size
        batch = target_batch(target, windows.tokens[start:end], windows.trained[start:end], net.hidden_layers)
        with torch.no_grad():
            loss, metrics = net.training_loss(batch)
        n = int(batch.mask.sum())
        for k, v in {"loss": float(loss.detach()), **metrics}.items():
            sums[k] = sums.get(k, 0.0) + float(v) * n
        total += n
    if not total:  # pack leaves out windows without a label, so only an empty held-out side gets here
        raise SpecDecodeError("the held-out windows hold no position to evaluate on")
    return {k: v / total for k, v in sums.items()}


def trainable_state(net: torch.nn.Module) -> dict[str, Tensor]:
    """The net's state less the frozen parameters (the target's it borrows, frozen embeddings)."""
    frozen = {n for n, p in net.named_parameters(remove_duplicate=False) if not p.requires_grad}  # tied too
    return {n: t.detach() for n, t in net.state_dict().items() if n not in frozen}


def save_checkpoint(
    cfg: TrainConfig, net: Any, opt: torch.optim.Optimizer, step: int, target: Transformer, log: dict
) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        "method": cfg.method, "net_config": asdict(net.config), "target": target_fingerprint(target), "step": step,
        "net": trainable_state(net), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [], "log": log,
    }  # fmt: skip
    write_whole(out / CHECKPOINT_FILE, lambda part: torch.save(state, part))


def read_checkpoint(cfg: TrainConfig) -> dict[str, Any]:
    path = Path(cfg.out) / CHECKPOINT_FILE
    if not path.is_file():
        raise SpecDecodeError(f"--resume: no {CHECKPOINT_FILE} in {cfg.out}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's advice (load it unsafely) is wrong for a foreign file
        raise SpecDecodeError(f"--resume: {path} is not a specdecode training checkpoint") from None
    except (RuntimeError, EOFError, OSError) as e:  # truncated
        raise SpecDecodeError(f"--resume: cannot read {path}: {first_line(e)}") from None
    if not isinstance(ckpt, dict):
        raise SpecDecodeError(f"--resume: {path} is not a specdecode training checkpoint")
    if ckpt.get("method") != cfg.method:
        raise SpecDecodeError(f"--resume: {cfg.out} holds a checkpoint for method {ckpt.get('method')!r}, not {cfg.method!r}")
    if not {"net_config", "target", "step", "net", "optimizer", "rng", "cuda_rng", "log"} <= set(ckpt):
        raise SpecDecodeError(f"--resume: {path} is not a specdecode training checkpoint")
    was = ckpt["log"].get("config", {}) if isinstance(ckpt["log"], dict) else {}
    for name in RESUME_FIXED:  # the corpus, its split and the batches: a resumed run must be the same run
        if name in was and _as_given(name, was[name]) != _as_given(name, getattr(cfg, name)):
            flag = "--" + name.replace("_", "-")
            raise SpecDecodeError(
                f"--resume: {flag} was {was[name]!r} in {cfg.out}, now {getattr(cfg, name)!r}; "
                "keep it as it was, or train into a new --out"
            )
    step, trained = ckpt["step"], ckpt["log"].get("train_seconds", 0.0) if isinstance(ckpt["log"], dict) else 0.0
    if step >= cfg.steps:  # nothing would train, and the output would be written again as it is
        raise SpecDecodeError(f"--resume: {cfg.out} is already at step {step}; give --steps above it to train further")
    if cfg.time_limit is not None and trained >= cfg.time_limit:  # the limit counts the earlier runs' time
        raise SpecDecodeError(f"--resume: {cfg.out} has trained {trained:.0f} s already; "
                              f"give --time-limit above it to train further")  # fmt: skip
    return ckpt


# What decides the data a run trains on, in which order, what it is evaluated on, and the target
# it learns (another of the same shape passes the fingerprint); --steps, --time-limit, the
# evaluation and checkpoint periods, threads and the cache may change.
RESUME_FIXED = ("target", "data", "max_tokens", "heldout", "seed", "seq_len", "batch_size", "init", "finetune")


def _as_given(name: str, value: Any) -> Any:
    if name == "data":  # two spellings of one folder are one corpus
        return tuple(str(Path(p).resolve()) for p in value)
    if name in ("init", "target") and value is not None and Path(value).exists():  # (a target may be an alias)
        return str(Path(value).resolve())
    return value


def restore(ckpt: dict[str, Any], net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Net tensors, optimizer state and RNG state from a checkpoint of the same method and net config."""
    if set(ckpt["net"]) != set(trainable_state(net)):
        raise SpecDecodeError(f"--resume: the checkpoint's tensors do not fit the {ckpt['method']} net")
    net.load_state_dict(ckpt["net"], strict=False)
    opt.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"])
    if ckpt["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["cuda_rng"])


def train_step(
    net: Any, opt: torch.optim.Optimizer, batch: TrainBatch, lr: float, bf16: bool = False
) -> tuple[float, dict[str, float]]:
    """One AdamW step at rate ``lr`` (gradients clipped to norm 1); the loss and the net's metrics.
    ``bf16``: the forward under autocast to bfloat16 (backward follows its casts); fp32 weights."""
    for group in opt.param_groups:
        group["lr"] = lr
    net.train()
    with torch.autocast(batch.tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, metrics = net.training_loss(batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step()
    return float(loss.detach()), metrics


def init_from(net: torch.nn.Module, folder: str, target: Transformer, freeze: bool = True) -> None:
    """Load a trained folder's weights into ``net``; with ``freeze`` they stay fixed, so that only
    what the folder lacks (a new confidence head, say) trains. A decoder layer the folder lacks
    (``num_layers`` raised) starts as the identity: its attention and MLP output projections are
    zeroed, so the net drafts as the folder's did until training moves them (as a zero-initialised
    residual branch, or LoRA's B)."""
    from specdecode.model.loader import check_shapes
    from specdecode.model.transformer import Block

    _, state = read_net(net.method, folder, target)
    own = net.state_dict()
    unexpected = [k for k in state if k not in own]
    if unexpected:
        raise SpecDecodeError(f"--init {folder}: tensors the net does not have: {unexpected[:3]}")
    # e.g. --net-config changed draft_vocab or num_layers
    check_shapes(state, own, f"--init {folder}", "this net; drop the --net-config keys that change it")
    net.load_state_dict(state, strict=False)
    with torch.no_grad():
        for prefix, module in net.named_modules():
            if isinstance(module, Block) and not any(k.startswith(prefix + ".") for k in state):
                for out in (module.attn.o, module.mlp.down):
                    out.weight.zero_()
                    if out.bias is not None:
                        out.bias.zero_()
    for name, p in net.named_parameters():
        if name in state and freeze:
            p.requires_grad_(False)


def write_drafter(net: Any, loaded: Any, out: str, extra: dict[str, Any]) -> Path:
    """The folder ``speculative_config {"method": M, "model": out}`` loads."""
    if isinstance(net, DistillNet):  # a whole model: an HF checkpoint that load_model reads
        return net.save_pretrained(out, loaded, extra)
    return save_net(net, loaded.model, out, extra)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training; returns the log also written to ``out/train_log.json``."""
    from tqdm import tqdm

    from specdecode.model.loader import load_model

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    cls = net_class(cfg.method)
    ckpt = read_checkpoint(cfg) if cfg.resume else None
    # --init: the folder's net config (of this method: another's keys are not this net's), with
    # --net-config's keys on top (e.g. a new head)
    given = {**read_net_config(cfg.init, cfg.method).get("net", {}), **cfg.net_config} if cfg.init else cfg.net_config
    net_cfg = net_config(cls, ckpt["net_config"] if ckpt else given)
    find_files(cfg.data)  # a bad corpus path fails before the target loads
    try:  # so does an --out that cannot be made (under a file, no permission), not at the first save
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecDecodeError(f"--out {cfg.out} cannot be made: {e.strerror}") from None
    loaded = load_model(cfg.target, dtype=cfg.dtype, device=cfg.device, progress=cfg.progress)
    target = loaded.model
    if ckpt and ckpt["target"] != target_fingerprint(target):
        raise SpecDecodeError(f"--resume: {cfg.out} was trained for a target with {ckpt['target']}")
    corpus = read_corpus(cfg.data, loaded.tokenizer, cfg.seq_len, cfg.max_tokens, cfg.heldout, cfg.seed,
                         stop_ids=target.config.eos_token_ids)  # fmt: skip
    sizes = {"train_tokens": corpus.train.num_tokens, "heldout_tokens": corpus.heldout.num_tokens,
             "train_windows": len(corpus.train), "train_trained": corpus.train.num_trained}
    was = ckpt["log"].get("corpus", {}) if ckpt and isinstance(ckpt["log"], dict) else {}
    if was and any(was.get(k) != v for k, v in sizes.items()):  # same flags, other text (or how it is read:
        # a checkpoint from before answer-only labels lacks the newer counts)
        raise SpecDecodeError(f"--resume: the corpus now reads as {sizes}, the checkpoint's as "
                              f"{ {k: was.get(k) for k in sizes} }; train into a new --out")  # fmt: skip
    torch.manual_seed(cfg.seed)
    net = cls.from_target(net_cfg, target).to(target.embed.weight.device)
    if ckpt and cfg.net_config:  # compared as the nets resolve them (eagle fills in its feature layers)
        # (with --init, as a fresh run resolves them: the folder's keys under the given ones)
        if cls.from_target(net_config(cls, given), target).config != net.config:
            raise SpecDecodeError(f"--resume: --net-config differs from the checkpoint's {asdict(net.config)}")
    # the tokens drafted: those at a trained position's next (EAGLE-3's draft vocabulary is the commonest)
    labels = corpus.train.tokens[:, 1:][corpus.train.trained[:, :-1]]
    counts = torch.bincount(labels, minlength=target.config.vocab_size)
    net.prepare(counts[: target.config.vocab_size].to(target.embed.weight.device))
    if cfg.init:  # after prepare: the folder's draft vocabulary wins
        init_from(net, cfg.init, target, freeze=not cfg.finetune)
    params = [p for p in net.parameters() if p.requires_grad]
    if not params:
        raise SpecDecodeError(f"the {cfg.method} net has no trainable parameters")
    for p in params:  # trained in fp32 whatever the target's dtype
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    log: dict[str, Any] = {
        "method": cfg.method, "target": loaded.name, "net": asdict(net_cfg), "config": asdict(cfg),
        "corpus": {"files": corpus.num_files, "documents": corpus.num_documents, "dropped_quoting": corpus.num_dropped,
                   **sizes, "heldout_trained": corpus.heldout.num_trained, "chats_trained_whole": corpus.num_whole},
        "evals": [], "train_loss": [],
    }  # fmt: skip
    step = 0
    if ckpt:
        restore(ckpt, net, opt)
        step, log = ckpt["step"], {**ckpt["log"], "config": asdict(cfg)}
    else:
        log["start"] = {"step": 0, **evaluate(net, target, corpus.heldout, cfg)}
        log["evals"].append(log["start"])
    cache = None
    if cfg.cache_topk:  # k >= V: all
        k, width = min(cfg.cache_topk, target.config.vocab_size), len(net.hidden_layers) * target.config.hidden_size
        cache = TargetCache(k, corpus.train, width, target.embed.weight.device)
    bar = tqdm(total=cfg.steps, initial=step, disable=not cfg.progress, desc=f"train {cfg.method}", unit="step")
    tokens, t0 = 0, time.perf_counter()
    before = log.get("train_seconds", 0.0)  # training time of earlier runs of a resumed checkpoint
    while step < cfg.steps and not cfg.out_of_time(before + time.perf_counter() - t0):
        rows = batch_rows(step, cfg.batch_size, len(corpus.train), cfg.seed)
        if cache is not None:
            batch = cache.batch(target, rows, net.hidden_layers)
        else:
            batch = target_batch(target, corpus.train.tokens[rows], corpus.train.trained[rows], net.hidden_layers)
        lr = cfg.learning_rate(step, before + time.perf_counter() - t0)
        loss, metrics = train_step(net, opt, batch, lr, cfg.bf16)
        step += 1
        tokens += int(corpus.train.mask[rows].sum())
        log["train_loss"].append(loss)
        rate = tokens / (time.perf_counter() - t0)
        bar.set_postfix({"loss": f"{loss:.3f}", **{k: f"{v:.3f}" for k, v in metrics.items() if "@1" in k},
                         "tok/s": f"{rate:.0f}"})  # fmt: skip
        bar.update(1)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            log["evals"].append({"step": step, **evaluate(net, target, corpus.heldout, cfg)})
        if step % cfg.save_every == 0 and step < cfg.steps:
            log["train_seconds"] = before + time.perf_counter() - t0
            save_checkpoint(cfg, net, opt, step, target, log)
    bar.close()
    elapsed = time.perf_counter() - t0
    log["train_tokens_per_s"] = tokens / elapsed if tokens else None
    log["train_seconds"] = before + elapsed
    if not log["evals"] or log["evals"][-1]["step"] != step:
        log["evals"].append({"step": step, **evaluate(net, target, corpus.heldout, cfg)})
    log["end"] = log["evals"][-1]
    save_checkpoint(cfg, net, opt, step, target, log)
    write_drafter(net, loaded, cfg.out, {"trained": {"steps": step, "heldout": log["end"]}})
    (Path(cfg.out) / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
    return log


def cmd_train(args: argparse.Namespace) -> int:
    """`specdecode train`: train, then print the held-out metrics at the start and the end."""
    cfg = TrainConfig.from_args(args)
    keep_freed_memory()  # this process only trains (a library caller's `train` leaves malloc alone)
    log = train(cfg)
    start, end = log.get("start", {}), log["end"]
    for label, ev in (("start", start), ("end", end)):
        if ev:
            print(
                f"held-out {label} (step {ev['step']}): "
                + "  ".join(f"{k} {v:.4f}" for k, v in ev.items() if k != "step")
            )
    print(f"wrote {args.out}")
    return 0
