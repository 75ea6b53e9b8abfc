"""`specdecode serve`: the OpenAI wire format, metrics, auth, bad input, load and faults.

Every test talks HTTP to a real uvicorn server on 127.0.0.1 (a thread, or a subprocess
for SIGTERM), with counts and waits bounded so the file runs in well under a minute.
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

from specdecode.config import SpecConfig
from specdecode.engine.serving import ServingEngine
from specdecode.entrypoints.cli import main as cli_main
from specdecode.entrypoints.server import create_app
from specdecode.model.loader import load_model
from tests.entrypoints.server_helpers import ServerThread, SlowEngine, sse_events
from tests.tiny import make_tiny_checkpoint

MAX_MODEL_LEN = 256  # the tiny checkpoint's context
GAMMA = 3
SPEC = {"method": "ngram", "num_speculative_tokens": GAMMA, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "acceptance_rate", "mean_accepted_length",
              "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position"}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", "llama", seed=0))


@pytest.fixture(scope="module")
def target(ckpt):
    return load_model(ckpt, dtype="float32", device="cpu", progress=False)


def make_engine(target, max_num_seqs: int = 8, delay: float = 0.0) -> SlowEngine:
    engine = ServingEngine(target, SpecConfig.parse(SPEC), max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs)
    return SlowEngine(engine, delay)


def make_app(target, engine=None, **kw):
    engine = engine if engine is not None else make_engine(target)
    return create_app(engine, target.tokenizer, "tiny", max_model_len=MAX_MODEL_LEN,
                      vocab_size=target.config.vocab_size, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def served(target):
    with ServerThread(make_app(target)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        yield c


def wait_idle(srv: ServerThread, timeout: float = 20.0):
    """Poll the engine (on its thread) until nothing runs, waits or holds blocks."""
    deadline = time.monotonic() + timeout
    while True:
        s = srv.engine_call(lambda e: e.stats())
        if (s.num_running, s.num_waiting, s.num_prefilling, s.kv_blocks_used) == (0, 0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def check_usage(u):
    assert USAGE_KEYS <= set(u)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    if u["num_draft_tokens"]:
        assert u["acceptance_rate"] == pytest.approx(u["num_accepted_tokens"] / u["num_draft_tokens"])
    if u["num_drafts"]:
        assert u["mean_accepted_length"] == pytest.approx(1 + u["num_accepted_tokens"] / u["num_drafts"])
    assert sum(u["accepted_per_position"]) == u["num_accepted_tokens"]


def check_completion(body, chat: bool, max_tokens: int):
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["id"].startswith("chatcmpl-" if chat else "cmpl-") and body["model"] == "tiny"
    (choice,) = body["choices"]
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
    if chat:
        assert choice["message"]["role"] == "assistant"
    check_usage(body["usage"])
    assert 1 <= body["usage"]["completion_tokens"] <= max_tokens
    return text


def check_stream(events, chat: bool, include_usage: bool):
    """Well-formed SSE: JSON chunks, a finish reason, the usage chunk if asked, then [DONE]. Returns the text."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    usage_chunk = chunks.pop() if include_usage else None
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len({c["id"] for c in chunks}) == 1
    if include_usage:
        assert usage_chunk["choices"] == [] and usage_chunk["id"] == chunks[0]["id"]
        check_usage(usage_chunk["usage"])
    key = (lambda c: c["choices"][0]["delta"].get("content") or "") if chat else (lambda c: c["choices"][0]["text"])
    return "".join(key(c) for c in chunks)


# -- the wire format ---------------------------------------------------------------------


def test_completion_and_chat_streaming_match_non_streaming(client):
    prompt = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body = client.post("/v1/completions", json=prompt).json()
    text = check_completion(body, chat=False, max_tokens=12)
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["finish_reason"] == "length"
    with client.stream("POST", "/v1/completions", json={**prompt, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert check_stream(sse_events(r.iter_lines()), chat=False, include_usage=False) == text

    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 9, "temperature": 0, "ignore_eos": True}  # fmt: skip
    body = client.post("/v1/chat/completions", json=chat).json()
    text = check_completion(body, chat=True, max_tokens=9)
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json={**chat, **opts}) as r:
        events = sse_events(r.iter_lines())
    assert check_stream(events, chat=True, include_usage=True) == text
    assert events[-2]["usage"]["completion_tokens"] == 9


def test_stop_strings_cut_the_text_streamed_or_not(client):
    base = {"prompt": "hello", "max_tokens": 40, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    full = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    assert len(full) > 8
    # a 2-character stop string whose first occurrence is well inside the text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full.index(full[i : i + 2]) == i)
    cut = client.post("/v1/completions", json={**base, "stop": stop}).json()
    assert cut["choices"][0]["text"] == full[: full.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**base, "stop": [stop], "stream": True}) as r:
        assert check_stream(sse_events(r.iter_lines()), chat=False, include_usage=False) == full[: full.index(stop)]


def test_models_health_and_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert client.get("/health").json() == {"status": "ok"}
    client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 8, "ignore_eos": True})
    text = client.get("/metrics").text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "specdecode:kv_blocks_used", "specdecode:generation_tokens_per_second"):  # fmt: skip
        assert re.search(rf"^{re.escape(name)}{{", text, re.M), name
    value = lambda n: float(re.search(rf"^{re.escape(n)}{{[^}}]*}} (\S+)$", text, re.M).group(1))
    per_pos = [float(v) for v in re.findall(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total{[^}]*position="\d+"} (\S+)$', text, re.M)]
    assert value("vllm:spec_decode_num_drafts_total") > 0
    assert sum(per_pos) == value("vllm:spec_decode_num_accepted_tokens_total")


def test_speculative_override_per_request(client):
    off = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 8, "ignore_eos": True,
                                               "speculative_config": {"num_speculative_tokens": 0}}).json()  # fmt: skip
    assert off["usage"]["num_drafts"] == 0 and off["usage"]["mean_accepted_length"] == 1.0


# -- bad input -----------------------------------------------------------------------------

BAD = [
    ("malformed JSON", b'{"prompt": "hi", ', None),
    ("non-UTF-8", b'{"prompt": "\xff\xfe"}', None),
    ("not an object", b"[1, 2]", None),
    ("unknown model", {"model": "gpt-4"}, "model"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens < 0", {"max_tokens": -3}, "max_tokens"),
    ("max_tokens beyond the context", {"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("max_tokens not a number", {"max_tokens": "many"}, "max_tokens"),
    ("temperature < 0", {"temperature": -0.5}, "temperature"),
    ("top_p 0", {"top_p": 0}, "top_p"),
    ("top_p > 1", {"top_p": 1.5}, "top_p"),
    ("oversize prompt", {"prompt": "x" * (MAX_MODEL_LEN + 10)}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("token id out of range", {"prompt": [5, 100000]}, "prompt"),
    ("speculative override < 0", {"speculative_config": {"num_speculative_tokens": -1}}, "speculative_config"),
    ("speculative override > γ", {"speculative_config": {"num_speculative_tokens": 99}}, "speculative_config"),
    ("speculative override unknown key", {"speculative_config": {"method": "ngram", "gamma": 2}}, "speculative_config"),
    ("speculative override not an object", {"speculative_config": 3}, "speculative_config"),
    ("n > 1", {"n": 2}, "n"),
    ("unsupported logprobs", {"logprobs": 2}, "logprobs"),
    ("stop not strings", {"stop": [1]}, "stop"),
    ("missing prompt", {"prompt": None}, "prompt"),
]


@pytest.mark.parametrize("case,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_400_and_the_server_keeps_serving(client, case, body, param):
    if isinstance(body, dict):
        body = json.dumps({"prompt": "hello", "max_tokens": 4, **body}).encode()
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, (case, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and "\n" not in err["message"] and err["param"] == param
    ok = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert ok.status_code == 200


def test_bad_chat_input_is_400(client):
    for body, param in [({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens")]:  # fmt: skip
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


# -- auth ------------------------------------------------------------------------------------


def test_api_key(target):
    with ServerThread(make_app(target, api_key="s3cret")) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for r in (c.post("/v1/completions", json=body, headers=headers), c.get("/v1/models", headers=headers)):
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # auth comes before parsing: a bad body without a key is still 401
        assert c.post("/v1/completions", content=b"{", headers={}).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/completions", json=body, headers=good).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


# -- load and faults -------------------------------------------------------------------------


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
        assert re.search(r'^vllm:request_success_total{finished_reason="abort",model_name="tiny"} 7\.0$',
                         httpx.get(srv.url + "/metrics").text, re.M)  # fmt: skip
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 3}).status_code == 200


def test_drain_finishes_in_flight_and_refuses_new(target):
    """What SIGTERM does (DrainingServer.handle_exit), in-process: 503 for new work, in-flight completes, exit."""
    engine = make_engine(target, delay=0.02)
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
        t.join(30)
        check_stream(events, chat=True, include_usage=False)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        srv.thread.join(30)
        assert not srv.thread.is_alive()  # the server stopped by itself once drained
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
        started = threading.Event()

        def stream(i: int):
            body = {"messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 200, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    streams[i].extend(sse_events([line]))
                    started.set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]  # the others queue behind the first
        for t in threads:
            t.start()
        assert started.wait(30)
        time.sleep(0.05)  # let the others reach the queue
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
