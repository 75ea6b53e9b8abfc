"""`LLM`: the Python API, in vLLM's shape.

Owns: loading the target once, validating prompts and settings before any work
starts, and turning token streams into text and per-request metrics (entrypoints/outputs.py).
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import torch

from specdecode.config import SamplingParams, SpecConfig, SpecDecodeError, is_int
from specdecode.drafters.registry import parse_spec
from specdecode.core.batch import SpecStats
from specdecode.core.sampling import Logprob
from specdecode.engine.serving import ServingEngine
from specdecode.entrypoints.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamEvent

Prompt = Union[str, list[int]]


class LLM:
    """Load a target (and drafter) once; generate for batches of prompts.

    ``model=None`` is the default model (SmolLM2-135M-Instruct). ``speculative_config``
    is "auto" (the default: a method chosen from what the target has, drafters/auto.py;
    ``llm.auto_choice`` says which and ``llm.spec`` holds it), a dict or JSON string such as
    ``{"method": "ngram", "num_speculative_tokens": 4}``, "@file.json", or ``None`` / "none"
    (plain decoding through the same engine). ``dtype`` is the activation dtype;
    ``quantization`` ("auto", "none", "int8", "int4", "int4-g64", "gguf", ...) picks the
    weight format of the linears, for the target and a draft model alike; ``llm.kernels``
    says which run. The default "auto" keeps a GGUF's own blocks where our CPU kernel runs
    them (several times faster than bf16 on the default model, and exactly the file's
    weights), and is "none" otherwise. "gguf-a8" / "int4-a8" also quantize each row's
    activations to int8 per group of 32, as llama.cpp does: faster on AVX2-only CPUs,
    close to but not exactly the file's weights (opt-in; still row-invariant, so lossless).
    ``batch_invariant`` (default: on where our CPU kernels run, fp32 or bf16 on a CPU with
    AVX2 or AVX512 and a C compiler) computes every position alone, whatever shares its pass:
    the fused CPU block, or our attention and dense GEMMs beside the int4 / Q8_0 kernels
    (model/invariant.py). Speculative greedy output then equals plain greedy bit for bit. On
    CUDA it is off by default: True there runs attention a query at a time, but cuBLAS and
    torch's int4 kernel still pick their reduction by row count (equal up to float rounding).
    Prompts run through the continuous-batching `ServingEngine` the server uses, at most
    ``max_num_seqs`` at a time; the rest queue. ``compile`` (True / "auto", or a torch.compile
    mode) compiles the target's torch blocks and warms the decode, verify and prefill shapes
    up at load; ``llm.compile_mode`` says what runs (None: eager, also after a failed
    compile). Where the fused CPU block runs, it keeps the passes it takes and the graphs
    serve the longer ones. ``num_blocks`` sizes each engine's paged KV
    pool in blocks of 16 tokens (vLLM's ``num_gpu_blocks_override``; default: 256 MiB, at
    least one full sequence): raise it to keep many long sequences resident.
    ``enable_prefix_caching`` (vLLM's name, on by default) keeps the full blocks of earlier
    prompts and outputs, so a prompt that starts the same way (a chat's next turn, a shared
    system prompt, the ``n`` samples of one prompt) computes only what is new. ``threads``
    fixes the CPU threads; by default, where the passes run our row-invariant kernels, each
    engine chooses them step by step up to torch's count (the cores allowed), fewer while
    other processes take cores (engine/threads.py; the count changes no output).
    ``tensor_parallel_size`` splits the target over that many processes (model/shard.py:
    torch.distributed, gloo on CPU, NCCL on one GPU each); this process is rank 0 and runs the
    engine and the drafter. Under ``torchrun`` the world's ranks are used instead.
    """

    def __init__(
        self,
        model: str | None = None,
        speculative_config: "str | Mapping[str, Any] | SpecConfig | None" = "auto",
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        quantization: str | None = "auto",
        batch_invariant: bool | None = None,
        max_num_seqs: int = 16,
        num_blocks: int | None = None,
        compile: bool | str = False,
        enable_prefix_caching: bool = True,
        threads: int | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        from specdecode.model.compiled import compile_target, parse_compile
        from specdecode.model.quant import describe_kernels, parse_quantization
        from specdecode.model.tensor_parallel import load_target

        spec = parse_spec(speculative_config)  # fail on a bad config before loading anything
        for name, value, least in (("max_model_len", max_model_len, 2), ("max_num_seqs", max_num_seqs, 1),
                                   ("num_blocks", num_blocks, 1)):  # fmt: skip
            if value is not None and (not is_int(value) or value < least):
                raise SpecDecodeError(f"{name} must be an integer >= {least}, got {value!r}")
        parse_quantization(quantization)
        compile_mode = parse_compile(compile)
        self.target, self._tp = load_target(model, dtype, device, quantization, tensor_parallel_size,
                                            compiled=compile_mode is not None)  # fmt: skip
        if self._tp is not None:  # the other ranks stop with the model (which copies share), or at exit
            weakref.finalize(self.target, self._tp.close)
        self.kernels = describe_kernels(self.target.model)
        if batch_invariant and self.target.model.embed.weight.device.type == "cuda":
            warnings.warn("batch_invariant on CUDA computes attention position by position, but no CUDA "
                          "linear is row-invariant (cuBLAS and torch's int4 kernel choose by row count): "
                          "outputs stay lossless up to float rounding, not bit for bit", stacklevel=2)  # fmt: skip
        context = self.target.config.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= context:
            raise SpecDecodeError(f"max_model_len must be in [2, {context}], got {max_model_len}")
        self.max_model_len = max_model_len or context
        self.tokenizer = self.target.tokenizer
        self.spec = spec
        engine_args = dict(max_model_len=self.max_model_len, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                           batch_invariant=batch_invariant, enable_prefix_caching=enable_prefix_caching,
                           threads=threads)  # fmt: skip
        self.compile_mode = None
        if compile_mode is not None:  # warmed up on throwaway engines, so no dummy request leaves state behind
            self.compile_mode = compile_target(self.target.model, compile_mode, lambda: self._build_engines(
                spec, quantization, engine_args))  # fmt: skip
        self.engine, self._plain = self._build_engines(spec, quantization, engine_args)
        self.spec, self.auto_choice = self.engine.spec, self.engine.auto_choice  # what "auto" resolved to
        self._open_call = False  # a generate / stream call is stepping the engines (they are shared)
        self._quantization, self._engine_args = quantization, engine_args

    def with_speculative_config(self, speculative_config: "str | Mapping[str, Any] | SpecConfig | None") -> "LLM":
        """Another `LLM` over the same loaded model (nothing is loaded again), decoding with
        ``speculative_config``; its plain baseline engine is this one's. For trying several
        configurations in one process (`specdecode bench`, `specdecode tune`)."""
        spec = parse_spec(speculative_config)
        other = copy.copy(self)
        other.engine = ServingEngine(self.target, spec, quantization=self._quantization, **self._engine_args)
        other._plain = self._plain if spec is not None else other.engine
        other.spec, other.auto_choice, other._open_call = other.engine.spec, other.engine.auto_choice, False
        return other

    def _build_engines(
        self, spec: SpecConfig | None, quantization: str | None, engine_args: dict
    ) -> tuple[ServingEngine, ServingEngine]:
        """The engine, and one for plain decoding of the same model (for baselines: its own
        engine, so no drafter work is timed; the same one when there is no drafter)."""
        engine = ServingEngine(self.target, spec, quantization=quantization, **engine_args)
        return engine, (ServingEngine(self.target, None, **engine_args) if spec is not None else engine)

    def generate(
        self,
        prompts: "Prompt | Sequence[Prompt]",
        sampling_params: "SamplingParams | Sequence[SamplingParams] | None" = None,
        speculative: bool = True,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        ``speculative=False`` runs plain decoding of the same model. ``on_tokens(i, ids)``
        is called as round after round commits new tokens to request ``i`` (streaming).
        """
        token_lists, params = self._prepare(prompts, sampling_params)
        keys = [(i, k) for i, sp in enumerate(params) for k in range(sp.n)]
        outputs: dict[tuple[int, int], list[int]] = {key: [] for key in keys}
        logprobs: dict[tuple[int, int], list[Logprob]] = {key: [] for key in keys}
        finish: dict[tuple[int, int], str] = {}
        done_at, first_at = dict.fromkeys(keys, 0.0), dict.fromkeys(keys, 0.0)
        stats: dict[tuple[int, int], Any] = {key: SpecStats() for key in keys}
        prompt_logprobs: dict[int, Any] = {}
        for e in self._stream(token_lists, params, speculative):
            key = (e.index, e.sample)
            if e.prompt_logprobs is not None:
                prompt_logprobs[e.index] = e.prompt_logprobs
            if not outputs[key]:
                first_at[key] = e.time_s
            outputs[key] += e.new_token_ids
            logprobs[key] += e.logprobs or []
            stats[key] = e.stats
            if on_tokens is not None and e.new_token_ids and e.sample == 0:
                on_tokens(e.index, e.new_token_ids)
            if e.finish_reason:
                finish[key] = e.finish_reason
                done_at[key] = e.time_s
        results = []
        for i, sp in enumerate(params):
            samples = [
                self._output(k, outputs[i, k], finish.get((i, k), "length"), sp, stats[i, k], done_at[i, k],
                             first_at[i, k], logprobs[i, k] if sp.logprobs is not None else None)
                for k in range(sp.n)
            ]  # fmt: skip
            first = samples[0]
            results.append(RequestOutput(token_lists[i], first.token_ids, first.text, first.finish_reason,
                                         first.metrics, first.logprobs, samples, prompt_logprobs.get(i)))  # fmt: skip
        return results

    def stream(
        self,
        prompts: "Prompt | Sequence[Prompt]",
        sampling_params: "SamplingParams | Sequence[SamplingParams] | None" = None,
        speculative: bool = True,
    ) -> Iterator[StreamEvent]:
        """Yield each request's new tokens as the engine commits them (prompt index, ids,
        finish reason). Breaking out of the loop cancels the requests still running."""
        token_lists, params = self._prepare(prompts, sampling_params)
        yield from self._stream(token_lists, params, speculative)

    def _stream(
        self, token_lists: list[list[int]], params: list[SamplingParams], speculative: bool
    ) -> Iterator[StreamEvent]:
        if self._open_call:  # its steps would hand this call the other's tokens, and lose them there
            raise SpecDecodeError(
                "another generate/stream call on this LLM is still open: finish that stream or close() it first"
            )
        engine = self.engine if speculative else self._plain
        call = f"llm-{id(self)}-{time.perf_counter_ns()}"
        # n samples of a prompt are n requests, sample k seeded by SamplingParams.sample_seed(k)
        index = {f"{call}-{i}-{k}": (i, k) for i, sp in enumerate(params) for k in range(sp.n)}
        ids = list(index)
        start = time.perf_counter()
        self._open_call = True
        try:
            for rid, (i, k) in index.items():
                sp = params[i]
                engine.add_request(rid, token_lists[i], dataclasses.replace(sp, n=1, seed=sp.sample_seed(k)))
            while engine.has_unfinished():
                for e in engine.step():
                    i, k = index[e.request_id]
                    yield StreamEvent(i, e.new_token_ids, e.finish_reason, e.at - start, e.stats, k, e.logprobs,
                                      e.prompt_logprobs)  # fmt: skip
        except GeneratorExit:  # the consumer stopped early: its requests are aborted below
            raise
        except BaseException:  # a failed or interrupted (Ctrl-C) step may have left a row half removed,
            engine.reset()  # no request's to abort
            raise
        finally:  # nothing stays queued or cached, and the LLM takes calls again
            try:
                for rid in ids:
                    engine.abort(rid)
            finally:
                self._open_call = False

    def encode_chat(self, user_message: str) -> list[int]:
        """Token ids of a one-turn chat, with the generation prompt, via the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise SpecDecodeError("this model has no chat template; send the prompt as it is (no --chat, no encode_chat)")
        if not isinstance(user_message, str):
            raise SpecDecodeError(f"a chat message must be a string, got {type(user_message).__name__}")
        _check_utf8(user_message)
        messages = [{"role": "user", "content": user_message}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def decode(self, token_ids: list[int]) -> str:
        vocab = self.target.config.vocab_size
        token_ids = _as_ids(token_ids)  # a tensor or numpy array too, as HF's decode takes them
        if not isinstance(token_ids, (list, tuple)) or not all(
            is_int(t) and 0 <= t < vocab for t in token_ids
        ):
            raise SpecDecodeError(f"token ids to decode must be a list of integers in [0, {vocab})")
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # -- validation ---------------------------------------------------------------------

    def _prepare(
        self, prompts: "Prompt | Sequence[Prompt]", sampling_params: "SamplingParams | Sequence[SamplingParams] | None"
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        prompts = _as_ids(prompts)
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_int(prompts[0])):
            prompts = [prompts]  # one prompt, as text or token ids
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise SpecDecodeError("prompts must be a non-empty list of strings or token-id lists")
        token_lists = [self.tokenize(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(token_lists)
        else:
            if not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(sp, SamplingParams) for sp in sampling_params
            ):
                raise SpecDecodeError("sampling_params must be a SamplingParams or a list of them, one per prompt")
            params = list(sampling_params)
            if len(params) != len(token_lists):
                raise SpecDecodeError(f"got {len(params)} sampling params for {len(token_lists)} prompts")
        # generation stops at the context's end ("length"), as it always has for this API
        params = [
            dataclasses.replace(sp, max_tokens=min(sp.max_tokens, self.max_model_len - len(t)))
            for sp, t in zip(params, token_lists)
        ]
        return token_lists, params

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Validated token ids of a prompt given as text or as token ids."""
        vocab = self.target.config.vocab_size
        prompt = _as_ids(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecDecodeError("this model folder has no tokenizer; pass token-id lists")
            _check_utf8(prompt)
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < vocab for t in ids):
                raise SpecDecodeError(f"prompt token ids must be in [0, {vocab})")
        else:
            raise SpecDecodeError("each prompt must be a string or a list of token ids")
        if not ids:
            raise SpecDecodeError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise SpecDecodeError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len}; shorten the prompt"
            )
        return ids

    def _output(self, index, out, finish, params, stats, wall, first, logprobs) -> CompletionOutput:
        text = params.visible_text(self.decode(out))
        metrics = RequestMetrics(**dataclasses.asdict(stats), num_generated_tokens=len(out), wall_time_s=wall, first_token_time_s=first)
        return CompletionOutput(index, out, text, finish, metrics, logprobs)


def _as_ids(prompt: Any) -> Any:
    """Token ids given as a tensor or numpy array (as HF's decode takes them), or as a list or
    tuple of numpy integers, as a list of ints (a 2-D array: a list of prompts); else as given."""
    if isinstance(prompt, torch.Tensor) or type(prompt).__module__ == "numpy":
        return prompt.tolist()
    if isinstance(prompt, (list, tuple)) and prompt and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt
    ):
        return [int(t) for t in prompt]
    return prompt


def _check_utf8(text: str) -> None:
    """Text the tokenizer can take: a lone surrogate (a non-UTF-8 byte in argv, escaped by
    Python) is not, and the tokenizer's own error is a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecDecodeError("the prompt is not valid UTF-8 text") from None
