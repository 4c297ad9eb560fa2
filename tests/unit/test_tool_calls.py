"""Tool calling's pure parts, on hand-written outputs: each format's parser, the stream splitter (fed whole and
character by character), structural tags (both forms, errors), and each format's grammar on the real grammar engines:
it takes the format's own canonical calls and refuses arguments that break the function's schema."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from specserve.demo_models import demo_path
from specserve.grammar import GrammarError, GrammarSpec, make_grammar_backend
from specserve.grammar.structural import normalize, to_lark
from specserve.tools.formats import (
    Function,
    Llama3Format,
    MistralFormat,
    ParsedCall,
    TaggedJsonFormat,
    detect_parser,
    tool_call_format,
)
from specserve.tools.stream import ToolCallStream

WEATHER = Function("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                                   "unit": {"enum": ["c", "f"]}},
                                   "required": ["city", "unit"], "additionalProperties": False})
NOOP = Function("noop", {"type": "object", "properties": {}, "additionalProperties": False})
PARIS = ParsedCall("get_weather", '{"city": "Paris", "unit": "c"}')

# (format, output, content, calls): outputs as each family's models write them
CASES = [
    (TaggedJsonFormat(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "c"}}\n</tool_call>', "Let me check.\n", [PARIS]),
    (TaggedJsonFormat(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>', "",
     [PARIS, ParsedCall("noop", "{}")]),
    (TaggedJsonFormat(), '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": '
     '\\"c\\"}"}</tool_call>', "", [PARIS]),  # arguments as a JSON string, no newlines (Hermes)
    (TaggedJsonFormat(), "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    (TaggedJsonFormat(), "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (TaggedJsonFormat(), '<tool_call>\n{"name": "noop", "argu', '<tool_call>\n{"name": "noop", "argu', []),  # cut
    (Llama3Format(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', "",
     [PARIS]),
    (Llama3Format(), ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
     '{"name": "noop", "parameters": {}}', "", [PARIS, ParsedCall("noop", "{}")]),
    (Llama3Format(), '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not calls: text
    (Llama3Format(), "The answer is {x}.", "The answer is {x}.", []),
    (MistralFormat(), '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', "",
     [PARIS]),
    (MistralFormat(), '[{"name": "noop", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "c"}}]', "", [ParsedCall("noop", "{}"), PARIS]),  # the control token skipped as special
    (MistralFormat(), "[1, 2]", "[1, 2]", []),
]


@pytest.mark.parametrize("fmt, output, content, calls", CASES)
def test_a_whole_output_splits_into_content_and_calls(fmt, output, content, calls):
    assert ToolCallStream(fmt).feed(output, final=True) == (content, calls)


@pytest.mark.parametrize("fmt, output, content, calls", CASES)
def test_streamed_character_by_character_gives_the_same(fmt, output, content, calls):
    stream, got_content, got_calls = ToolCallStream(fmt), [], []
    for ch in output:
        text, new = stream.feed(ch)
        got_content.append(text)
        got_calls += new
    text, new = stream.feed("", final=True)
    assert ("".join(got_content) + text, got_calls + new) == (content, calls)


def test_a_stream_holds_back_only_what_may_start_a_call():
    stream = ToolCallStream(TaggedJsonFormat())
    assert stream.feed("Sure <tool") == ("Sure ", [])  # "<tool" may begin "<tool_call>"
    assert stream.feed("s are fun") == ("<tools are fun", [])
    assert stream.feed('<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n') == (
        "", [ParsedCall("noop", "{}")])
    assert stream.feed("\n", final=True) == ("", [])  # whitespace after a call is the separator, not content


def test_detect_parser_from_the_chat_template():
    assert detect_parser("...<tool_call>...") == "qwen25"
    assert detect_parser("{{ '<|python_tag|>' }}") == "llama3"
    assert detect_parser("[TOOL_CALLS]") == "mistral"
    assert detect_parser("{% for m in messages %}{% endfor %}") is None and detect_parser(None) is None
    with open(demo_path("demo") + "/chat_template.jinja") as f:
        assert detect_parser(f.read()) == "qwen25"  # the demo calls tools in the <tool_call> format


# ---------------------------------------------------------------------------------------------- structural tags
def test_the_triggered_form_normalizes_to_triggered_tags():
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}
    assert normalize(json.dumps(legacy)) == {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f="],
        "tags": [{"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema",
                                                               "json_schema": {"type": "object"}}, "end": "</f>"}]}}


@pytest.mark.parametrize("tag, message", [
    ("[1]", "a structural tag is a JSON object"),
    ('{"type": "structural_tag"}', 'needs "format", or "structures" and "triggers"'),
    ('{"format": {"type": "blob"}}', "unknown format element"),
    ('{"format": {"type": "tag", "begin": "<a>", "end": "</a>"}}', "a tag element needs content"),
    ('{"format": {"type": "sequence", "elements": []}}', "elements must be a non-empty list"),
    ('{"structures": [{"begin": "<b>", "schema": {}, "end": ""}], "triggers": ["<a"]}', "starts with none of"),
])
def test_invalid_structural_tags_raise_naming_the_field(tag, message):
    with pytest.raises(GrammarError, match=message) as e:
        GrammarSpec.from_field("structural_tag", tag)
    assert e.value.field == "structural_tag"


def test_to_lark_writes_one_rule_per_element():
    fmt = {"type": "sequence", "elements": [{"type": "const_string", "value": "["},
                                            {"type": "regex", "pattern": "[0-9]+/s"}]}
    assert to_lark(fmt, {}, None).splitlines() == ["start: r1", "r0: /[0-9]+\\/s/", 'r1: "[" r0']


# ---------------------------------------------------------------------------------------------- grammars on engines
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_path("demo"))


@pytest.fixture(params=["llguidance", "xgrammar"], scope="module")
def backend(request, tokenizer):
    return make_grammar_backend(request.param, tokenizer, len(tokenizer), any_whitespace=False)


def takes(backend, tokenizer, grammar: dict, text: str) -> tuple[bool, bool]:
    """(whether the grammar takes text token by token, whether it may end there)."""
    m = backend.matcher(backend.compile(GrammarSpec.from_field("structural_tag", json.dumps({"format": grammar}))))
    ok = all(m.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok, ok and m.accepting()


def canonical(fmt, calls: list[tuple[str, dict]]) -> str:
    """The calls as the format's grammar writes them."""
    if isinstance(fmt, TaggedJsonFormat):
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>'
                         for n, a in calls)
    if isinstance(fmt, Llama3Format):
        return "; ".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}' for n, a in calls)
    return "[" + ", ".join(f'{{"name": "{n}", "arguments": {json.dumps(a)}}}' for n, a in calls) + "]"


@pytest.mark.parametrize("parser", ["qwen25", "llama3", "mistral"])
def test_a_formats_grammar_takes_its_calls_and_their_parse_round_trips(backend, tokenizer, parser):
    fmt = tool_call_format(parser)
    calls = [("get_weather", {"city": "Paris", "unit": "c"}), ("noop", {})]
    text = canonical(fmt, calls)
    assert takes(backend, tokenizer, fmt.grammar([WEATHER, NOOP], single=False), text) == (True, True)
    parsed = ToolCallStream(fmt).feed(text, final=True)[1]
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls


@pytest.mark.parametrize("parser", ["qwen25", "llama3", "mistral"])
def test_a_formats_grammar_refuses_what_breaks_the_schema(backend, tokenizer, parser):
    fmt = tool_call_format(parser)
    grammar = fmt.grammar([WEATHER, NOOP], single=False)
    assert not takes(backend, tokenizer, grammar, canonical(fmt, [("get_weather", {"city": "Paris", "unit": "k"})]))[0]
    assert not takes(backend, tokenizer, grammar, canonical(fmt, [("get_time", {})]))[0]  # no such function
    assert takes(backend, tokenizer, grammar, "") == (True, False)  # at least one call
    single = fmt.grammar([WEATHER, NOOP], single=True)
    two = canonical(fmt, [("noop", {}), ("noop", {})])
    assert takes(backend, tokenizer, single, canonical(fmt, [("noop", {})])) == (True, True)
    assert not takes(backend, tokenizer, single, two)[0]  # parallel_tool_calls false: one call


def test_llguidance_refuses_triggered_tags_inside_another_element(tokenizer):
    """Free text with triggers is a whole grammar in llguidance: nested, it is a GrammarError (a 400), not a crash."""
    backend = make_grammar_backend("llguidance", tokenizer, len(tokenizer))
    triggered = {"type": "triggered_tags", "triggers": ["<f="], "tags": [
        {"type": "tag", "begin": "<f=noop>", "content": {"type": "json_schema", "json_schema": True}, "end": "</f>"}]}
    nested = {"type": "sequence", "elements": [{"type": "const_string", "value": "go "}, triggered]}
    with pytest.raises(GrammarError, match="triggered_tags must be the whole format") as e:
        backend.compile(GrammarSpec.from_field("structural_tag", json.dumps({"format": nested})))
    assert e.value.field == "structural_tag"


def test_triggered_tags_allow_free_text_until_a_trigger(backend, tokenizer):
    grammar = {"type": "triggered_tags", "triggers": ["<f="], "tags": [
        {"type": "tag", "begin": "<f=noop>", "content": {"type": "json_schema", "json_schema": NOOP.parameters},
         "end": "</f>"}]}
    assert takes(backend, tokenizer, grammar, "any text at all <f=noop>{}</f> and more") == (True, True)
    assert not takes(backend, tokenizer, grammar, 'text <f=noop>{"x": 1}</f>')[0]
