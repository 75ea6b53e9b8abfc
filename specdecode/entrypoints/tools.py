"""Tool calling on /v1/chat/completions: OpenAI's ``tools`` and ``tool_choice``.

Owns: validating the tools, whether the model's chat template can show them, the output
constraint a forced call is decoded under (``tool_choice`` "required" or a named function:
the tool's parameters as a JSON schema, so the call always parses), and turning an output
into ``tool_calls``: a forced call's JSON, or the ``<tool_call>{...}</tool_call>`` blocks
that Hermes-style templates (Qwen, SmolLM3, Hermes) ask the model to write under "auto".
Does not own: the request's other fields (openai_protocol.py) or the routes (server.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specdecode.config import StructuredOutput
from specdecode.entrypoints.openai_protocol import bad_request

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its decoding: the tools the template shows, the
    constraint a forced call is decoded under (None under "auto"), and the forced name."""

    tools: list[dict[str, Any]]
    constraint: StructuredOutput | None = None
    forced_name: str | None = None  # a named tool_choice: the output is that function's arguments

    @property
    def forced(self) -> bool:
        return self.constraint is not None


def plan_tools(tools: Any, tool_choice: Any, template: str | None) -> ToolPlan | None:
    """None where the request uses no tools (none given, or tool_choice "none")."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools or tool_choice == "none":
        if tool_choice not in ("none", "auto"):
            raise bad_request("tool_choice names a tool, but no tools were given", "tool_choice")
        return None
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise bad_request('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": '
                          '{...}}} with names of letters, digits, _ and - (at most 64)', "tools")  # fmt: skip
    if not template or "tools" not in template:
        raise bad_request("this model's chat template does not show tools; send them in a message instead", "tools")
    names = [t["function"]["name"] for t in tools]
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if tool_choice == "auto":
        return ToolPlan(tools)
    if tool_choice == "required":  # one call of any tool: {"name": ..., "arguments": {...}}
        schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
                             "required": ["name", "arguments"], "additionalProperties": False} for n in names]}  # fmt: skip
        return ToolPlan(tools, StructuredOutput("json", _compact(schema)))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in params:
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          f'{{"name": one of {names}}}}}', "tool_choice")  # fmt: skip
    return ToolPlan(tools, StructuredOutput("json", _compact(params[name])), forced_name=name)


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """Arguments without free whitespace (llguidance's option; a schema's own setting wins): a
    call's arguments are a string to parse, and a model cannot pad them out to max_tokens."""
    return {"x-guidance": {"whitespace_flexible": False}, **schema}


def _is_tool(t: Any) -> bool:
    f = t.get("function") if isinstance(t, dict) else None
    return (t.get("type") == "function" and isinstance(f, dict) and isinstance(f.get("name"), str)
            and NAME.fullmatch(f["name"]) is not None and isinstance(f.get("parameters", {}), dict))  # fmt: skip


def tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of an output: a forced call is the whole text; under "auto" the
    Hermes blocks that parse (the rest stays content)."""
    if plan.forced_name is not None:
        return None, [_call(plan.forced_name, text)]
    if plan.forced:
        call = json.loads(text)  # the grammar made it {"name": ..., "arguments": {...}}
        return None, [_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))]
    calls = []
    for m in HERMES_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append(_call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    if not calls:
        return text, []
    rest = HERMES_CALL.sub("", text).strip()
    return rest or None, calls


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_message(plan: ToolPlan | None, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message and finish reason: its text, or the tool calls in it (then
    finish_reason "tool_calls", as OpenAI's). Only a finished output is read for calls."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = tool_calls(plan, text) if finish == "stop" else (text, [])
    if calls:
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": content}, finish


def final_delta(plan: ToolPlan, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A streamed choice's held text as one delta (its tool calls indexed), and its finish reason."""
    message, finish = assistant_message(plan, text, finish)
    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
    for i, call in enumerate(delta.get("tool_calls", [])):
        call["index"] = i
    return delta, finish


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Validated chat messages as chat templates read them: an assistant's tool calls with
    their arguments as objects, a tool result with the id of the call it answers."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text(i)}
        extra = m.model_extra or {}
        if m.role == "assistant" and extra.get("tool_calls"):
            msg["tool_calls"] = [_template_call(c, i) for c in extra["tool_calls"]]
        if m.role == "tool":
            msg["tool_call_id"] = extra["tool_call_id"]
        out.append(msg)
    return out


def _template_call(call: Any, index: int) -> dict[str, Any]:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise bad_request(f"messages[{index}].tool_calls: each needs a function with a name", "messages")
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise bad_request(f"messages[{index}].tool_calls: arguments must be JSON", "messages") from None
    return {"type": "function", "id": call.get("id"), "function": {"name": f["name"], "arguments": args}}
