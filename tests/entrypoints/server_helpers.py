"""Helpers for the server tests: a uvicorn server on a loopback thread, SSE parsing, a
slow-down wrapper that keeps requests in flight long enough to act on them, and the engine
and app over the tiny target (conftest.py) that test_server.py and test_server_faults.py run.

Owns: no assertions; tests import these as ``from tests.entrypoints.server_helpers import ...``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import uvicorn

from specdecode.drafters.registry import parse_spec
from specdecode.core.batch import SpecStats
from specdecode.engine.requests import EngineStats, RequestEvent
from specdecode.engine.serving import ServingEngine
from specdecode.entrypoints.serve import DrainingServer
from specdecode.entrypoints.server import create_app


class ServerThread:
    """Serve ``app`` on 127.0.0.1 (a free port) from a thread; ``with`` waits for startup and shutdown."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30)
        self.server = DrainingServer(config, app.state.server.engine_thread)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()

    def engine_call(self, fn: Any, timeout: float = 30) -> Any:
        """``fn(engine)`` on the engine thread (the engine is single-threaded)."""
        return self.app.state.server.engine_thread.call(fn).result(timeout)


def sse_events(lines: Any) -> list[Any]:
    """``data:`` payloads of an SSE stream: parsed JSON objects, and the string "[DONE]"."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


class SlowEngine:
    """Wraps an engine: each step takes at least ``delay`` seconds (requests stay in flight),
    and ``peak_waiting`` / ``peak_running`` record the most requests queued / held during a step
    (held: running or prefilling after it, plus those it finished; a request that finished in the
    step it was admitted or last ran is gone from the stats the step leaves)."""

    def __init__(self, engine: Any, delay: float = 0.0) -> None:
        self.engine, self.delay = engine, delay
        self.peak_waiting = self.peak_running = 0

    def step(self) -> Any:
        if self.delay:
            time.sleep(self.delay)
        events = self.engine.step()
        stats = self.engine.stats()
        self.peak_waiting = max(self.peak_waiting, stats.num_waiting)
        finished = sum(e.finish_reason is not None for e in events)
        self.peak_running = max(self.peak_running, stats.num_running + stats.num_prefilling + finished)
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class ScriptedEngine:
    """The engine's interface, emitting the same fixed token ids to every request, one a step
    (flagged ``lossy`` as typical acceptance flags them, if asked)."""

    def __init__(self, script: list[int], lossy: bool = False) -> None:
        self.script, self.requests, self.lossy = script, {}, lossy

    def add_request(self, request_id: str, prompt: list[int], params: Any, spec_override: Any = None) -> None:
        self.requests[request_id] = [len(prompt), 0, params.max_tokens]

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 0, 0, 0, 1)

    def step(self) -> list[RequestEvent]:
        events = []
        for request_id, state in list(self.requests.items()):
            num_prompt, done, limit = state
            state[1] = done + 1
            finish = "length" if state[1] >= min(limit, len(self.script)) else None
            if finish:
                del self.requests[request_id]
            new = self.script[done : done + 1]
            events.append(RequestEvent(request_id, new, finish, SpecStats(lossy=self.lossy), num_prompt, done + 1))
        return events


def byte_fallback_tokenizer() -> Any:
    """A Llama-2 / Gemma-style tokenizer: characters outside its vocabulary are spelled in bytes,
    and each byte of an unfinished character decodes to one U+FFFD."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({c: len(vocab) + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


MAX_MODEL_LEN = 256  # the tiny checkpoint's context
GAMMA = 3
SPEC = {"method": "ngram", "num_speculative_tokens": GAMMA, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def make_engine(target, max_num_seqs: int = 8, delay: float = 0.0) -> SlowEngine:
    engine = ServingEngine(target, parse_spec(SPEC), max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs)
    return SlowEngine(engine, delay)


def make_app(target, engine=None, tokenizer=None, **kw):
    engine = engine if engine is not None else make_engine(target)
    return create_app(engine, tokenizer or target.tokenizer, "tiny", max_model_len=MAX_MODEL_LEN,
                      vocab_size=target.config.vocab_size, **kw)  # fmt: skip


def wait_idle(srv: ServerThread, timeout: float = 20.0):
    """Poll the engine (on its thread) until nothing runs, waits or holds blocks."""
    deadline = time.monotonic() + timeout
    while True:
        s = srv.engine_call(lambda e: e.stats())
        if (s.num_running, s.num_waiting, s.num_prefilling, s.kv_blocks_used) == (0, 0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)
