"""Running `specdecode serve`: load the model, build the engine and the app (server.py), and
serve it with uvicorn until a signal.

Shutdown: the first SIGTERM / SIGINT drains (new requests and /health get 503, admitted
requests run to the end, then uvicorn stops and the process exits 0); a second one
exits at once.
"""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from specdecode.config import SpecDecodeError
from specdecode.drafters.registry import parse_spec
from specdecode.entrypoints.engine_thread import EngineThread
from specdecode.entrypoints.server import ServerLimits, create_app


def run_server(
    model: str | None = None,
    speculative_config: Any = "auto",
    host: str = "127.0.0.1",
    port: int = 8000,
    max_num_seqs: int = 8,
    api_key: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    quantization: str | None = "auto",
    max_model_len: int | None = None,
    threads: int | None = None,
    log_level: str = "info",
    compile: bool | str = False,
    limits: ServerLimits | None = None,
    keep_alive_s: int = 5,
    enable_prefix_caching: bool = True,
    tensor_parallel_size: int = 1,
) -> None:
    """Load the model, build the engine and serve until SIGTERM / SIGINT (then drain).
    ``compile`` as for `LLM`: the target's blocks compiled and warmed up before the port opens.
    ``limits``: what one request may ask for (server.ServerLimits); ``keep_alive_s``: an idle
    connection is closed after it (uvicorn's timeout_keep_alive); ``threads``: CPU threads, fixed
    (None: the engine's thread tuner, engine/threads.py); ``tensor_parallel_size``: the target
    split over that many processes, this one rank 0 (model/tensor_parallel.py)."""
    from specdecode.model.compiled import parse_compile
    from specdecode.model.quant import parse_quantization
    from specdecode.model.tensor_parallel import load_target

    spec = parse_spec(speculative_config)  # bad input fails before the model loads
    parse_quantization(quantization)
    compile_mode = parse_compile(compile)
    target, tp = load_target(model, dtype, device, quantization, tensor_parallel_size,
                             compiled=compile_mode is not None)  # fmt: skip
    try:
        app = build_server_app(target, spec, model=model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                               quantization=quantization, enable_prefix_caching=enable_prefix_caching, threads=threads,
                               compile_mode=compile_mode, api_key=api_key, limits=limits)  # fmt: skip
        # headers of at most 64 KiB, idle connections closed (a slow body is bounded by read_body's limit)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=keep_alive_s,
                                h11_max_incomplete_event_size=64 << 10)  # fmt: skip
        logging.getLogger("uvicorn.error").info(loaded_line(app.state.server.engine_thread.engine, quantization))
        DrainingServer(config, app.state.server.engine_thread).run()
    finally:
        if tp is not None:  # the other ranks stop after the drain
            tp.close()


def build_server_app(target: Any, spec: Any, *, model: str | None, max_model_len: int | None, max_num_seqs: int,
                     quantization: str | None, enable_prefix_caching: bool, threads: int | None,
                     compile_mode: Any = None, api_key: str | None = None,
                     limits: ServerLimits | None = None) -> Any:  # fmt: skip
    """The OpenAI app over a new engine for the loaded ``target`` (the single server's, and each
    replica's under Ray Serve); its engine thread starts with the app's lifespan."""
    from specdecode.engine.serving import ServingEngine
    from specdecode.model.compiled import compile_target

    context = target.config.max_position_embeddings
    if max_model_len is not None and not 1 < max_model_len <= context:
        raise SpecDecodeError(f"max_model_len must be in [2, {context}], got {max_model_len}")
    max_model_len = max_model_len or context

    def new_engine() -> ServingEngine:
        return ServingEngine(target, spec, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             quantization=quantization, enable_prefix_caching=enable_prefix_caching,
                             threads=threads)  # fmt: skip

    if compile_mode is not None:
        compile_target(target.model, compile_mode, lambda: [new_engine()])
    return create_app(new_engine(), target.tokenizer, target.name, max_model_len=max_model_len,
                      vocab_size=target.config.vocab_size, api_key=api_key, aliases=[model] if model else [],
                      limits=limits)  # fmt: skip


def loaded_line(engine: Any, quantization: str | None) -> str:
    """What a server runs, in one log line: model, weights, kernels, exactness, speculation."""
    from specdecode.model.quant import describe_kernels

    target, spec = engine.target, engine.spec
    method = "none (plain decoding)" if spec is None else f"{spec.method}, num_speculative_tokens {spec.num_speculative_tokens}"
    if getattr(engine, "auto_choice", None):
        method = engine.auto_choice
    shard = getattr(engine.model, "shard", None)
    split = f", tensor parallel over {shard.size} ranks" if shard is not None else ""
    return (f"specdecode: model {target.name} ({target.config.num_layers} layers, {engine.model.embed.weight.dtype}, "
            f"{engine.device}{split}); weights {target.quantization or quantization or 'as stored'}; kernels "
            f"{describe_kernels(engine.model)}; batch-invariant passes {'on' if engine.batch_invariant else 'off'}; "
            f"speculative method {method}; prefix caching {'on' if getattr(engine, 'prefix_caching', False) else 'off'}")  # fmt: skip


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but the first SIGTERM / SIGINT drains the engine before uvicorn's shutdown;
    a second one exits at once."""

    async def shutdown(self, sockets: Any = None) -> None:
        if self.force_exit:  # cut open streams: from Python 3.12 asyncio's wait_closed waits for them
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.close()
        await super().shutdown(sockets)

    def __init__(self, config: uvicorn.Config, engine_thread: EngineThread) -> None:
        super().__init__(config)
        self.engine_thread = engine_thread

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.engine_thread.draining:  # a second signal: exit at once, in-flight requests cut
            super().handle_exit(sig, frame)  # recorded: the process ends as that signal makes it
            self.should_exit = self.force_exit = True  # uvicorn alone would wait for open streams
            return
        # not recorded in _captured_signals, so the process exits 0 once drained
        self.engine_thread.drain(on_drained=lambda: setattr(self, "should_exit", True))
