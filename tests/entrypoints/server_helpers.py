"""Helpers for the server tests: a uvicorn server on a loopback thread, SSE parsing, and a
slow-down wrapper that keeps requests in flight long enough to act on them.

Owns: no assertions; tests import these as ``from tests.entrypoints.server_helpers import ...``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import uvicorn

from specdecode.entrypoints.server import DrainingServer


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
    and ``peak_waiting`` / ``peak_running`` record the most requests queued / running at a step."""

    def __init__(self, engine: Any, delay: float = 0.0) -> None:
        self.engine, self.delay = engine, delay
        self.peak_waiting = self.peak_running = 0

    def step(self) -> Any:
        if self.delay:
            time.sleep(self.delay)
        events = self.engine.step()
        stats = self.engine.stats()
        self.peak_waiting = max(self.peak_waiting, stats.num_waiting)
        self.peak_running = max(self.peak_running, stats.num_running)
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
