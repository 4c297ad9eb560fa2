"""Tool calling over HTTP with the official openai client (and LangChain): tools in the prompt, tool_choice none /
auto / required / a named function, parallel_tool_calls, streamed tool_calls deltas, tool calls and results in the
history, and the 400s.

The server's model is random and its chat template writes calls in the <tool_call> format (the server finds the
qwen25 parser in it). A random model never calls a tool by itself, so "auto" is shown parsing a call that a regex
makes the model write; "required" and a named function are forced by the tools' grammar, so their arguments validate
against the function's schema whatever the model. The schemas describe finite languages, so every call finishes."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest
import requests

from tests.server.helpers import sse_json

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lima", "Oslo"]}, "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "exact": {"type": "boolean"}},
         "required": ["zone", "exact"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX = 400  # enough for several calls of the longest arguments


def validate(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def create(client, server, **kw):
    kw = {"messages": MESSAGES, "temperature": 0, "max_tokens": MAX, **kw}
    return client.chat.completions.create(model=server.model, tools=TOOLS, **kw)


def test_required_makes_one_call_that_validates(client, server):
    choice = create(client, server, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    validate(choice.message.tool_calls)


def test_required_with_parallel_calls_validates_every_call(client, server):
    r = create(client, server, tool_choice="required", temperature=1.0, seed=3, n=4)
    for choice in r.choices:
        assert choice.message.tool_calls, choice
        validate(choice.message.tool_calls)  # a call cut by max_tokens is never returned as a call


def test_a_named_function_is_the_one_called(client, server):
    choice = create(client, server, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    validate(choice.message.tool_calls)


def test_streamed_calls_equal_the_answers_calls(client, server):
    kw = {"tool_choice": "required", "parallel_tool_calls": False}
    whole = create(client, server, **kw).choices[0].message.tool_calls
    calls, finish = {}, None
    for chunk in create(client, server, stream=True, **kw):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
            call["name"] += delta_call.function.name or ""
            call["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole]


def test_auto_parses_a_call_out_of_the_text(client, server):
    """A regex makes the random model write a call after some text; "auto" returns the text and the call apart."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "exact": true}}\n</tool_call>'
    regex = "Let me look\\.\n" + "".join("\\" + ch if ch in "{}[]().*+?|\\" else ch for ch in call)
    choice = create(client, server, tool_choice="auto", extra_body={"regex": regex}).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_time", {"zone": "CET", "exact": True})]


def test_auto_without_a_call_is_plain_text(client, server):
    choice = create(client, server, max_tokens=8).choices[0]  # tool_choice defaults to auto with tools
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content


def prompt_tokens(client, server, **kw) -> int:
    return client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=1, **kw).usage.prompt_tokens


def test_tools_are_shown_to_the_model_unless_tool_choice_is_none(client, server):
    plain = prompt_tokens(client, server)
    assert prompt_tokens(client, server, tools=TOOLS) > plain
    assert prompt_tokens(client, server, tools=TOOLS, tool_choice="none") == plain


def test_calls_and_results_in_the_history(client, server):
    """The assistant's earlier call and the tool's result go through the template into the prompt."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius", "days": [1]}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 degrees"}]
    r = create(client, server, messages=history, max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    body = {"messages": history, "tools": TOOLS}
    text = requests.post(server.url + "/v1/detokenize", timeout=60, json={
        "tokens": requests.post(server.url + "/v1/tokenize", json=body, timeout=60).json()["tokens"]}).json()["text"]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"' in text and "rain, 4 degrees" in text
    assert r.usage.prompt_tokens == len(requests.post(server.url + "/v1/tokenize", json=body, timeout=60)
                                        .json()["tokens"])


def test_langchain_bind_tools(server):
    from langchain_openai import ChatOpenAI

    class GetTime(pydantic.BaseModel):
        """The time in a zone."""

        zone: str = pydantic.Field(json_schema_extra={"enum": ["UTC", "CET"]})
        exact: bool

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=server.model, temperature=0,
                     max_tokens=MAX, max_retries=0)
    msg = llm.bind_tools([GetTime], tool_choice="GetTime").invoke("What time is it?")
    assert [c["name"] for c in msg.tool_calls] == ["GetTime"]
    GetTime(**msg.tool_calls[0]["args"])


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, server, kw, param):
    body = {"model": server.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert re.split(r"[.[]", e.value.body["param"])[0] == param, e.value.body
    assert client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2).choices  # still serving


def test_streamed_content_and_calls_over_raw_sse(server):
    """The raw stream: the role first, then each call whole in one delta with its index, id, name and arguments."""
    body = {"model": server.model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "stream": True,
            "parallel_tool_calls": False, "temperature": 0, "max_tokens": MAX}
    events = sse_json(requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["type"] == "function"
    assert set(calls[0]) == {"index", "id", "type", "function"}
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS[calls[0]["function"]["name"]])
