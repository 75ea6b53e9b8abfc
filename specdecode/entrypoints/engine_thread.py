"""The one thread that owns the `ServingEngine`, and its bridge to asyncio.

Owns: handing submissions and aborts to the engine between steps (a thread-safe command
queue), stepping while there is work, delivering each request's events into its own
asyncio queue (`loop.call_soon_threadsafe`), engine metrics, and draining on shutdown.
Does not own: HTTP (server.py) or scheduling (the engine).

The engine is single-threaded, so nothing else may call it: tests and the server reach
it through `call(fn)`, which runs ``fn(engine)`` on this thread between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdecode.config import SamplingParams

log = logging.getLogger("specdecode.server")
ADMITTED = "admitted"  # the first item of a request's queue when the engine took it


class ShuttingDown(Exception):
    """The engine thread stopped before it could take the request."""


class EngineFailed(Exception):
    """The engine raised during a step; its requests were aborted."""


@dataclass
class _Request:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seen: tuple = (0, 0, 0, ())  # speculation counters already added to the metrics

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone
            pass


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec_override: dict[str, Any] | None
    request: _Request


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class EngineThread:
    """Run ``engine`` on a daemon thread. `submit` / `abort` are safe from any thread."""

    def __init__(self, engine: Any, metrics: Any = None, idle_poll_s: float = 0.25) -> None:
        self.engine, self.metrics, self.idle_poll_s = engine, metrics, idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}  # engine thread only
        self._draining = False
        self._stop = False
        self._on_drained: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)

    # -- any thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               spec_override: dict[str, Any] | None = None) -> asyncio.Queue:  # fmt: skip
        """From a running event loop. The queue yields `ADMITTED` or an exception, then `RequestEvent`s."""
        req = _Request(asyncio.get_running_loop(), asyncio.Queue())
        if not self._thread.is_alive():
            req.queue.put_nowait(ShuttingDown("the engine is not running"))
        else:
            self._commands.put(_Add(request_id, prompt_ids, params, spec_override, req))
        return req.queue

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps; returns its future."""
        c = _Call(fn)
        self._commands.put(c)
        return c.future

    def drain(self, on_drained: Callable[[], None] | None = None) -> None:
        """Finish what was admitted; the server refuses new work. Safe in a signal handler."""
        self._on_drained = on_drained
        self._draining = True
        self._commands.put(("wake", None))

    def stop(self, timeout: float | None = None) -> None:
        """Drain, then end the thread."""
        self._stop = True
        self.drain(self._on_drained)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        drained_told = False
        while True:
            busy = self.engine.has_unfinished()
            self._process_commands(block=not busy)
            if self.engine.has_unfinished():
                self._step()
                continue
            if self.metrics is not None:
                self.metrics.observe_engine(self.engine.stats())
            if self._draining and self._commands.empty():
                if not drained_told and self._on_drained is not None:
                    drained_told = True
                    self._on_drained()
                if self._stop:
                    break
        self._refuse_pending()

    def _process_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.spec_override)
            except Exception as e:  # SpecDecodeError: bad input; anything else: a bug, answered as 500
                cmd.request.put(e)
                return
            self._requests[cmd.request_id] = cmd.request
            cmd.request.put(ADMITTED)
        elif isinstance(cmd, _Call):
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except Exception as e:
                cmd.future.set_exception(e)
        elif cmd[0] == "abort" and self._requests.pop(cmd[1], None) is not None:
            self.engine.abort(cmd[1])

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; aborting its %d requests", len(self._requests))
            for req in self._requests.values():
                req.put(EngineFailed(f"engine error: {type(e).__name__}: {e}"))
            self._requests.clear()
            try:  # not request by request: a row the failed step half removed is no request's any more
                self.engine.reset()
            except Exception:
                log.exception("resetting the engine after a failed step failed")
            return
        deltas, new_tokens = [], 0
        for ev in events:
            new_tokens += len(ev.new_token_ids)
            req = self._requests.get(ev.request_id)
            if req is None:
                continue  # aborted meanwhile
            s = ev.stats
            now = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, tuple(s.accepted_per_position))
            before = req.seen
            per_pos = [n - (before[3][i] if i < len(before[3]) else 0) for i, n in enumerate(now[3])]
            deltas.append((now[0] - before[0], now[1] - before[1], now[2] - before[2], per_pos))
            req.seen = now
            if ev.finish_reason is not None:
                del self._requests[ev.request_id]
            req.put(ev)  # its stats are a snapshot (RequestEvent), the engine's own object changes on
        if self.metrics is not None:
            self.metrics.observe_step(self.engine.stats(), deltas, new_tokens)

    def _refuse_pending(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.request.put(ShuttingDown("the server is shutting down"))
            elif isinstance(cmd, _Call):
                cmd.future.set_exception(ShuttingDown("the engine thread has stopped"))

