"""`specdecode serve` under load and faults: 200 requests from 32 clients, killed clients,
draining, an engine error, and the process's flags and SIGTERM. (The wire format, metrics,
auth and bad input: test_server.py.) Every test talks HTTP to a real uvicorn server on
127.0.0.1 (a thread, or a subprocess for SIGTERM), with counts and waits bounded.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from specdecode.entrypoints.cli import main as cli_main
from tests.entrypoints.server_helpers import (
    SPEC,
    ServerThread,
    SlowEngine,
    make_app,
    make_engine,
    sse_events,
    wait_idle,
)
from tests.entrypoints.test_server import check_completion, check_stream


def test_200_requests_from_32_clients(target):
    """Mixed streaming / non-streaming, chat / completions; max_num_seqs 4, so most requests queue."""
    engine = make_engine(target, max_num_seqs=4)
    with ServerThread(make_app(target, engine)) as srv:

        async def client_task(i: int, n: int, http: httpx.AsyncClient):
            rng = random.Random(i)
            for j in range(n):
                chat, stream, max_tokens = rng.random() < 0.5, rng.random() < 0.5, rng.randint(1, 8)
                body = {"max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "seed": j, "ignore_eos": True}
                if chat:
                    body["messages"] = [{"role": "user", "content": f"client {i} request {j}"}]
                else:
                    body["prompt"] = f"client {i} request {j}"
                url = "/v1/chat/completions" if chat else "/v1/completions"
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                    async with http.stream("POST", url, json=body) as r:
                        assert r.status_code == 200
                        events = sse_events([line async for line in r.aiter_lines()])
                    check_stream(events, chat, include_usage=True)
                    assert events[-2]["usage"]["completion_tokens"] == max_tokens
                else:
                    r = await http.post(url, json=body)
                    assert r.status_code == 200, r.text
                    check_completion(r.json(), chat, max_tokens)

        async def main():
            limits = httpx.Limits(max_connections=32)
            async with httpx.AsyncClient(base_url=srv.url, timeout=60, limits=limits) as http:
                sizes = [7] * 8 + [6] * 24  # 200 requests
                await asyncio.gather(*(client_task(i, n, http) for i, n in enumerate(sizes)))

        asyncio.run(main())
        assert engine.peak_running == 4 and engine.peak_waiting > 0  # requests beyond capacity queued
        assert wait_idle(srv).kv_blocks_used == 0
        metrics = httpx.get(srv.url + "/metrics").text
        assert re.search(r'^vllm:request_success_total{finished_reason="length",model_name="tiny"} 200\.0$', metrics, re.M)


def _open_chat_streams(port: int, body: dict, n: int) -> list[socket.socket]:
    """``n`` raw HTTP/1.1 streaming chat requests at once; returns their sockets once each got its first
    SSE event (the assistant-role chunk, sent as soon as the engine admitted the request)."""
    data = json.dumps(body).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
    for sock in socks:
        sock.sendall(head.encode() + data)
    for sock in socks:
        seen = b""
        while b"data: " not in seen:
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
    return socks


def test_killed_clients_leave_no_blocks(target):
    engine = make_engine(target, max_num_seqs=8, delay=0.03)
    with ServerThread(make_app(target, engine)) as srv:
        body = {"messages": [{"role": "user", "content": "a story"}], "max_tokens": 200, "stream": True,
                "ignore_eos": True, "speculative_config": {"num_speculative_tokens": 0}}  # one token a step: ~6 s
        socks = _open_chat_streams(srv.port, body, 6)
        deadline = time.monotonic() + 5
        while (busy := srv.engine_call(lambda e: e.stats())).num_running < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert busy.num_running == 6 and busy.kv_blocks_used > 0
        for s in socks:
            s.close()
        stats = wait_idle(srv, timeout=10)
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
        metrics = httpx.get(srv.url + "/metrics").text
        assert re.search(r'^vllm:request_success_total{finished_reason="abort",model_name="tiny"} 6\.0$', metrics, re.M)
        assert 'finished_reason="length"' not in metrics
        # a non-streaming client that gives up is cancelled too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.3)
        assert wait_idle(srv, timeout=10).kv_blocks_used == 0
        aborted = r'^vllm:request_success_total{finished_reason="abort",model_name="tiny"} 7\.0$'
        deadline = time.monotonic() + 10  # the server counts the abort once it sees the client gone
        while not re.search(aborted, metrics := httpx.get(srv.url + "/metrics").text, re.M):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.05)
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 3}).status_code == 200


def test_drain_finishes_in_flight_and_refuses_new(target):
    """What SIGTERM does (DrainingServer.handle_exit), in-process: 503 for new work, in-flight completes, exit."""
    gate = threading.Event()  # the in-flight request stays in flight until the checks of draining are done

    class Held(SlowEngine):
        def step(self):
            events = super().step()
            if events:
                gate.wait(30)
            return events

    engine = Held(make_engine(target).engine)
    srv = ServerThread(make_app(target, engine)).__enter__()
    try:
        events, first = [], threading.Event()

        def stream():
            body = {"messages": [{"role": "user", "content": "drain me"}], "max_tokens": 60, "stream": True,
                    "ignore_eos": True}  # the first chunk (the role) comes as soon as the request is admitted
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    events.extend(sse_events([line]))
                    first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(10)
        srv.server.handle_exit(signal.SIGTERM, None)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(srv.url + "/health").status_code == 503
        assert t.is_alive()  # the drain has not ended it
        gate.set()
        t.join(30)
        check_stream(events, chat=True, include_usage=False)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        srv.thread.join(30)
        assert not srv.thread.is_alive()  # the server stopped by itself once drained
    finally:
        srv.__exit__()


def test_a_second_signal_exits_at_once(target):
    """The first SIGTERM drains; a second one stops the server without waiting for open streams."""
    srv = ServerThread(make_app(target, make_engine(target, delay=0.05))).__enter__()
    try:
        first = threading.Event()

        def stream():
            body = {"prompt": "long", "max_tokens": 200, "stream": True, "ignore_eos": True}  # ~10 s of steps
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                    for _ in r.iter_lines():
                        first.set()
            except httpx.HTTPError:  # cut by the forced exit
                pass

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(10)
        srv.server.handle_exit(signal.SIGTERM, None)
        srv.server.handle_exit(signal.SIGTERM, None)
        start = time.monotonic()
        srv.thread.join(5)
        assert not srv.thread.is_alive() and time.monotonic() - start < 5
        t.join(10)
    finally:
        srv.__exit__()


def test_engine_error_is_500_and_the_server_recovers(target):
    class FailOnDemand(SlowEngine):
        fail_next = True

        def step(self):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("boom")
            return self.engine.step()

    engine = FailOnDemand(make_engine(target).engine)
    with ServerThread(make_app(target, engine)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
        engine.fail_next = True  # mid-stream: an error event, then [DONE]
        with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "internal_server_error"
        assert wait_idle(srv).kv_blocks_used == 0
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200


# -- the command line --------------------------------------------------------------------------


def test_serve_binds_loopback_by_default():
    from specdecode.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)


def test_serve_bad_flags_are_one_line_and_exit_2(capsys):
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        for argv, match in [
            (["--speculative-config", "{bad"], "not valid JSON"),
            (["--speculative-config", '{"method": "nope"}'], "nope"),
            (["--port", "70000"], "--port"),
            (["--max-num-seqs", "0"], "--max-num-seqs"),
            (["--compile", "--compile-mode", "fast"], "unknown compile mode 'fast'"),
            (["--port", str(taken.getsockname()[1])], "cannot listen"),
        ]:
            assert cli_main(["serve", *argv]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    finally:
        taken.close()


def test_sigterm_drains_then_exits_0(ckpt):
    """`specdecode serve` as a process: SIGTERM mid-stream -> 503 for new work, the stream completes, exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specdecode.entrypoints.cli", "serve", "--model", ckpt, "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--max-num-seqs", "1", "--threads", "1", "--log-level", "warning",
           "--speculative-config", json.dumps(SPEC)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        streams: list[list] = [[], [], []]
        started = [threading.Event() for _ in streams]  # a chat stream's first chunk: its request was admitted

        def stream(i: int):
            body = {"messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 200, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    streams[i].extend(sse_events([line]))
                    started[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]  # the others queue behind the first
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started)  # every request admitted (queued) before the signal
        proc.send_signal(signal.SIGTERM)
        late = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503
        for t in threads:
            t.join(60)
        for events in streams:
            check_stream(events, chat=True, include_usage=True)
            assert events[-2]["usage"]["completion_tokens"] == 200
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
