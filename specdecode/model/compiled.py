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
identity). ``mode="reduce-overhead"`` also captures each bucket as a CUDA graph on CUDA
(correct, but slower than eager per pass: `parse_compile` says why; so ``compile=True``
means "default"). After the warm-up, a shape
that fails to compile raises as any error of the pass would: nothing here changes torch's
process-wide error handling (only its recompile limit, raised for the buckets).

With the fused CPU block (cpu_block.py) the passes it takes stay one C call per layer,
faster than any compiled graph on a CPU; by default (batch-invariant passes) it takes every
pass the engine runs, so compiling has nothing left to do there; with batch_invariant=False
the compiled blocks serve the passes over MAX_POSITIONS tokens. Attention and the cache
write stay eager inside a compiled block (`Attention._attend`), so a block is two graphs.

Does not own: the forward itself (transformer.py) or which passes run (engine/).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from specdecode.config import SpecDecodeError, first_line
from specdecode.model.cpu_block import MAX_POSITIONS

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


def parse_compile(mode: str | bool | None) -> str | None:
    """``compile`` as given by a user -> a torch.compile mode, or None for eager.

    ``True`` / "auto" pick "default" everywhere. "reduce-overhead" (CUDA graphs) is there
    to ask for on CUDA: correct, but it costs more than the eager pass, as a pass replays two
    graphs a block (dozens of entries a pass), each output copied out of the graphs' pool
    (`_copied_out`). It records a graph per prefill length, and per
    thread (the server's engine thread records its own).
    """
    if mode in (None, False, "none"):
        return None
    if mode is True or mode == "auto":
        return "default"
    if mode not in COMPILE_MODES:
        raise SpecDecodeError(f"unknown compile mode {mode!r}; supported: auto, {', '.join(COMPILE_MODES)}")
    return mode


def compile_blocks(model: torch.nn.Module, mode: str) -> None:
    """Compile every block of ``model`` (a `Transformer`) in place, lazily: graphs are built
    at the first pass of each shape bucket."""
    from specdecode.model.transformer import Attention

    # Attention and the cache write stay eager between a block's two graphs. Marked here, once
    # per process, rather than where it is defined: the mark imports dynamo, slow to import,
    # which no eager run should pay; in an eager pass the mark costs next to nothing a call.
    if not getattr(Attention._attend, "_specdecode_eager", False):
        eager = torch.compiler.disable(Attention._attend)
        eager._specdecode_eager = True
        Attention._attend = eager
    # Every bucket (one or several rows and tokens, with or without a mask or packed rows) is
    # a recompile of the same code; torch's default limit of 8 is reached by one model's
    # buckets and a second model's in one process, after which new shapes would run eagerly.
    # (The setting is process-wide; its name changed in torch 2.7.)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))
    cuda_graphs = mode == "reduce-overhead" and model.embed.weight.is_cuda
    for block in model.layers:
        block.compile(dynamic=True, mode=mode)
        if cuda_graphs:
            block._compiled_call_impl = _copied_out(block._compiled_call_impl)


def _copied_out(compiled: Callable) -> Callable:
    """A block's compiled call whose output is copied out of the CUDA graphs' memory pool.

    Each block is its own torch.compile entry, and in inference CUDA graph trees start a new
    generation at every entry, free to reuse the memory of the last generation's outputs:
    without the copy, block i + 1's replay overwrites block i's output, the residual stream it
    is reading. The copy is one [B, T, hidden] tensor per layer."""

    def call(*args: object) -> torch.Tensor:
        return compiled(*args).clone()

    return call


def uncompile_blocks(model: torch.nn.Module) -> None:
    """Back to eager blocks (the inverse of `nn.Module.compile`, which sets this one field)."""
    for block in model.layers:
        block._compiled_call_impl = None


def fall_back(model: torch.nn.Module, error: BaseException) -> None:
    """Eager blocks and a one-line warning naming why compilation failed."""
    uncompile_blocks(model)
    warnings.warn(f"torch.compile failed, running eagerly: {type(error).__name__}: {first_line(error)}", stacklevel=4)


def compile_target(model: torch.nn.Module, mode: str, make_engines: Callable[[], Sequence], progress: bool = True) -> str | None:
    """Compile ``model``'s blocks and warm them up on the engines ``make_engines()`` builds
    (throwaway: the caller builds its own afterwards). Returns ``mode``, or None after a
    failed compile: eager blocks again and a one-line warning, since a broken compiler
    (no C++ toolchain, an unsupported op) must not stop generation. Errors of our own
    (`SpecDecodeError`) are not compile failures and propagate."""
    engines = list(dict.fromkeys(make_engines()))  # LLM's plain engine may be its engine
    try:
        compile_blocks(model, mode)
        # a failure must raise here, whatever an earlier user of torch.compile set
        with torch._dynamo.config.patch(suppress_errors=False):
            warm_up(engines, progress)
    except SpecDecodeError:
        uncompile_blocks(model)
        raise
    except Exception as e:  # noqa: BLE001 -- whatever the compiler raised, eager still works
        fall_back(model, e)
        return None
    return mode


def warm_up(engines: Sequence, progress: bool = True) -> None:
    """Build the graphs now rather than at the first requests: each engine (a `ServingEngine`)
    serves a dummy greedy request alone, then two together, which runs a prefill chunk,
    1-token decode passes and, with a drafter, its verify passes, at one and two rows; then
    each model's remaining buckets (`_warm_buckets`). The prompt is longer than the fused CPU
    block takes (cpu_block.MAX_POSITIONS), so that where the fused block runs the small
    passes, the prefill still builds the torch blocks' graphs."""
    from tqdm import tqdm

    from specdecode.config import SamplingParams

    runs = [(engine, n) for engine in engines for n in (1, 2)]
    with tqdm(total=len(runs), desc="compiling (warm-up)", unit="batch", disable=not progress) as bar:
        for engine, n in runs:
            vocab = engine.target.config.vocab_size
            room = engine.max_model_len - 1  # a prompt of >= 1 token, then >= 1 new token
            params = SamplingParams(temperature=0.0, max_tokens=max(1, min(engine.gamma + 6, room // 2)),
                                    ignore_eos=True)  # fmt: skip
            length = max(1, min(MAX_POSITIONS + 16, engine.max_model_len - params.max_tokens))
            pattern = [(37 * i + 11) % vocab for i in range(8)]  # repeated, so n-gram drafters propose
            prompt = (pattern * (length // 8 + 1))[:length]
            for i in range(n):  # rotated: rows of the same length, different tokens
                engine.add_request(f"__warm_up_{n}_{i}__", prompt[i:] + prompt[:i], params)
            while engine.has_unfinished():
                engine.step()
            bar.update(1)
    for model in dict.fromkeys(engine.target.model for engine in engines):
        _warm_buckets(model, any(e.batch_invariant for e in engines if e.target.model is model))


def _warm_buckets(model: torch.nn.Module, batch_invariant: bool) -> None:
    """The buckets the dummy requests may not reach: several rows of several tokens, causal,
    packed (rows of different lengths) and tree-masked, and many rows of one token. Each is
    over 64 positions, so that where the fused CPU block runs the shorter passes, these still
    run the torch blocks. Dynamic shapes make one such pass stand for every batch and width of
    its kind. Scratch caches. ``batch_invariant``: as the engines run their passes (on CPU our
    row-invariant kernels: graphs of their own)."""
    dev = model.embed.weight.device
    B, T = 2, MAX_POSITIONS // 2 + 16  # packed: 48 + 24 real tokens, still over MAX_POSITIONS
    cache = model.new_cache(B, T)
    tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
    positions = torch.arange(T, device=dev).expand(B, T)
    valid = torch.ones(B, T, dtype=torch.bool, device=dev)
    valid[1, T // 2 :] = False
    tree = torch.ones(T, T, dtype=torch.bool, device=dev).tril().expand(B, T, T)
    with torch.inference_mode():
        for extra in ({}, {"valid": valid}, {"block_mask": tree}):
            model(tokens, positions, cache, batch_invariant=batch_invariant, **extra)
        rows = MAX_POSITIONS + 1  # and decoding one token on each of more rows than that
        one = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        model(one, torch.zeros_like(one), model.new_cache(rows, 1), batch_invariant=batch_invariant)
