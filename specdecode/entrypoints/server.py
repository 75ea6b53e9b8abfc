"""`specdecode serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the serving engine.

Owns: the routes (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics),
bearer auth on /v1/*, text (detokenization, stop strings, chat template), SSE streaming,
and cancelling a request whose client went away.
Does not own: the wire format's validation and request limits (openai_protocol.py), the engine thread
(engine_thread.py), loading and running the server with its shutdown on signals (serve.py),
scheduling and decoding (engine/), metric definitions (metrics.py), the SSE response and
disconnect watching (streaming.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdecode.config import SpecDecodeError
from specdecode.entrypoints.choices import Choice, request_usage
from specdecode.entrypoints.streaming import EventStream, cancel, disconnected, sse_line
from specdecode.entrypoints.tools import ToolPlan, assistant_message, final_delta, plan_tools, template_messages
from specdecode.entrypoints.engine_thread import ADMITTED, EngineThread, ShuttingDown
from specdecode.entrypoints.openai_protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, ServerLimits, bad_request, from_spec_error, parse_body,
    read_body, validation_error,
)  # fmt: skip
from specdecode.entrypoints.metrics import CONTENT_TYPE, ServerMetrics

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


class _Server:
    """What the routes share: the engine thread, the tokenizer, the model's names and limits."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, max_model_len: int, vocab_size: int,
                 api_key: str | None, aliases: Sequence[str], metrics: ServerMetrics, limits: ServerLimits) -> None:  # fmt: skip
        self.tokenizer, self.model_name, self.max_model_len, self.vocab_size = tokenizer, model_name, max_model_len, vocab_size
        self.limits = dataclasses.replace(limits, max_prompt_chars=limits.max_prompt_chars or 32 * max_model_len)
        self.api_key, self.names, self.metrics = api_key, {model_name, *aliases}, metrics
        self.engine_thread = EngineThread(engine, metrics)
        self.created = int(time.time())

    # -- text ------------------------------------------------------------------------------

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request("this model has no tokenizer; send the prompt as token ids", "prompt")
            return list(self.tokenizer(prompt)["input_ids"])
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # the template's own checks (roles, order) raise jinja errors
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def check_limits(self, req: Any, texts: Sequence[str]) -> None:
        """A request past the limits is a 400 naming the field, before anything is tokenized."""
        lim = self.limits
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > lim.max_stop:
            raise bad_request(f"stop: at most {lim.max_stop} stop strings, got {len(stop)}", "stop")
        if any(len(s) > lim.max_stop_chars for s in stop):
            raise bad_request(f"stop: a stop string may have at most {lim.max_stop_chars} characters", "stop")
        messages = getattr(req, "messages", None)
        if messages is not None and len(messages) > lim.max_messages:
            raise bad_request(f"messages: at most {lim.max_messages} messages, got {len(messages)}", "messages")
        chars = sum(len(t) for t in texts)
        if chars > lim.max_prompt_chars:
            field = "messages" if messages is not None else "prompt"
            raise bad_request(f"{field}: at most {lim.max_prompt_chars} characters, got {chars}", field)
        if lim.max_tokens_limit is not None and req.max_tokens is not None and req.max_tokens > lim.max_tokens_limit:
            raise req.as_sent(bad_request(f"max_tokens must be at most {lim.max_tokens_limit}, got {req.max_tokens}",
                                          "max_tokens"))  # fmt: skip

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(400, f"model {name!r} is not served here; available: {self.model_name}",
                           param="model", code="model_not_found")  # fmt: skip

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    # -- generation ------------------------------------------------------------------------

    async def generate(self, request: Request, req: Any, prompts: list[list[int]], chat: bool,
                       echo: Sequence[str] = ()) -> Response:  # fmt: skip
        """n choices per prompt (choice i * n + k is prompt i's sample k), each its own engine request."""
        arrival = time.monotonic()
        room = max(1, self.max_model_len - max(len(p) for p in prompts))  # an unset max_tokens never overruns the context
        default_max = room if chat else min(COMPLETION_MAX_TOKENS, room)
        default_max = min(default_max, self.limits.max_tokens_limit or default_max)
        params = req.sampling_params(default_max)
        if params.n > self.limits.max_n:
            raise bad_request(f"n must be at most {self.limits.max_n}, got {params.n}", "n")
        if self.engine_thread.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices: list[Choice] = []
        try:
            for i, ids in enumerate(prompts):
                for k in range(params.n):
                    rid = request_id if len(prompts) * params.n == 1 else f"{request_id}-{i}-{k}"
                    sp = dataclasses.replace(params, n=1, seed=params.sample_seed(k))
                    events = self.engine_thread.submit(rid, ids, sp, req.speculative_config)
                    admitted = await events.get()
                    if admitted is not ADMITTED:
                        raise req.as_sent(_engine_error(admitted))
                    self.metrics.observe_admitted(len(ids))
                    choices.append(Choice(self, rid, events, sp, arrival, len(choices), echo[i] if echo else "", ids))
        except BaseException:
            for c in choices:  # nothing of a refused request keeps running
                c.cancel()
            raise
        lengths = [len(p) for p in prompts]
        if req.stream:
            return EventStream(self._sse(request_id, choices, req, chat, lengths), on_close=lambda: cancel(choices))
        return await self._complete(request, request_id, choices, chat, lengths, req.tool_plan if chat else None)

    async def _complete(self, request: Request, request_id: str, choices: list[Choice], chat: bool,
                        lengths: list[int], plan: ToolPlan | None = None) -> Response:  # fmt: skip
        async def collect(c: Choice) -> str:
            parts = []
            while c.finish is None:
                parts.append(await c.next_delta())
            return "".join(parts)

        work = asyncio.ensure_future(asyncio.gather(*(collect(c) for c in choices)))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                cancel(choices)
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody is listening
        try:
            texts = work.result()
        except Exception as e:
            cancel(choices)
            raise _engine_error(e) from None
        out = []
        for c, text in zip(choices, texts):
            choice: dict[str, Any] = {"index": c.index, "logprobs": c.logprobs_json(c.logprobs, chat, self.token_text),
                                      "finish_reason": c.finish}  # fmt: skip
            if c.params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = c.prompt_logprobs_json(self.token_text)
            if chat:
                choice["message"], choice["finish_reason"] = assistant_message(plan, text, c.finish)
            else:
                choice["text"] = c.echo + text
            out.append(choice)
        body = self._envelope(request_id, "chat.completion" if chat else "text_completion")
        return JSONResponse({**body, "choices": out, "usage": request_usage(choices, lengths)})

    async def _sse(self, request_id: str, choices: list[Choice], req: Any, chat: bool,
                   lengths: list[int]) -> AsyncIterator[str]:  # fmt: skip
        base = self._envelope(request_id, "chat.completion.chunk" if chat else "text_completion")
        plan = req.tool_plan if chat else None  # with tools, the text is sent whole at the end: it may be a call
        held = {c.index: "" for c in choices}
        if req.include_usage:
            base["usage"] = None  # OpenAI: null on every chunk but the last

        def chunk(c: Choice, text: str | None, finish: str | None = None, role: bool = False, lossy: bool = False,
                  logprobs: Any = None) -> str:  # fmt: skip
            choice: dict[str, Any] = {"index": c.index, "logprobs": logprobs, "finish_reason": finish}
            if chat:
                choice["delta"] = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            else:
                choice["text"] = text or ""
            return sse_line({**base, "choices": [choice], **({"lossy": True} if lossy else {})})

        try:
            for c in choices:
                if chat:
                    yield chunk(c, None, role=True)
                elif c.echo:
                    yield chunk(c, c.echo)
            waiting = {asyncio.ensure_future(c.next_delta()): c for c in choices}
            failed = False
            while waiting and not failed:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    c = waiting.pop(task)
                    try:
                        delta = task.result()
                    except Exception as e:
                        yield sse_line(_engine_error(e).body())
                        failed = True
                        break
                    if plan is not None:
                        held[c.index] += delta
                    elif delta or c.new_logprobs:
                        yield chunk(c, delta, logprobs=c.logprobs_json(c.new_logprobs, chat, self.token_text))
                    if c.finish is None:
                        waiting[asyncio.ensure_future(c.next_delta())] = c
                    else:  # lossy (typical acceptance) said where every client sees it, not only in usage
                        finish = c.finish
                        if plan is not None:  # the held text, or its tool calls, as one delta
                            delta_obj, finish = final_delta(plan, held[c.index], finish)
                            lps = c.logprobs_json(c.logprobs, chat, self.token_text)
                            yield sse_line({**base, "choices": [{"index": c.index, "delta": delta_obj, "logprobs": lps,
                                                                  "finish_reason": None}]})  # fmt: skip
                        yield chunk(c, None, finish, lossy=c.last.stats.lossy)
            for task in waiting:
                task.cancel()
            if not failed and req.include_usage:
                yield sse_line({**base, "choices": [], "usage": request_usage(choices, lengths)})
            yield "data: [DONE]\n\n"
        finally:  # when the client disconnects mid-stream (see _EventStream)
            cancel(choices)

    def _envelope(self, request_id: str, obj: str) -> dict[str, Any]:
        return {"id": request_id, "object": obj, "created": int(time.time()), "model": self.model_name}


_SCHEMAS: dict[str, Any] = {}  # the request models' nested schemas, for the OpenAPI document's components


def _body_schema(model: Any) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its raw body itself (read_body and
    parse_body keep their limits and one-line errors): the pydantic model's JSON schema, so that
    /docs, schema-driven clients and fuzzers know the fields."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _SCHEMAS.update(schema.pop("$defs", {}))
    _SCHEMAS[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi_with_bodies(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        doc.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMAS)
        app.openapi_schema = doc
    return app.openapi_schema


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, SpecDecodeError):
        return from_spec_error(e)
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), "service_unavailable")
    return APIError(500, f"internal error: {e}", "internal_server_error")


def create_app(
    engine: Any,
    tokenizer: Any,
    model_name: str,
    *,
    max_model_len: int,
    vocab_size: int,
    api_key: str | None = None,
    aliases: Sequence[str] = (),
    metrics: ServerMetrics | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The app over an already-built engine (a `ServingEngine` or anything with its interface).

    The engine thread starts with the app's lifespan and drains when it ends.
    ``app.state.server.engine_thread.call(fn)`` runs ``fn(engine)`` between steps.
    """
    server = _Server(engine, tokenizer, model_name, max_model_len, vocab_size, api_key, aliases,
                     metrics or ServerMetrics(model_name), limits or ServerLimits())  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine_thread.start()
        yield
        await asyncio.to_thread(server.engine_thread.stop)

    app = FastAPI(title="specdecode", lifespan=lifespan)
    app.state.server = server

    async def check_key(request: Request) -> None:
        if server.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 7235); the key is compared in constant time
        ok = scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), server.api_key.encode())
        if not ok:
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": server.created, "owned_by": "specdecode",
                "max_model_len": max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @v1.post("/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        req = parse_body(await read_body(request, server.limits.max_body_bytes), CompletionRequest)
        server.check_model(req.model)
        prompts = req.prompts(server.limits.max_prompts)
        server.check_limits(req, [p for p in prompts if isinstance(p, str)])
        ids = [await asyncio.to_thread(server.tokenize, p) for p in prompts]  # off the event loop: /health stays live
        echo = [p if isinstance(p, str) else server.decode(p) for p in prompts] if req.echo else ()
        return await server.generate(request, req, ids, chat=False, echo=echo)

    @v1.post("/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        req = parse_body(await read_body(request, server.limits.max_body_bytes), ChatCompletionRequest)
        server.check_model(req.model)
        messages = template_messages(req.messages)
        server.check_limits(req, [m["content"] or "" for m in messages])
        template = getattr(server.tokenizer, "chat_template", None)
        req.use_tools(plan_tools(req.tools, req.tool_choice, template if isinstance(template, str) else None))
        tools = req.tool_plan.tools if req.tool_plan is not None else None
        ids = await asyncio.to_thread(server.encode_chat, messages, tools)  # the template and tokenizer, off the loop
        return await server.generate(request, req, [ids], chat=True)

    app.include_router(v1)
    app.openapi = lambda: _openapi_with_bodies(app)

    @app.get("/health")
    async def health() -> Response:
        if server.engine_thread.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_text() -> Response:  # open, like /health: scrapers rarely send a key
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, e: ClientDisconnect) -> Response:  # left mid-body: nobody to answer
        return Response(status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        err = validation_error(e.errors())  # FastAPI's 422 becomes OpenAI's 400
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if e.status_code < 500 else "internal_server_error"
        # Starlette's own headers (a 405's Allow) go out with the body
        return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))  # fmt: skip

    return app
