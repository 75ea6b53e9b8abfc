"""Compiled decode and verify passes (opt-in): `torch.compile` of every transformer block.

Owns: compiling a model's blocks with dynamic shapes, so that decode (1 token), verify
(γ + 1 tokens), tree and prefill passes share a handful of graphs instead of recompiling
at every length or context size; and undoing that when compilation fails. The engine
warms the graphs up at load (entrypoints/llm.py) over the shapes it will run.

Why blocks and not the whole forward: the forward's prologue builds masks and RoPE tables
once per pass from Python-side lengths, which would specialise a whole-model graph on
every context length. A block sees only tensors of the pass's shape, the cache, and the
pass's KV length, which dynamic shapes keep symbolic. Dynamo still specialises sizes 0
and 1, so one token, one row and several of each are separate graphs: the "buckets".
Layers of the same structure share their graphs (modules are inlined, not guarded by
identity). On CUDA, ``mode="reduce-overhead"`` also captures each bucket as a CUDA graph.

With the fused CPU block (cpu_block.py) the passes it takes (≤ MAX_POSITIONS tokens) stay
one C call per layer, faster than any compiled graph on this CPU (docs/benchmarks.md); the
compiled blocks then serve only longer passes (prefill chunks). Attention and the cache
write stay eager inside a compiled block (`Attention._attend`), so a block is two graphs.

Does not own: the forward itself (transformer.py) or which passes run (engine/).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from specdecode.config import SpecDecodeError

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


def parse_compile(mode: str | bool | None, device: torch.device) -> str | None:
    """``compile`` as given by a user -> a torch.compile mode, or None for eager.

    ``True`` / "auto" pick "reduce-overhead" (CUDA graphs) on CUDA and "default" on CPU.
    """
    if mode in (None, False, "none"):
        return None
    if mode is True or mode == "auto":
        return "reduce-overhead" if device.type == "cuda" else "default"
    if mode not in COMPILE_MODES:
        raise SpecDecodeError(f"unknown compile mode {mode!r}; supported: auto, {', '.join(COMPILE_MODES)}")
    return mode


def compile_blocks(model: torch.nn.Module, mode: str) -> None:
    """Compile every block of ``model`` (a `Transformer`) in place, lazily: graphs are built
    at the first pass of each shape bucket."""
    # Every bucket (one or several rows and tokens, with or without a mask or packed rows) is
    # a recompile of the same code; torch's default limit of 8 is reached by one model's
    # buckets and a second model's in one process, after which new shapes would run eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for block in model.layers:
        block.compile(dynamic=True, mode=mode)


def uncompile_blocks(model: torch.nn.Module) -> None:
    """Back to eager blocks (the inverse of `nn.Module.compile`, which sets this one field)."""
    for block in model.layers:
        block._compiled_call_impl = None


def fall_back(model: torch.nn.Module, error: BaseException) -> None:
    """Eager blocks and a one-line warning naming why compilation failed."""
    uncompile_blocks(model)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    warnings.warn(f"torch.compile failed, running eagerly: {type(error).__name__}: {first}", stacklevel=4)


def compile_target(model: torch.nn.Module, mode: str, make_engines: Callable[[], Sequence], progress: bool = True) -> str | None:
    """Compile ``model``'s blocks and warm them up on the engines ``make_engines()`` builds
    (throwaway: the caller builds its own afterwards). Returns ``mode``, or None after a
    failed compile: eager blocks again and a one-line warning, since a broken compiler
    (no C++ toolchain, an unsupported op) must not stop generation."""
    try:
        compile_blocks(model, mode)
        engines = list(dict.fromkeys(make_engines()))  # LLM's plain engine may be its engine
        warm_up(engines, progress)
    except Exception as e:  # noqa: BLE001 -- whatever the compiler raised, eager still works
        fall_back(model, e)
        return None
    return mode


def warm_up(engines: Sequence, progress: bool = True) -> None:
    """Build the graphs now rather than at the first requests: each engine (a `ServingEngine`)
    serves a dummy greedy request alone, then two together, which runs a prefill chunk,
    1-token decode passes and, with a drafter, its verify passes, at one and two rows. The
    prompt is longer than the fused CPU block takes (cpu_block.MAX_POSITIONS), so that where
    the fused block runs the small passes, the prefill still builds the torch blocks' graphs."""
    from tqdm import tqdm

    from specdecode.config import SamplingParams
    from specdecode.model.cpu_block import MAX_POSITIONS

    runs = [(engine, n) for engine in engines for n in (1, 2)]
    with tqdm(total=len(runs), desc="compiling (warm-up)", unit="pass", disable=not progress) as bar:
        for engine, n in runs:
            vocab = engine.target.config.vocab_size
            params = SamplingParams(temperature=0.0, max_tokens=engine.gamma + 6, ignore_eos=True)
            length = min(MAX_POSITIONS + 16, engine.max_model_len - params.max_tokens - n)
            pattern = [(37 * i + 11) % vocab for i in range(8)]  # repeated, so n-gram drafters propose
            prompt = (pattern * (length // 8 + 1))[:length]
            for i in range(n):
                engine.add_request(f"__warm_up_{n}_{i}__", prompt[i:], params)
            while engine.has_unfinished():
                engine.step()
            bar.update(1)
    # From here on, a frame that fails to compile (a shape the warm-up did not meet) runs
    # eagerly, with torch's log line, instead of failing a request. During the warm-up a
    # failure raises, so the caller can fall back to eager as a whole and say so.
    torch._dynamo.config.suppress_errors = True
