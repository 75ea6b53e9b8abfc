"""The sampling fields OpenAI and vLLM clients send, through the official `openai` client against
a live speculative server (ngram), streamed and not: n, a list of prompts, logprobs and
top_logprobs, penalties, logit_bias, min_p, min_tokens, stop_token_ids, allowed_token_ids, echo,
response_format (JSON schema, JSON object) and structured_outputs (choice, regex, grammar).
Greedy outputs and logprobs are compared with plain decoding of the same model (`LLM`)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from specdecode import LLM, SamplingParams
from tests.entrypoints.server_helpers import ServerThread, make_app

PROMPT = "abc abc abc"


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def plain(ckpt):
    return LLM(model=ckpt, dtype="float32", device="cpu", max_model_len=256, speculative_config=None)


def streamed_completion(client, **kw) -> dict[int, dict]:
    """Per choice index: its text, finish reason and logprobs, from a streamed /v1/completions."""
    out: dict[int, dict] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got = out.setdefault(c.index, {"text": "", "finish": None, "tokens": [], "token_logprobs": []})
            got["text"] += c.text
            got["finish"] = c.finish_reason or got["finish"]
            if c.logprobs is not None:
                got["tokens"] += c.logprobs.tokens
                got["token_logprobs"] += c.logprobs.token_logprobs
    return out


FEATURES = {
    "penalties": (dict(presence_penalty=0.8, frequency_penalty=0.5), dict(repetition_penalty=1.3)),
    "logit_bias": (dict(logit_bias={"5": 4, "9": -100}), {}),
    "min_tokens and stop_token_ids": ({}, dict(min_tokens=6, stop_token_ids=[7, 11])),
    "allowed_token_ids and min_p": ({}, dict(allowed_token_ids=list(range(0, 120, 2)), min_p=0.3)),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_greedy_features_equal_plain_decoding(client, plain, name):
    native, extra = FEATURES[name]
    sp = dict(native, **extra)
    if "logit_bias" in sp:
        sp["logit_bias"] = {int(k): v for k, v in sp["logit_bias"].items()}
    want = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, **sp), speculative=False)[0]
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, **native)
    got = client.completions.create(extra_body=extra, **kw)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    assert streamed_completion(client, extra_body=extra, **kw)[0]["text"] == want.text


def test_logprobs_are_plain_decodings(client, plain):
    want = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, logprobs=3), speculative=False)[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.logprobs) == 10
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-5)
    for top, x in zip(lp.top_logprobs, want.logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(x.logprob, abs=1e-5)  # greedy: the likeliest
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = streamed_completion(client, model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)[0]
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-6)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs(client, stream):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "abc abc"}], max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=2)  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**kw)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
        text = r.choices[0].message.content
    else:
        content, text = [], ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.delta.content or ""
                content += c.logprobs.content if c.logprobs is not None else []
        assert len(content) == 8
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert text.startswith("".join(e.token for e in content).rstrip("\ufffd")[: len(text)])


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_and_a_list_of_prompts(client, plain, stream):
    kw = dict(model="tiny", prompt=[PROMPT, "xyz xyz"], n=3, max_tokens=8, temperature=1.5, seed=5,
              extra_body={"ignore_eos": True})  # fmt: skip
    if stream:
        texts = {i: c["text"] for i, c in streamed_completion(client, **kw).items()}
    else:
        r = client.completions.create(**kw)
        texts = {c.index: c.text for c in r.choices}
        assert r.usage.completion_tokens == 6 * 8  # every sample counted
        assert r.usage.prompt_tokens == len(plain.tokenize(PROMPT)) + len(plain.tokenize("xyz xyz"))  # each prompt once
    assert sorted(texts) == list(range(6))
    again = client.completions.create(**kw)
    assert {c.index: c.text for c in again.choices} == texts  # seeded: reproducible, streamed or not
    one = client.completions.create(**{**kw, "prompt": "xyz xyz", "n": 1})
    assert one.choices[0].text == texts[3]  # sample 0 of prompt 1 is the n = 1 request with the seed
    assert len(set(texts.values())) > 2  # the samples differ


def test_echo_prepends_the_prompt(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == PROMPT + plain.choices[0].text


@pytest.mark.parametrize(
    "kw,param",
    [(dict(n=17), "n"), (dict(logprobs=21), "logprobs"), (dict(logit_bias={"999999": 1}), "logit_bias"),
     (dict(presence_penalty=-2.5), "presence_penalty"), (dict(extra_body={"repetition_penalty": -1}), "repetition_penalty"),
     (dict(extra_body={"min_tokens": 50}), "min_tokens")],
)  # fmt: skip
def test_bad_values_are_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, **kw)
    assert err.value.body["param"] == param and "\n" not in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_logprobs=21,
                                       logprobs=True)  # fmt: skip
    assert err.value.body["param"] == "top_logprobs"


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
          "tag": {"enum": ["ab", "c"]}}, "required": ["n", "tag"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # fmt: skip (llguidance's option: compact JSON)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_json_object_outputs(client, stream):
    formats = [{"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}, {"type": "json_object"}]
    for fmt in formats:
        kw = dict(model="tiny", messages=[{"role": "user", "content": "a thing"}], max_tokens=60, temperature=0.7,
                  seed=3, response_format=fmt)  # fmt: skip
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)  # fmt: skip
        else:
            r = client.chat.completions.create(**kw)
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop" or fmt["type"] == "json_object"
        if fmt["type"] == "json_schema":  # bounded: always complete
            jsonschema.validate(json.loads(text), SCHEMA)
        else:  # any object: a random model may still be writing it at max_tokens
            assert text.startswith("{")


def test_structured_outputs_choice_regex_and_legacy_guided(client):
    choice = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})  # fmt: skip
    assert choice.choices[0].text in ("yes", "no", "maybe")
    regex = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"})  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", regex.choices[0].text)


@pytest.mark.parametrize(
    "extra,param",
    [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                                           "maximum": 1}}}}, "response_format"),
     ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
     ({"structured_outputs": {"choice": []}}, "structured_outputs"),
     ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
     ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
     ({"guided_json": "{not json"}, "guided_json"),
     ({"guided_regex": "a+", "structured_outputs": {"choice": ["a"]}}, "guided_regex"),
     ({"response_format": {"type": "xml"}}, "response_format")],
)  # fmt: skip
def test_bad_constraints_are_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param and "\n" not in err.value.body["message"], err.value.body
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices  # still serving


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False,
                          "x-guidance": {"whitespace_flexible": False}}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}  # fmt: skip


@pytest.fixture(scope="module")
def tool_client(target):
    import copy

    tok = copy.deepcopy(target.tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    with ServerThread(make_app(target, tokenizer=tok)) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            yield c


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_call_parses_and_validates(tool_client, stream, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]  # fmt: skip
    kw = dict(model="tiny", messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=60,
              temperature=1.0, seed=4)  # fmt: skip
    if stream:
        calls, finish = [], None
        for chunk in tool_client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
        name, arguments = calls[0].function.name, calls[0].function.arguments
    else:
        r = tool_client.chat.completions.create(**kw)
        finish, msg = r.choices[0].finish_reason, r.choices[0].message
        assert msg.content is None and len(msg.tool_calls) == 1 and msg.tool_calls[0].id.startswith("call_")
        name, arguments = msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments
    assert finish == "tool_calls"
    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])
    assert name == "get_weather" or choice == "required"


def test_hermes_tool_calls_under_auto_are_parsed():
    from specdecode.entrypoints.tools import ToolPlan, tool_calls

    text = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>'
    content, calls = tool_calls(ToolPlan([WEATHER]), text)
    assert content == "Let me look." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "days": 2}
    assert tool_calls(ToolPlan([WEATHER]), "no call here") == ("no call here", [])


@pytest.mark.parametrize(
    "kw,param",
    [(dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
     (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
     (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format")],
)  # fmt: skip
def test_bad_tools_are_a_400(tool_client, client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        tool_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **kw)
    assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:  # the plain tiny template shows no tools
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert err.value.body["param"] == "tools"


def test_echo_with_logprobs_scores_the_prompt(client, plain):
    """lm-eval-harness's loglikelihood request: echo, logprobs, one token."""
    want = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), speculative=False)[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    n = len(want.prompt_token_ids)
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([x.logprob for x in want.prompt_logprobs[1:]], abs=1e-5)
    assert "".join(lp.tokens[:n]) == PROMPT and lp.text_offset[n] == len(PROMPT)
    vllm = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = vllm.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == n
    for entry, x in zip(plp[1:], want.prompt_logprobs[1:]):
        assert entry[str(x.token_id)]["logprob"] == pytest.approx(x.logprob, abs=1e-5) and len(entry) <= 3
