"""The OpenAI wire format: request models, their mapping to `SamplingParams`, errors, usage.

Owns: what a `/v1/completions` or `/v1/chat/completions` body may hold and how each bad
field becomes an OpenAI-style 400 (`{"error": {"message", "type", "param", "code"}}`),
and the request limits.
Does not own: the bounds themselves (config.SamplingParams and the engine check them;
their one-line messages are passed through), HTTP routing (server.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.requests import Request

from specdecode.config import SamplingParams, SpecDecodeError, StructuredOutput, first_line, is_int

# OpenAI and vLLM fields we do not implement: a request that sets one gets a 400 rather than
# silence, except at the values that ask for nothing (their defaults, which some clients always send).
UNSUPPORTED: dict[str, tuple] = {
    "suffix": ("",), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
}  # fmt: skip
# vLLM's structured_outputs keys (and its older guided_* fields) -> StructuredOutput kinds
STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "n", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens", "stop_token_ids",
                   "bad_words", "allowed_token_ids", "logprobs", "top_logprobs", "logprobs_mode")  # fmt: skip
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs and OpenAI's top_logprobs


class APIError(Exception):
    """An error answered as OpenAI does: an HTTP status and a JSON `error` object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_spec_error(e: SpecDecodeError) -> APIError:
    """A 400 for a one-line `SpecDecodeError`; ``param`` is the field its message names first."""
    msg = str(e)
    first = re.match(r"\w*", msg).group(0)  # "max_tokens must ...", "max_tokens=9 is ..."
    param = first if first in SAMPLING_FIELDS else None
    if param is None and "speculat" in msg:
        param = "speculative_config"
    if param is None and "prompt" in msg:
        param = "prompt" if "context" in msg or "empty" in msg else None
    return bad_request(msg, param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints; ``top_k``, ``ignore_eos`` and ``speculative_config`` are extensions."""

    model_config = ConfigDict(extra="allow", strict=True)  # as OpenAI: no true for 1, no "yes" for true
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None  # null: false, as OpenAI documents
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    speculative_config: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extensions from here
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logprobs_mode: str | None = None
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutput | None, str | None]:
        """The output constraint the request sets, and the field that set it (at most one)."""
        found: list[tuple[str, str, Any]] = []  # (field, kind, spec)
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", "json_object", None))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                    raise bad_request("response_format.json_schema must be an object with a schema object", "response_format")
                found.append(("response_format", "json", js.get("schema", {})))
            elif kind != "text":
                raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                                  "response_format")  # fmt: skip
        so = self.structured_outputs or {}
        for key, value in so.items():
            if key not in STRUCTURED_KEYS:
                raise bad_request(f"structured_outputs: unknown key {key!r}; one of {', '.join(STRUCTURED_KEYS)}",
                                  "structured_outputs")  # fmt: skip
            if value is not None and value is not False:
                found.append(("structured_outputs", STRUCTURED_KEYS[key], None if key == "json_object" else value))
        for key in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{key}")
            if value is not None:
                found.append((f"guided_{key}", key, value))
        if len(found) > 1:
            raise bad_request(f"set one output constraint, got {', '.join(f for f, _, _ in found)}", found[1][0])
        if not found:
            return None, None
        field, kind, spec = found[0]
        if kind == "json" and isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise bad_request(f"{field}: the JSON schema is not valid JSON: {e.msg}", field) from None
        try:
            return StructuredOutput(kind, spec), field
        except SpecDecodeError as e:
            raise bad_request(f"{field}: {e}", field) from None

    def check_supported(self) -> None:
        for name, no_ops in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and not any(type(value) is type(v) and value == v for v in no_ops):
                raise bad_request(f"{name} is not supported by this server", name)
        if self.best_of not in (None, 1, self.n):
            raise bad_request(f"best_of must equal n (no sample is ranked or dropped), got {self.best_of}", "best_of")

    def num_logprobs(self) -> int | None:
        """The alternatives to return per token; None: no logprobs."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        k = self.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k}", "prompt_logprobs")
        return k

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        optional = {name: getattr(self, name) for name in (
            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens",
            "stop_token_ids", "bad_words", "allowed_token_ids", "logprobs_mode", "n") if getattr(self, name) is not None}  # fmt: skip
        structured, _ = self.structured()
        try:
            return SamplingParams(
                structured=structured,
                temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,  # -1 (vLLM) or 0: no top-k filter; below -1 refused, as vLLM does
                max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
                seed=self.seed,
                stop=stop,
                ignore_eos=bool(self.ignore_eos),
                logprobs=self.num_logprobs(),
                prompt_logprobs=self.num_prompt_logprobs(),
                **optional,
            )
        except SpecDecodeError as e:
            raise self.as_sent(from_spec_error(e)) from None

    def as_sent(self, e: APIError) -> APIError:
        """``e`` with its fields named as the client sent them (a chat request may say max_completion_tokens;
        a grammar that does not compile names the field that sent it)."""
        if e.message.startswith("structured output"):
            return bad_request(e.message, self.structured()[1])
        return e

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the alternatives per token (0: the chosen token's only)
    echo: bool | None = None

    def prompts(self, most: int) -> list[str | list[int]]:
        """The prompts: a list of strings or of token-id lists is a batch (one choice each, n each)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(batch) > most:
            raise bad_request(f"prompt: at most {most} prompts per request, got {len(batch)}", "prompt")
        return batch

    def num_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt's tokens too (OpenAI's legacy way to get them)."""
        k = super().num_prompt_logprobs()
        return self.logprobs if k is None and self.echo and self.logprobs is not None else k


ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in ROLES:
            raise PydanticCustomError("role", f"must be one of {', '.join(ROLES)}")
        return v

    @model_validator(mode="after")
    def _fields_for_the_role(self) -> "ChatMessage":
        # OpenAI's rules: only an assistant message that calls tools may leave content null, and
        # a tool result names the call it answers
        calls = (self.model_extra or {}).get("tool_calls")
        if self.content is None and not (self.role == "assistant" and calls):
            raise PydanticCustomError("content", f"a {self.role} message needs content")
        if self.role == "tool" and not isinstance((self.model_extra or {}).get("tool_call_id"), str):
            raise PydanticCustomError("tool_call_id", "a tool message needs tool_call_id (a string)")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:  # pydantic's own message named only the str branch
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(p, dict) for p in v)):
            return v
        raise PydanticCustomError("content", 'must be a string or a list of content parts ({"type": "text", "text": ...})')

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}]: only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # one call per answer under a forced choice; several under "auto"
    _tool_plan: Any = PrivateAttr(default=None)  # tools.ToolPlan, set by the route

    @property
    def tool_plan(self) -> Any:
        return self._tool_plan

    def use_tools(self, plan: Any) -> None:
        self._tool_plan = plan

    def structured(self) -> tuple[StructuredOutput | None, str | None]:
        own = super().structured()
        plan = self.tool_plan
        if plan is None or not plan.forced:
            return own
        if own[0] is not None:
            raise bad_request(f"tool_choice forces a call; {own[1]} cannot constrain the output too", own[1])
        return plan.constraint, "tool_choice"

    def num_logprobs(self) -> int | None:
        k = self.top_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k}", "top_logprobs")
        if k and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (k or 0) if self.logprobs else None

    def as_sent(self, e: APIError) -> APIError:
        if e.param == "max_tokens" and self.max_completion_tokens is not None and e.message.startswith("max_tokens"):
            return bad_request("max_completion_tokens" + e.message[len("max_tokens") :], "max_completion_tokens")
        return super().as_sent(e)


def parse_body(raw: bytes, model_cls: type[_Request]) -> Any:
    """Bytes -> a validated request; non-UTF-8, malformed JSON and bad fields -> 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} at char {e.pos}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    except ValueError as e:  # Python's limit on an integer's digits (4300)
        raise bad_request(f"request body holds a number Python will not read: {first_line(e)}") from None
    try:  # a lone surrogate ("\\ud800") is a valid JSON escape but no text a tokenizer takes
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"request body holds a lone UTF-16 surrogate ({e.object[e.start : e.end]!a})") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    try:
        req = model_cls.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        req.max_tokens = req.max_completion_tokens  # OpenAI's and vLLM's order: the newer name wins
    req.check_supported()
    return req


_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_error(errors: Any) -> APIError:
    """pydantic's / FastAPI's error list -> one 400 naming the first bad field."""
    err = next(iter(errors)) if errors else {"loc": (), "msg": "invalid request"}
    # drop "body" and pydantic's union-member tags such as "str" or "list[int]"
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not (isinstance(x, str) and (x in _TAGS or "[" in x))]
    param = loc[0] if loc else None
    where = ".".join(loc)
    return bad_request(f"{where}: {err.get('msg')}" if where else str(err.get("msg")), param)


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for, so that none can stall the others (checked before any
    tokenizing). ``max_prompt_chars`` None: 32 characters a token of the context, above any
    tokenizer's; ``max_tokens_limit`` None: the context."""

    max_body_bytes: int = 8 << 20
    max_prompt_chars: int | None = None
    max_stop: int = 4  # OpenAI's
    max_stop_chars: int = 1000
    max_messages: int = 1000
    max_tokens_limit: int | None = None
    max_n: int = 16  # samples per prompt
    max_prompts: int = 64  # prompts in one /v1/completions request

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if value is not None and (not is_int(value) or value < 1):
                raise SpecDecodeError(f"{name} must be an integer >= 1, got {value!r}")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or a 413 as soon as it is known to pass ``limit`` bytes (its
    Content-Length, else what has arrived), without reading the rest."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {int(declared)} bytes; the limit is {limit}", code="request_too_large")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
        parts.append(chunk)
    return b"".join(parts)
