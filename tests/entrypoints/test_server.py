"""`specdecode serve`: the OpenAI wire format, metrics, auth and bad input (load and faults:
test_server_faults.py).

Every test talks HTTP to a real uvicorn server on 127.0.0.1 (a thread, or a subprocess
for SIGTERM), with counts and waits bounded so the file runs in well under a minute.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest

from specdecode.config import SpecDecodeError
from specdecode.entrypoints.server import ServerLimits, create_app
from tests.entrypoints.server_helpers import (
    MAX_MODEL_LEN,
    ScriptedEngine,
    ServerThread,
    byte_fallback_tokenizer,
    make_app,
    sse_events,
)

USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "acceptance_rate", "draft_acceptance_rate",
              "mean_accepted_length", "num_drafts", "num_draft_tokens", "num_reached_tokens", "num_accepted_tokens",
              "accepted_per_position"}  # fmt: skip


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        yield c


def check_usage(u):
    assert USAGE_KEYS <= set(u)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    if u["num_draft_tokens"]:
        assert u["acceptance_rate"] == pytest.approx(u["num_accepted_tokens"] / u["num_reached_tokens"])
        assert u["draft_acceptance_rate"] == pytest.approx(u["num_accepted_tokens"] / u["num_draft_tokens"])
        assert u["num_accepted_tokens"] <= u["num_reached_tokens"] <= u["num_draft_tokens"]
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


def test_prefix_cache_metrics(client):
    """A prompt sent twice is found in the prefix cache the second time (blocks of 16 tokens):
    in the usage (OpenAI's cached_tokens) and in vLLM's counters."""
    value = lambda text, n: float(re.search(rf"^{re.escape(n)}{{[^}}]*}} (\S+)$", text, re.M).group(1))
    before = client.get("/metrics").text
    prompt = {"prompt": "the same long prompt, sent twice: " * 3, "max_tokens": 2}
    first, second = (client.post("/v1/completions", json=prompt).json()["usage"] for _ in range(2))
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 16 <= second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]
    after = client.get("/metrics").text
    hits = value(after, "vllm:prefix_cache_hits_total") - value(before, "vllm:prefix_cache_hits_total")
    queries = value(after, "vllm:prefix_cache_queries_total") - value(before, "vllm:prefix_cache_queries_total")
    assert 16 <= hits < queries


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
    ("n above the limit", {"n": 17}, "n"),
    ("n = 0", {"n": 0}, "n"),
    ("best_of = 0", {"best_of": 0}, "best_of"),
    ("seed beyond 64 bits", {"seed": 2**64}, "seed"),
    ("logprobs above 20", {"logprobs": 21}, "logprobs"),
    ("prompt_logprobs above 20", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("stop_token_ids outside the vocabulary", {"stop_token_ids": [100000]}, "stop_token_ids"),
    ("logit_bias id outside the vocabulary", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("logit_bias key not an id", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("logit_bias above 100", {"logit_bias": {"5": 150}}, "logit_bias"),
    ("presence_penalty above 2", {"presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty below -2", {"frequency_penalty": -3}, "frequency_penalty"),
    ("repetition_penalty 0", {"repetition_penalty": 0}, "repetition_penalty"),
    ("min_p above 1", {"min_p": 1.5}, "min_p"),
    ("min_tokens above max_tokens", {"min_tokens": 9}, "min_tokens"),
    ("allowed_token_ids empty", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("unsupported tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("unknown response_format", {"response_format": {"type": "yaml"}}, "response_format"),
    ("too many prompts", {"prompt": ["a"] * 65}, "prompt"),
    ("stop not strings", {"stop": [1]}, "stop"),
    ("missing prompt", {"prompt": None}, "prompt"),
    ("nested too deeply", b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", None),  # was a 500 (RecursionError)
    ("lone surrogate", b'{"prompt": "hi\\ud800", "max_tokens": 2}', None),  # was a 500 from the tokenizer
    ("max_tokens true", {"max_tokens": True}, "max_tokens"),  # was taken for 1
    ("ignore_eos not a boolean", {"ignore_eos": "yes"}, "ignore_eos"),  # was taken for true
    ("an integer of 5000 digits", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None),  # was a 500
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
                        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
                        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}, "max_completion_tokens"),
                        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens")]:  # fmt: skip
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(param) or param == "messages", r.text  # named as sent
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ["hi"]}]})  # bare strings
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        'messages.0.content: must be a string or a list of content parts ({"type": "text", "text": ...})'), r.text
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
    both = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 2,
            "ignore_eos": True}  # fmt: skip
    r = client.post("/v1/chat/completions", json=both)
    assert r.json()["usage"]["completion_tokens"] == 2  # the newer name wins
    defaults = {"response_format": {"type": "text"}, "tool_choice": "none", "stream": None, "logprobs": False,
                "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                "logit_bias": {}, "seed": None}  # what they are when unset; some clients always send them
    assert client.post("/v1/chat/completions", json={**both, **defaults}).status_code == 200
    r = client.post("/v1/chat/completions", json={**both, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    for messages in ([{"role": "wizard", "content": "hi"}], [{"role": "user", "content": None}],
                     [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]):  # fmt: skip
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "\n" not in r.json()["error"]["message"]
    surrogate = b'{"messages": [{"role": "user", "content": "hi\\ud800"}], "max_tokens": 2}'
    r = client.post("/v1/chat/completions", content=surrogate, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_unset_max_tokens_stays_within_the_context(client):
    """A completion without max_tokens (OpenAI's default 16) near the context's end gets the room left."""
    prompt = [5] * (MAX_MODEL_LEN - 4)
    r = client.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


# -- auth ------------------------------------------------------------------------------------


def test_api_key(target):
    with ServerThread(make_app(target, api_key="s3cret")) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        body = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for r in (c.post("/v1/completions", json=body, headers=headers), c.get("/v1/models", headers=headers)):
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # auth comes before parsing: a bad body without a key is still 401
        assert c.post("/v1/completions", content=b"{", headers={}).status_code == 401
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive (RFC 7235)
            good = {"Authorization": f"{scheme} s3cret"}
            assert c.post("/v1/completions", json=body, headers=good).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_characters_a_byte_fallback_tokenizer_spells_in_bytes_arrive_whole():
    """Gemma's and Llama-2's tokenizers decode each byte of an unfinished character to U+FFFD:
    the whole run waits, so no delta carries one and none is lost when the character completes."""
    tok = byte_fallback_tokenizer()
    want = "ab 你好 cd"
    script = tok(want, add_special_tokens=False)["input_ids"]
    assert len(script) > len(want)  # each CJK character is three byte tokens
    app = create_app(ScriptedEngine(script), tok, "tiny", max_model_len=64, vocab_size=len(tok))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        body = {"prompt": "a", "max_tokens": 50}
        assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            deltas = [e["choices"][0]["text"] for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert "".join(deltas) == want and not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("lossy", [False, True])
def test_a_lossy_stream_says_so_without_asking_for_usage(lossy):
    """Typical acceptance (opt-in) flags a request lossy: usage says it, and so does a stream's
    last chunk, which every client reads (usage comes only with stream_options.include_usage)."""
    tok = byte_fallback_tokenizer()
    app = create_app(ScriptedEngine(tok("abc", add_special_tokens=False)["input_ids"], lossy=lossy), tok, "tiny",
                     max_model_len=64, vocab_size=len(tok))  # fmt: skip
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        body = {"prompt": "a", "max_tokens": 50}
        assert c.post("/v1/completions", json=body).json()["usage"]["lossy"] is lossy
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [c.get("lossy") for c in chunks] == [None] * (len(chunks) - 1) + [True if lossy else None]


def test_a_wrong_method_is_405_with_allow(client):
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"], r.headers
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_client_gone_mid_body_logs_no_traceback(served, client):
    """A client that sends half its body and hangs up: no traceback, and the server serves on."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # uvicorn's loggers do not reach the root logger
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hel")  # fmt: skip
        assert client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
        assert client.get("/health").status_code == 200  # the gone request has been handled by now
    finally:
        logger.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]


# -- limits ------------------------------------------------------------------------------------


def test_requests_past_the_limits_are_refused_before_tokenizing(target):
    limits = ServerLimits(max_body_bytes=3000, max_prompt_chars=200, max_stop=2, max_stop_chars=5, max_messages=3,
                          max_tokens_limit=5)  # fmt: skip
    with ServerThread(make_app(target, limits=limits)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        def post(path, body, status, param):
            r = c.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and "\n" not in err["message"], r.text

        post("/v1/completions", {"prompt": "x" * 4000}, 413, None)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as raw:  # refused on its declared size
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n{}")
            assert raw.recv(100).startswith(b"HTTP/1.1 413")
        post("/v1/completions", {"prompt": "x" * 201}, 400, "prompt")
        post("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, 400, "stop")
        post("/v1/completions", {"prompt": "hi", "stop": "abcdef"}, 400, "stop")
        post("/v1/completions", {"prompt": "hi", "max_tokens": 6}, 400, "max_tokens")
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 2
        post("/v1/chat/completions", {"messages": msgs}, 400, "messages")
        post("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 201}]}, 400, "messages")
        post("/v1/chat/completions", {"messages": msgs[:1], "max_completion_tokens": 6}, 400, "max_completion_tokens")
        r = c.post("/v1/chat/completions", json={"messages": msgs[:1], "ignore_eos": True})  # unset: the limit
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
        ok = c.post("/v1/completions", json={"prompt": "x" * 200, "stop": ["ab", "c"], "max_tokens": 5})
        assert ok.status_code == 200, ok.text


def test_bad_limits_are_one_line():
    with pytest.raises(SpecDecodeError, match="max_stop must be an integer >= 1"):
        ServerLimits(max_stop=0)


def test_health_answers_while_a_maximal_request_is_tokenized(target):
    """An 8 MB prompt is tokenized off the event loop: /health answers meanwhile. The bound is
    generous (1 s): on the loop, tokenizing it held every client for seconds."""
    big = ServerLimits(max_prompt_chars=8 << 20)
    with ServerThread(make_app(target, limits=big)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        body = json.dumps({"prompt": "ab " * ((8 << 20) // 3 - 20)}).encode()
        done = threading.Event()
        status = []

        def send():
            with httpx.Client(base_url=srv.url, timeout=120) as other:
                status.append(other.post("/v1/completions", content=body,
                                         headers={"content-type": "application/json"}).status_code)  # fmt: skip
            done.set()

        threading.Thread(target=send, daemon=True).start()
        waits = []
        while not done.is_set() and len(waits) < 200:
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            waits.append(time.monotonic() - t0)
        assert done.wait(120) and status == [400]  # longer than the context, found once tokenized
        assert len(waits) >= 3 and max(waits) < 1.0, waits


def test_the_openapi_document_describes_the_request_bodies(client):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model, field in (("/v1/completions", "CompletionRequest", "prompt"),
                               ("/v1/chat/completions", "ChatCompletionRequest", "messages")):  # fmt: skip
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert field in schemas[model]["properties"] and field in schemas[model]["required"]
    assert "role" in schemas["ChatMessage"]["properties"]  # nested models resolve
    assert client.get("/docs").status_code == 200
