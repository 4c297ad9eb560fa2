"""Structured outputs over HTTP: OpenAI's response_format (json_schema strict, json_object), the official client's
``beta.chat.completions.parse`` with a pydantic model, LangChain's ``with_structured_output``, SGLang's regex / ebnf /
json_schema on both APIs, streamed and not; invalid grammars are 400s naming their field, and a grammar that cannot
finish within max_tokens ends with "length".

The server's model is random, so the schemas here describe finite languages (enums, booleans, bounded arrays and
strings): any output that follows the grammar finishes, and validates."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pydantic
import pytest
import requests

from tests.server.helpers import sse_json

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "confident": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "source": {"type": "object", "properties": {"kind": {"enum": ["web", "book"]}}, "required": ["kind"],
                   "additionalProperties": False},
    },
    "required": ["label", "confident", "tags", "source"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Classify: the tests pass."}]
MAX = 600  # enough for the longest output the schema allows, whitespace included


class Verdict(pydantic.BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confident: bool


def response_format(schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}


def test_response_format_json_schema_validates(client, server):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=0, max_tokens=MAX,
                                       response_format=response_format())
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_sampled_and_n_validate(client, server):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=1.0, seed=7, n=4,
                                       max_tokens=MAX, response_format=response_format())
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({c.message.content for c in r.choices}) > 1  # sampled within the grammar, not one forced answer


def test_response_format_streamed_validates(server):
    body = {"model": server.model, "messages": MESSAGES, "temperature": 0, "max_tokens": MAX, "stream": True,
            "response_format": response_format()}
    events = sse_json(requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object(client, server):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=0, max_tokens=48,
                                       response_format={"type": "json_object"})
    content = r.choices[0].message.content
    assert content.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_the_official_clients_parse_with_a_pydantic_model(client, server):
    r = client.beta.chat.completions.parse(model=server.model, messages=MESSAGES, temperature=0, max_tokens=MAX,
                                           response_format=Verdict)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and parsed.label in ("positive", "negative", "neutral")


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=server.model, temperature=0,
                     max_tokens=MAX, max_retries=0)
    out = llm.with_structured_output(Verdict, method="json_schema").invoke("Classify: the tests pass.")
    assert isinstance(out, Verdict)


@pytest.mark.parametrize("field, value, check", [
    ("regex", r"(yes|no)-[0-9]{3}", lambda text: re.fullmatch(r"(yes|no)-[0-9]{3}", text)),
    ("ebnf", 'root ::= "def " [a-z] [a-z]? "():"', lambda text: re.fullmatch(r"def [a-z][a-z]?\(\):", text)),
    ("json_schema", json.dumps(SCHEMA), lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_generate_follows_sglang_grammar_fields(server, field, value, check, stream):
    body = {"text": "Answer:", "sampling_params": {"temperature": 0, "max_new_tokens": MAX, field: value},
            "stream": stream}
    r = requests.post(server.url + "/generate", json=body, stream=stream, timeout=120)
    assert r.status_code == 200, r.text
    out = sse_json(r)[-1] if stream else r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert check(out["text"]), out["text"]


@pytest.mark.parametrize("field", ["regex", "ebnf"])
def test_completions_take_sglang_grammar_extras(client, server, field):
    value = {"regex": r"[0-9]{4}", "ebnf": 'root ::= "on" | "off"'}[field]
    r = client.completions.create(model=server.model, prompt="x", temperature=0, max_tokens=16,
                                  extra_body={field: value})
    assert re.fullmatch({"regex": r"[0-9]{4}", "ebnf": "on|off"}[field], r.choices[0].text)


@pytest.mark.parametrize("sampling, param, message", [
    ({"json_schema": '{"type": "objectx"}'}, "json_schema", "objectx"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"regex": "a(b"}, "regex", "regex"),
    ({"ebnf": 'root ::= "unterminated'}, "ebnf", "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex", "only one of"),
])
def test_invalid_grammars_are_400_naming_the_field(server, sampling, param, message):
    r = requests.post(server.url + "/generate", json={"text": "x", "sampling_params": sampling}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_response_format_structural_tag_both_forms(client, server):
    """SGLang's structural_tag: the format form (here: a tag around a JSON value) and the triggered form (free text
    in which the trigger starts a structure)."""
    tag = {"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": SCHEMA},
           "end": "</answer>"}
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=0, max_tokens=MAX,
                                       response_format={"type": "structural_tag", "format": tag})
    text = r.choices[0].message.content
    assert text.startswith("<answer>") and text.endswith("</answer>") and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text.removeprefix("<answer>").removesuffix("</answer>")), SCHEMA)
    triggered = {"type": "structural_tag", "triggers": ["<answer>"],
                 "structures": [{"begin": "<answer>", "schema": SCHEMA, "end": "</answer>"}]}
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=1.0, seed=5, n=4,
                                       max_tokens=64, response_format=triggered)
    assert len({c.message.content for c in r.choices}) > 1  # free text, sampled
    for choice in r.choices:
        for body in re.findall("<answer>(.*?)</answer>", choice.message.content, re.S):
            jsonschema.validate(json.loads(body), SCHEMA)


@pytest.mark.parametrize("fmt, message", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
    ({"type": "structural_tag"}, "structural_tag"),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>"}}, "needs content"),
    ({"type": "yaml"}, "response_format"),
])
def test_bad_response_formats_are_400(server, fmt, message):
    body = {"model": server.model, "messages": MESSAGES, "response_format": fmt}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_a_grammar_that_cannot_finish_in_time_ends_with_length(client, server):
    r = client.completions.create(model=server.model, prompt="x", temperature=0, max_tokens=5,
                                  extra_body={"regex": "a{50}"})
    assert r.choices[0].finish_reason == "length" and re.fullmatch("a*", r.choices[0].text)


def test_the_server_reports_grammar_compiles_and_mask_time(client, server):
    client.completions.create(model=server.model, prompt="x", temperature=0, max_tokens=8,
                              extra_body={"regex": "[0-9]{8}"})
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    assert info["grammar_compiles"] >= 1 and info["grammar_compile_seconds"] > 0
    assert info["grammar_compile_seconds_max"] <= info["grammar_compile_seconds"]
    assert info["grammar_mask_calls"] >= 8 and info["grammar_mask_seconds"] > 0  # a mask for each of 8 tokens
    metrics = requests.get(server.url + "/metrics", timeout=30).text
    assert "specserve:grammar_mask_seconds " in metrics and "specserve:grammar_compiles " in metrics
