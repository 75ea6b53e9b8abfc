"""`TrainConfig`: every setting of one `specdecode train` run, validated where it enters.

Owns: the frozen dataclass, its checks (one-line `SpecDecodeError`s), the learning-rate
schedule it implies, and building it from the CLI's arguments.
Does not own: the method's net config (its `Config`, parsed by `learned.net_config`
once the net class is known) or anything that needs the target or the corpus.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdecode.config import SpecDecodeError

CHECKPOINT_FILE = "checkpoint.pt"  # in --out: what --resume continues from


@dataclass(frozen=True)
class TrainConfig:
    method: str
    data: tuple[str, ...]
    out: str
    target: str | None = None  # path or alias; None = the default model
    net_config: dict[str, Any] = field(default_factory=dict)  # the net's Config keys
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 5e-4  # AdamW peak; linear warmup, then cosine decay to a tenth
    warmup: int = 20  # warmup steps, at most a fifth of the run
    weight_decay: float = 0.01
    eval_every: int = 100  # 0 = only at the start and the end
    eval_batches: int = 4  # held-out batches per evaluation
    save_every: int = 100  # checkpoint period in steps (and always at the end)
    max_tokens: int = 1_000_000  # corpus cap (train + held-out)
    heldout: float = 0.05  # fraction of documents held out for evaluation
    seed: int = 0
    threads: int | None = None
    dtype: str = "auto"  # of the frozen target
    device: str = "auto"
    resume: bool = False
    progress: bool = True
    cache_topk: int = 0  # > 0: keep each training window's target outputs in memory after its first
    #   epoch (features in bf16, the top-k logits), so later epochs skip the target
    init: str | None = None  # a trained folder to start from; its weights stay frozen
    finetune: bool = False  # with init: its weights train too (a warm start on new data)
    time_limit: float | None = None  # seconds of training; the run ends at --steps or here, whichever
    #   comes first, and the schedule follows whichever is further along
    overwrite: bool = False  # replace a drafter or checkpoint already in `out` (else refused without --resume)
    bf16: bool = False  # mixed precision: the net's training pass under torch.autocast(bfloat16); its weights,
    #   gradients and AdamW stay fp32, held-out evaluation runs fp32 (transformers' --bf16)


    def __post_init__(self) -> None:
        if not self.method:
            raise SpecDecodeError("--method is required: medusa, eagle, eagle3, mtp, dflash or draft_model")
        positive = {"steps": self.steps, "batch_size": self.batch_size, "seq_len": self.seq_len,
                    "eval_batches": self.eval_batches, "save_every": self.save_every, "max_tokens": self.max_tokens}  # fmt: skip
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise SpecDecodeError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.seq_len < 2:
            raise SpecDecodeError(f"--seq-len must be >= 2, got {self.seq_len}")
        for name, value in {"warmup": self.warmup, "eval_every": self.eval_every, "cache_topk": self.cache_topk}.items():
            if not isinstance(value, int) or value < 0:
                raise SpecDecodeError(f"--{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise SpecDecodeError(f"--lr must be a positive number, got {self.lr!r}")
        if self.time_limit is not None and not (
            isinstance(self.time_limit, (int, float)) and self.time_limit > 0 and math.isfinite(self.time_limit)
        ):
            raise SpecDecodeError(f"--time-limit must be a positive number of seconds, got {self.time_limit!r}")
        if not 0 <= self.weight_decay < 1:
            raise SpecDecodeError(f"--weight-decay must be in [0, 1), got {self.weight_decay}")
        if not 0 < self.heldout < 1:
            raise SpecDecodeError(f"--heldout must be in (0, 1), got {self.heldout}")
        if self.threads is not None and self.threads < 1:
            raise SpecDecodeError(f"--threads must be >= 1, got {self.threads}")
        if not self.data:
            raise SpecDecodeError("--data needs at least one file or folder")
        for path in self.data:
            if not path.strip():  # Path("") is ".": the current folder
                raise SpecDecodeError("--data has an empty path")
            if not Path(path).exists():
                raise SpecDecodeError(f"data path not found: {path}")
        if self.init is not None and not (Path(self.init) / "config.json").is_file():
            raise SpecDecodeError(f"--init {self.init} is not a trained drafter folder (no config.json)")
        if self.finetune and self.init is None:
            raise SpecDecodeError("--finetune needs --init: the trained folder to continue from")
        if self.init is not None and self.method == "draft_model":
            raise SpecDecodeError("--init applies to medusa, eagle, eagle3, mtp and dflash nets, not draft_model")
        if not self.out:
            raise SpecDecodeError("--out is required: the folder to write the drafter to")
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise SpecDecodeError(f"--out {self.out} exists and is not a folder")
        # what a run writes there (the checkpoint, learned.CONFIG_FILE: not imported, it brings torch
        # into `specdecode --help`): another run's, kept unless asked
        held = [f for f in (CHECKPOINT_FILE, "config.json") if (Path(self.out) / f).is_file()]
        if held and not (self.resume or self.overwrite):
            raise SpecDecodeError(f"--out {self.out} already holds a trained drafter ({', '.join(held)}); "
                                  "--resume continues it, --overwrite replaces it, or choose a new --out")  # fmt: skip
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2**32):  # as numpy's; batches derive int64 seeds
            raise SpecDecodeError(f"--seed must be an integer in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.net_config, dict):
            raise SpecDecodeError(f"--net-config must be a JSON object, got {self.net_config!r}")

    def learning_rate(self, step: int, elapsed: float = 0.0) -> float:
        """The rate for optimizer step ``step`` (0-based) after ``elapsed`` seconds of training:
        linear warmup over steps, then cosine to lr / 10 over the run's progress (by steps, or by
        time under ``time_limit`` where that is further along)."""
        warmup = min(self.warmup, self.steps // 5)
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.steps - warmup)
        if self.time_limit:
            progress = max(progress, elapsed / self.time_limit)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def out_of_time(self, elapsed: float) -> bool:
        return self.time_limit is not None and elapsed >= self.time_limit

    @staticmethod
    def from_args(args: argparse.Namespace) -> TrainConfig:
        try:
            net = json.loads(args.net_config) if args.net_config else {}
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"--net-config is not valid JSON: {e}") from None
        return TrainConfig(
            method=args.method or "", data=tuple(args.data), out=args.out, target=args.target, net_config=net,
            steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
            weight_decay=args.weight_decay, eval_every=args.eval_every, eval_batches=args.eval_batches,
            save_every=args.save_every, max_tokens=args.max_tokens, heldout=args.heldout, seed=args.seed,
            threads=args.threads, dtype=args.dtype, device=args.device, resume=args.resume,
            progress=not args.quiet, cache_topk=args.cache_topk, time_limit=args.time_limit, init=args.init,
            finetune=args.finetune, overwrite=args.overwrite, bf16=args.bf16,
        )  # fmt: skip


def add_train_arguments(t: argparse.ArgumentParser) -> None:
    """The `train` subcommand's options (defaults from `TrainConfig`)."""
    d = TrainConfig
    t.add_argument("--method", default=None, help="medusa, eagle, eagle3, mtp, dflash or draft_model")
    t.add_argument(
        "--target", default=None, help="the frozen target: HF folder, .gguf or alias (default: SmolLM2-135M-Instruct)"
    )
    t.add_argument(
        "--data",
        nargs="+",
        default=[],
        help="files or folders (recursively *.txt *.md *.py *.rst, *.jsonl of {text} or {messages})",
    )
    t.add_argument("--out", default="", help="output folder (the drafter, checkpoint.pt, train_log.json)")
    t.add_argument("--net-config", default=None, help="JSON of the net's Config, e.g. '{\"num_layers\": 2}'")
    t.add_argument("--steps", type=int, default=d.steps)
    t.add_argument("--batch-size", type=int, default=d.batch_size)
    t.add_argument("--seq-len", type=int, default=d.seq_len)
    t.add_argument("--lr", type=float, default=d.lr, help="AdamW peak rate (warmup, then cosine to a tenth)")
    t.add_argument("--warmup", type=int, default=d.warmup)
    t.add_argument("--weight-decay", type=float, default=d.weight_decay)
    t.add_argument("--eval-every", type=int, default=d.eval_every, help="0 = only at the start and the end")
    t.add_argument("--eval-batches", type=int, default=d.eval_batches)
    t.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint period in steps")
    t.add_argument("--max-tokens", type=int, default=d.max_tokens, help="corpus cap in tokens")
    t.add_argument("--heldout", type=float, default=d.heldout, help="fraction of documents held out")
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    t.add_argument("--dtype", default=d.dtype, help="the target's dtype: auto (bfloat16), float32, bfloat16, float16")
    t.add_argument("--device", default=d.device, help="auto, cpu, cuda")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    t.add_argument("--overwrite", action="store_true",
                   help="replace a drafter or checkpoint already in --out (else refused, as HF's output_dir)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--bf16", action="store_true",
                   help="mixed precision: the net's matmuls in bfloat16 (torch.autocast; weights and AdamW stay "
                        "fp32); several times faster on CPUs with AMX and on GPUs")
    t.add_argument("--init", default=None,
                   help="start from this trained folder (same method and target) with its weights frozen: only "
                        "what it lacks trains, e.g. --net-config '{\"confidence_head\": true}'")
    t.add_argument("--finetune", action="store_true",
                   help="with --init: train the folder's weights too (continue training it, e.g. on new data)")
    t.add_argument("--time-limit", type=float, default=None,
                   help="seconds of training: stop at --steps or here, whichever comes first (the learning-rate "
                        "schedule follows whichever is further along)")
    t.add_argument("--cache-topk", type=int, default=d.cache_topk,
                   help="K > 0: after a window's first use, keep its target features and top-K logits in memory "
                        "(the soft labels keep the top K tokens); later epochs skip the target. 0 = recompute")
