"""Tensor parallelism of the target: starting the ranks, and rank 0 telling the others what to run.

Owns: `launch` (spawn the other ranks as local processes, or join a ``torchrun``
world), the `Lead` that rank 0's model carries (each target pass, each borrowed use of the LM
head and each change to a cache is sent to the other ranks before rank 0 runs its own part),
`follow` (the loop of the other ranks) and `TensorParallel.close`.
Does not own: the sharded forward and the weight cut (transformer.py, shard.py); the engine,
which runs on rank 0 and sees an ordinary model there.

Why the engine and the drafter run on rank 0 only: scheduling, drafting and verification read
the full logits, which rank 0 has after the head's gather, and they take decisions from clocks
and arrivals that the other ranks could not repeat. The drafter is not sharded: drafts come
from copies or small models, for which two all-reduces per layer and draft step would cost
more than they save. A drafter that borrows the target's LM head (EAGLE's draft vocabulary)
calls it through the lead, so the other ranks compute their rows. Messages are Python objects
over a gloo group (CPU tensors), also when the passes' tensors go over NCCL.

The other ranks keep their caches in step by replaying, in order, every call that changed
rank 0's cache (the block tables, prefix sharing and rollbacks are deterministic), so no block
table is sent with a pass; the callbacks the prefix cache takes are replayed by their answers.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdecode.cache.kv_cache import NoCache
from specdecode.config import SpecDecodeError
from specdecode.model.loader import LoadedModel, load_config, load_model, resolve_device
from specdecode.model.quant import parse_quantization
from specdecode.model.shard import Shard, check_tensor_parallel

# The cache methods that change what a cache holds (the engine's and the cost probes' calls).
MUTATORS = ("add_sequence", "free_sequence", "free_all", "set_batch", "reserve", "commit", "truncate",
            "keep_slots", "select_rows", "match_prefix", "publish")  # fmt: skip
_CALLBACK = "<callback>"  # a callable argument, replayed from its recorded answers


def _walk(x: Any, tensor: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] = lambda v: v) -> Any:
    """``x`` with each tensor in its lists, tuples and dicts mapped by ``tensor``, anything else by ``other``."""
    if isinstance(x, torch.Tensor):
        return tensor(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_walk(v, tensor, other) for v in x)
    if isinstance(x, dict):
        return {k: _walk(v, tensor, other) for k, v in x.items()}
    return other(x)


def _snapshot(x: Any) -> Any:
    """A picklable copy, taken now: tensors on the CPU, lists copied (the engine keeps growing
    a sequence's token list), callables replaced by a marker."""
    return _walk(x, lambda t: t.detach().to("cpu", copy=True),
                 lambda v: _CALLBACK if callable(v) and not isinstance(v, type) else v)  # fmt: skip


def _to(x: Any, device: torch.device) -> Any:
    return _walk(x, lambda t: t.to(device))


class Lead:
    """Rank 0's side: what the model and its caches call before running their own part."""

    def __init__(self, group: Any) -> None:
        self.group = group  # the gloo group that carries the messages
        self.pending: list[tuple] = []  # cache operations since the last message, in order
        self._ids = itertools.count()

    def send(self, kind: str, cid: int | None = None, payload: Any = None) -> None:
        message, self.pending = [(self.pending, (kind, cid, payload))], []
        dist.broadcast_object_list(message, src=0, group=self.group)

    def forward(self, cache: Any, *args: Any, **kwargs: Any) -> None:
        if not hasattr(cache, "tp_id"):  # a cache the model did not make: a pass without one
            if not isinstance(cache, NoCache):
                raise TypeError("a tensor-parallel target runs on caches it made (new_cache, new_paged_cache)")
            self.mirror(cache, ("none", cache.batch_size))
        self.send("forward", cache.tp_id, _snapshot((args, kwargs)))

    def head(self, x: torch.Tensor, fused: bool, exact: bool) -> None:
        self.send("head", None, _snapshot((x, fused, exact)))

    def mirror(self, cache: Any, spec: tuple) -> Any:
        """Give ``cache`` a twin on every other rank, and record each change made to it."""
        cid = cache.tp_id = next(self._ids)
        self.pending.append(("new", cid, spec))
        weakref.finalize(cache, self._dropped, cid)
        ref, depth = weakref.ref(cache), [0]
        for name in MUTATORS:
            if hasattr(cache, name):
                setattr(cache, name, self._recorded(ref, getattr(type(cache), name), name, cid, depth))
        return cache

    def _dropped(self, cid: int) -> None:
        self.pending.append(("drop", cid, None))

    def _recorded(self, ref: Callable, method: Callable, name: str, cid: int, depth: list[int]) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:  # a mutator calling another: the outer call is what gets replayed
                return method(ref(), *args, **kwargs)
            answers: list = []

            def recording(f: Callable) -> Callable:
                def answer(*a: Any) -> Any:
                    out = f(*a)
                    answers.append(out if out is None or isinstance(out, bool) else True)
                    return out
                return answer

            args = tuple(recording(a) if callable(a) and not isinstance(a, type) else a for a in args)
            kwargs = {k: recording(v) if callable(v) and not isinstance(v, type) else v for k, v in kwargs.items()}
            logged = _snapshot((args, kwargs))  # before the call: it may change what it was given
            depth[0] += 1
            raised = True
            try:
                out = method(ref(), *args, **kwargs)
                raised = False
                return out
            finally:
                depth[0] -= 1
                self.pending.append(("call", cid, (name, *logged, answers, raised)))
        return call


def follow(model: Any, group: Any, device: torch.device) -> None:
    """The loop of a rank other than 0: replay rank 0's cache changes, run its passes on this
    rank's shard, until rank 0 says stop."""
    caches: dict[int, Any] = {}
    while True:
        message: list = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        pending, (kind, cid, payload) = message[0]
        for op in pending:
            _replay(model, caches, op, device)
        if kind == "stop":
            return
        if kind == "forward":
            (tokens, positions), kwargs = _to(payload, device)
            model(tokens, positions, caches[cid], **kwargs)
        elif kind == "head":
            x, fused, exact = payload
            model.project_vocab(x.to(device), fused, exact)


def _replay(model: Any, caches: dict[int, Any], op: tuple, device: torch.device) -> None:
    what, cid, body = op
    if what == "new":
        kind, *spec = body
        if kind == "none":
            caches[cid] = NoCache(spec[0], device)
        else:
            caches[cid] = model.new_cache(*spec) if kind == "contiguous" else model.new_paged_cache(*spec)
    elif what == "drop":
        caches.pop(cid, None)
    else:
        name, args, kwargs, answers, raised = body
        replies = iter(answers)
        back = lambda *_: next(replies)  # noqa: E731
        args = [back if _is_callback(a) else a for a in _to(args, device)]
        kwargs = {k: back if _is_callback(v) else v for k, v in _to(kwargs, device).items()}
        try:
            getattr(caches[cid], name)(*args, **kwargs)
        except Exception:
            if not raised:  # rank 0's call succeeded: the caches no longer agree
                raise


def _is_callback(x: Any) -> bool:
    return isinstance(x, str) and x == _CALLBACK


@dataclass
class TensorParallel:
    """Rank 0's handle on the other ranks."""

    lead: Lead
    size: int
    processes: list | None = None  # the spawned ranks (None under torchrun)

    def close(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        if not dist.is_initialized():
            return
        try:
            self.lead.send("stop")
        finally:
            for p in self.processes or []:
                p.join(timeout=30)
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type == "cuda":
        index = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return device


def _threads(size: int) -> None:
    """On CPU, each rank takes its share of the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // size))


def _join(rank: int, size: int, backend: str, init: str | None) -> Any:
    """Join the world; the group the messages travel over (gloo whatever the passes use)."""
    if init is None:  # torchrun: MASTER_ADDR, RANK, ... in the environment
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=size)
    return None if backend == "gloo" else dist.new_group(backend="gloo")


def _follower(rank: int, size: int, init: str | None, load: dict, parent: int | None) -> None:
    """A rank other than 0: load its shard and follow until told to stop (or rank 0 is gone)."""
    if parent is not None:
        def watch() -> None:  # a killed rank 0 cannot say stop: leave with it
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(0)
        threading.Thread(target=watch, daemon=True).start()
    device = resolve_device(load["device"])
    _threads(size)
    group = _join(rank, size, "nccl" if device.type == "cuda" else "gloo", init)
    device = _rank_device(device, rank)
    loaded = load_model(load["path"], dtype=load["dtype"], device=device, progress=False,
                        quantization=load["quantization"], shard=Shard(rank, size))  # fmt: skip
    follow(loaded.model, group, device)
    dist.destroy_process_group()


def launch(
    size: int, path: str | None, dtype: str = "auto", device: str = "auto", quantization: str | None = None
) -> tuple[LoadedModel, TensorParallel]:
    """Rank 0's model of a ``size``-way tensor-parallel target, the other ranks following.

    Under ``torchrun`` (``WORLD_SIZE`` set) the ranks are torchrun's: on a rank other than 0
    this call follows rank 0 and then ends the process. Otherwise it spawns ``size - 1``
    local processes. Backends: gloo on CPU, NCCL on CUDA (one GPU per rank).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and size not in (1, world):
        raise SpecDecodeError(f"--tensor-parallel-size {size} differs from torchrun's {world} processes")
    size = max(size, world)
    config, _ = load_config(path, progress=False)
    check_tensor_parallel(config, size, parse_quantization(quantization))  # before any rank starts
    load = {"path": path, "dtype": dtype, "device": device, "quantization": quantization}
    where = resolve_device(device)
    if where.type == "cuda" and torch.cuda.device_count() < size and world == 1:
        raise SpecDecodeError(f"tensor parallel size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
    processes = []
    if world > 1:
        init, rank = None, int(os.environ["RANK"])
        if rank != 0:
            _follower(rank, size, None, load, None)
            sys.exit(0)
    else:
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        for r in range(1, size):
            p = ctx.Process(target=_follower, args=(r, size, init, load, os.getpid()), daemon=True)
            p.start()
            processes.append(p)
    _threads(size)
    group = _join(0, size, "nccl" if where.type == "cuda" else "gloo", init)
    loaded = load_model(path, dtype=dtype, device=_rank_device(where, 0), quantization=quantization,
                        shard=Shard(0, size))  # fmt: skip
    lead = Lead(group)
    loaded.model.lead = lead
    return loaded, TensorParallel(lead, size, processes)


def load_target(
    path: str | None, dtype: str = "auto", device: str = "auto", quantization: str | None = None,
    tensor_parallel_size: int = 1, compiled: bool = False,
) -> tuple[LoadedModel, TensorParallel | None]:
    """The target for an entry point: loaded whole, or rank 0 of ``tensor_parallel_size`` ranks."""
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise SpecDecodeError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
    if tensor_parallel_size == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return load_model(path, dtype=dtype, device=device, quantization=quantization), None
    if compiled:
        raise SpecDecodeError("--compile does not apply to a tensor-parallel target (its passes wait on the other "
                              "ranks between layers); drop one of them")  # fmt: skip
    return launch(tensor_parallel_size, path, dtype, device, quantization)
