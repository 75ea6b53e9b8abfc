"""What every learned drafter shares: its folder on disk, the trainer's contract, and
the target features it is handed between rounds.

Owns: `DraftNet` (the protocol of a trainable draft network, which `specdecode train`
drives), `TrainBatch` (what one training step sees), `save_net` / `load_net` (an
HF-style folder: ``config.json`` + ``model.safetensors``), `resolve_weights` (a given
folder, else the weights shipped for this target under ``specdecode/weights``), and
`PendingFeatures` (target features a drafter has been handed but not consumed yet).
Does not own: any network (medusa.py, eagle.py, ... each own theirs) or the training
loop (specdecode/train/).

Only a net's own weights are saved: the token embedding, final norm and LM head it
borrows from the target are not, so a drafter stays a few MB and follows the target.
The folder records which target it was trained for, and loading refuses another one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor

from specdecode.config import SpecDecodeError, first_line

if TYPE_CHECKING:
    from specdecode.model.loader import LoadedModel
    from specdecode.model.transformer import Transformer

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"  # drafters shipped with the package
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclass
class TrainBatch:
    """One training step's data: a batch of corpus windows and the frozen target's view of them.

    ``logits[b, t]`` (or ``top``) is the target's distribution for token ``t + 1`` (as in decoding);
    ``hidden[b, t]`` its features at token ``t`` (the net's ``hidden_layers``,
    concatenated in that order). ``mask[b, t]``: ``logits[b, t]`` is a label to learn (a real
    token and, in a chat record, token ``t + 1`` is the assistant's: where serving drafts).
    A draft from position t to t + k learns only where both are. Padding sits at the right.
    """

    tokens: Tensor  # [B, T] int64
    hidden: Tensor  # [B, T, F]
    logits: Tensor | None  # [B, T, V] fp32 or bf16; None when only ``top`` is kept
    mask: Tensor  # [B, T] bool
    target: "Transformer"  # frozen: nets borrow its embedding, norm and LM head
    # the target's k largest logits (values [B, T, k] fp32, token ids [B, T, k], largest first), the
    # rest taken as -inf: the trainer's cache keeps these, and [B, T, V] is never built (hundreds of MB a step)
    top: tuple[Tensor, Tensor] | None = None

    def probs_at(self, ids: Tensor, where: Tensor | None = None) -> Tensor:
        """The target's probability of each token of ``ids`` [Vd] (normalised over its whole
        vocabulary, or its top k): [B, T, Vd] fp32; with ``where``, an index into [B, T] (a bool
        mask, or index tensors), only at those positions: [N, Vd] in row-major order of a mask
        (for a net that computes its logits only where it learns)."""
        if self.top is None:
            assert self.logits is not None
            logits = (self.logits if where is None else self.logits[where]).float()
            return (logits[..., ids] - logits.logsumexp(-1, keepdim=True)).exp()
        values, top_ids = self.top if where is None else (t[where] for t in self.top)
        p = torch.softmax(values.float(), dim=-1)  # [..., k]
        slot = torch.full((self.target.config.vocab_size,), len(ids), dtype=torch.long, device=ids.device)
        slot[ids] = torch.arange(len(ids), device=ids.device)  # token id -> column; len(ids): not in ids
        out = p.new_zeros(*p.shape[:-1], len(ids) + 1).scatter_add_(-1, slot[top_ids.long()], p)
        return out[..., :-1]

    def argmax(self) -> Tensor:
        """The target's most likely next token at each position: [B, T]."""
        if self.top is None:
            assert self.logits is not None
            return self.logits.argmax(dim=-1)
        return self.top[1][..., 0].long()

    def full_logits(self) -> Tensor:
        """[B, T, V]: the logits, or the top k with -inf elsewhere (for a net over the whole vocabulary)."""
        if self.top is None:
            assert self.logits is not None
            return self.logits
        values, top_ids = self.top
        V = self.target.config.vocab_size
        return values.new_full((*values.shape[:2], V), float("-inf")).scatter_(-1, top_ids.long(), values)


def label_rows(where: Tensor, bucket: int = 256) -> Tensor:
    """Flat indices [M] of ``where``'s True entries (row-major), padded to a multiple of ``bucket``
    by repeating the first (M = N rounded up; nothing to pad when N = 0). A net that runs its head
    only at labels runs it on ``x.flatten(0, -2)[rows]`` and reads the first N rows: the matmuls
    then see few distinct shapes. (On CPU oneDNN keeps a primitive per shape; a new N every step
    would grow a training process's memory without bound.)"""
    rows = where.reshape(-1).nonzero()[:, 0]
    pad = -len(rows) % bucket
    return torch.cat([rows, rows[:1].expand(pad)]) if len(rows) and pad else rows


class DraftNet(Protocol):
    """A trainable draft network (an ``nn.Module``). Its drafter class names it as ``Net``."""

    Config: ClassVar[type]  # frozen dataclass: the net's shape; `specdecode train --net-config` sets it
    method: ClassVar[str]  # the registry name it is saved under
    config: Any
    hidden_layers: tuple[int, ...]  # target layers it reads, resolved for this target (-1 = final normed)

    @classmethod
    def from_target(cls, config: Any, target: "Transformer") -> "DraftNet":
        """A fresh net for ``target`` (initialised from the target's weights where the method says)."""
        ...

    def prepare(self, token_counts: Tensor) -> None:
        """Called once before training with the training corpus's token counts [V] (EAGLE-3
        keeps a draft vocabulary of the most frequent tokens); a no-op for most nets."""
        ...

    def training_loss(self, batch: TrainBatch) -> tuple[Tensor, dict[str, float]]:
        """The loss to minimise, and metrics for the progress bar and held-out evaluation.
        Metrics include ``acc@k`` (the net's top-1 equals the target's at draft position k)
        and ``alpha@1`` (expected acceptance of its first draft token, Σ min(p, q))."""
        ...

    def saved_state(self) -> dict[str, Tensor]:
        """The tensors that make up the saved file: the net's own, not the target's it borrows."""
        ...


def target_fingerprint(target: "Transformer") -> dict[str, Any]:
    """What must match between the target a net was trained on and the one it drafts for."""
    c = target.config
    return {
        "architecture": c.architecture,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
        "vocab_size": c.vocab_size,
    }


def save_net(net: "DraftNet", target: "Transformer", out_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` (method, net config, target fingerprint, ``extra``) and weights."""
    out = Path(out_dir)
    meta = {
        "specdecode_method": net.method,
        "net": asdict(net.config),
        "target": target_fingerprint(target),
        **(extra or {}),
    }
    # bf16 on disk: half the size, and a drafter's rounding cannot change the output (it is verified)
    state = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v).detach().to("cpu").contiguous()
        for k, v in net.saved_state().items()
    }
    return write_folder(out, meta, state)


def write_folder(
    out: Path, config: dict[str, Any], state: dict[str, Tensor], more: Callable[[Path], None] | None = None
) -> Path:
    """Replace a trained folder's files so that it never holds one run's config beside another's
    weights: the old config.json goes first, the weights (and ``more``'s files) are written
    whole, and the new config.json, written last, marks the folder complete."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).unlink(missing_ok=True)
    write_whole(out / WEIGHTS_FILE, lambda part: save_file(state, str(part)))
    if more is not None:
        more(out)
    write_whole(out / CONFIG_FILE, lambda part: part.write_text(json.dumps(config, indent=2) + "\n"))
    return out


def write_whole(file: Path, write: Callable[[Path], Any]) -> None:
    """``write`` to a temporary file beside ``file``, then rename it into place; nothing
    half-written is left behind (disk full, Ctrl-C)."""
    part = file.with_name(f".{file.name}.{os.getpid()}.part")
    try:
        write(part)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, file)


def read_net_config(path: str | Path, method: str | None = None) -> dict[str, Any]:
    """A drafter folder's config.json; with ``method``, refused unless it holds that method's net."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise SpecDecodeError(f"{path} is not a trained drafter folder (no {CONFIG_FILE})")
    try:
        meta = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise SpecDecodeError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise SpecDecodeError(f"{file} must hold a JSON object, got {type(meta).__name__}")
    if method is not None and meta.get("specdecode_method") != method:
        raise SpecDecodeError(f"{path} holds a drafter for method {meta.get('specdecode_method')!r}, not {method!r}")
    return meta


def net_config(cls: type, values: dict[str, Any]) -> Any:
    """``cls.Config`` from a JSON object, unknown keys refused by name (one line)."""
    if not isinstance(values, dict):
        raise SpecDecodeError(f"net config must be a JSON object, got {values!r}")
    known = {f.name for f in fields(cls.Config)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SpecDecodeError(f"unknown {cls.method} net key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    try:
        return cls.Config(**values)
    except TypeError as e:
        raise SpecDecodeError(f"bad {cls.method} net config: {e}") from None


def read_net(method: str, path: str | Path, target: "Transformer") -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json, tensors) of a folder holding a ``method`` net trained for ``target``."""
    from safetensors.torch import load_file

    meta = read_net_config(path, method)
    want, got = target_fingerprint(target), meta.get("target")
    if got != want:
        raise SpecDecodeError(f"{path} was trained for a target with {got}, this target has {want}")
    try:
        return meta, load_file(str(Path(path) / WEIGHTS_FILE))
    except Exception as e:  # missing, truncated, not safetensors (SafetensorError is no OSError)
        raise SpecDecodeError(f"{path}: cannot read {WEIGHTS_FILE}: {first_line(e)}") from None


def load_net(
    cls: type, path: str | Path, target: "Transformer", dtype: torch.dtype, device: torch.device,
    quantization: str | None = None,
) -> Any:  # fmt: skip
    """A trained net of class ``cls`` from ``path``, checked against ``target``; its linears in
    ``quantization``'s format (the target's) when given."""
    from specdecode.model.loader import check_shapes
    from specdecode.model.quant import quantize_linears_
    from specdecode.model.transformer import Transformer

    meta, state = read_net(cls.method, path, target)
    net = cls.from_target(net_config(cls, meta.get("net", {})), target)
    expected = set(net.saved_state())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise SpecDecodeError(f"{path}: weights do not fit the net (missing {missing[:3]}, unexpected {extra[:3]})")
    check_shapes(state, net.state_dict(), str(path), f"the {cls.method} net its config.json describes")
    V = target.config.vocab_size
    for name in (k for k in state if k.endswith("vocab_ids")):  # a draft vocabulary indexes the target's
        ids = state[name]
        if ids.is_floating_point() or ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < V:
            raise SpecDecodeError(f"{path}: {name} must be token ids in [0, {V}) of the target's vocabulary")
    net.load_state_dict(state, strict=False)
    net = net.to(device=device)
    for param in net.parameters():  # not net.to(dtype): that also rounds RoPE's frequency buffers, fp32 in the target
        param.data = param.data.to(dtype)  # (bf16 ones are off by 2 radians at position 1000)
    net = quantize_linears_(net.eval().requires_grad_(False), quantization)
    for body in (m for m in net.modules() if isinstance(m, Transformer)):
        body.use_cpu_blocks()  # a decoder body with final weights: the fused CPU block, where it applies
    return net


def resolve_weights(method: str, model: str | None, target: "LoadedModel") -> str:
    """``model`` if given, else the folder shipped for this target, else a one-line error."""
    if model is not None:
        if not Path(model).is_dir():
            raise SpecDecodeError(f"{method} model {model!r} is not a folder; train one with `specdecode train --method {method}`")
        return model
    folder = shipped_folder(method, target)
    if folder is None:
        raise SpecDecodeError(
            f'{method} needs "model": a folder written by `specdecode train --method {method}`; '
            f"no {method} weights ship for {target.name}"
        )
    return folder


def shipped_folder(method: str, target: "LoadedModel") -> str | None:
    """The folder under ``specdecode/weights`` whose config.json names ``method`` and this target, or None."""
    want = target_fingerprint(target.model)
    for folder in sorted(WEIGHTS_DIR.glob("*")) if WEIGHTS_DIR.is_dir() else []:
        meta = read_net_config(folder) if (folder / CONFIG_FILE).is_file() else {}
        if meta.get("specdecode_method") == method and meta.get("target") == want:
            return str(folder)
    return None


class PendingFeatures:
    """Per row, the target features handed to a drafter (prefill / on_verified) that it has
    not consumed yet, and how many it has consumed before them (the row's feature count)."""

    def __init__(self) -> None:
        self.rows: list[Tensor] = []  # [n_b, F] each
        self.consumed: list[int] = []

    def add_rows(self, hidden: list[Tensor]) -> None:
        """Rows joining at the end, with their prompt features."""
        self.rows += list(hidden)
        self.consumed += [0] * len(hidden)

    def add_verified(self, hidden: Tensor, num_accepted: Tensor) -> None:
        """hidden [B, W, F]: row b gained its first ``num_accepted[b] + 1`` features."""
        for b, n in enumerate((num_accepted + 1).tolist()):
            self.rows[b] = torch.cat([self.rows[b], hidden[b, :n]])

    def take(self, rows: list[int] | None = None, leave: int = 0) -> tuple[list[Tensor], list[int]]:
        """The pending features of ``rows`` (default: all), each row's last ``leave`` kept
        pending, and the index of each row's first one."""
        taken, starts = [], []
        for r in range(len(self.rows)) if rows is None else rows:
            n = max(0, len(self.rows[r]) - leave)
            taken.append(self.rows[r][:n])
            starts.append(self.consumed[r])
            self.consumed[r] += n
            self.rows[r] = self.rows[r][n:]
        return taken, starts

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
        self.consumed = [self.consumed[r] for r in rows]

