"""Tool-call formats: how a model family writes function calls, the grammar that makes it write them, and the parser
that reads them back.

Each format is named as SGLang's ``--tool-call-parser`` names it:

- ``qwen25`` / ``qwen`` / ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per
  call, blocks separated by a newline, text around them allowed (Qwen2.5, Qwen3, Hermes, the bundled demo);
- ``llama3``: the output is ``{"name": "f", "parameters": {...}}`` calls separated by ``;``, optionally after
  ``<|python_tag|>`` (Llama 3.1-3.3's JSON tool calling);
- ``mistral``: ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` (the control token is optional).

A format's grammar is a structural tag in format form (grammar/structural.py): the calls only, at least one, with each
function's ``parameters`` schema inside its call, so a forced call always parses against its function.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass

ANY_OBJECT = {"type": "object"}  # the arguments of a function declared without parameters


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class Function:
    """A declared function: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict | bool


def _call(obj: object, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """A parsed call object {"name": ..., <args key>: {...}} -> ParsedCall, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separator: str) -> list | None:
    """The JSON values of text, separated by `separator` (and whitespace); None unless all of it is such values."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return values or None
        if values:
            if not text.startswith(separator, i):
                return None
            i += len(separator)
            while i < len(text) and text[i].isspace():
                i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _call_tag(f: Function, begin: str, end: str) -> dict:
    """The structural tag element of one call of f: begin, its arguments (a JSON value of f's schema), end."""
    return {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": f.parameters}, "end": end}


def _calls(tags: list[dict], separator: str, single: bool) -> dict:
    """One or more of the tags (exactly one when single) separated by separator, and nothing else."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": single}


def _held_prefix(text: str, marker: str) -> int:
    """Characters at the end of text that may be the start of marker (held back from a stream until known)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallFormat(ABC):
    """A model family's tool-call syntax. The parser reads calls out of regions: a region starts where find_start
    says and ends where find_end says (or at the end of the output); parse_region -> its calls, or None when the
    region is not calls after all (it is then text)."""

    args_keys: tuple[str, ...] = ("arguments", "parameters")

    # -- grammar
    @abstractmethod
    def grammar(self, functions: list[Function], single: bool) -> dict:
        """The structural tag (format form) of one or more calls of these functions (single: exactly one)."""

    # -- parsing
    @abstractmethod
    def find_start(self, text: str, at_output_start: bool) -> int | None:
        """Where a call region starts in text (None: nowhere yet). at_output_start: text is the output's start."""

    @abstractmethod
    def held(self, text: str, at_output_start: bool) -> int:
        """How many characters at text's end could still become a region's start (a stream holds them back)."""

    @abstractmethod
    def find_end(self, region: str) -> int | None:
        """Where the region that starts region ends (its length), or None while it may go on."""

    @abstractmethod
    def parse_region(self, region: str) -> list[ParsedCall] | None:
        """The calls of a whole region, or None when it is not calls."""


class TaggedJsonFormat(ToolCallFormat):
    """Calls in begin/end markers around a JSON object {"name": ..., "arguments": ...}: Qwen2.5 and Hermes."""

    begin, end, separator = "<tool_call>", "</tool_call>", "\n"

    def grammar(self, functions: list[Function], single: bool) -> dict:
        tags = [_call_tag(f, f'{self.begin}\n{{"name": {json.dumps(f.name)}, "arguments": ', f"}}\n{self.end}")
                for f in functions]
        return _calls(tags, self.separator, single)

    def find_start(self, text: str, at_output_start: bool) -> int | None:
        i = text.find(self.begin)
        return None if i < 0 else i

    def held(self, text: str, at_output_start: bool) -> int:
        return _held_prefix(text, self.begin)

    def find_end(self, region: str) -> int | None:
        i = region.find(self.end)
        return None if i < 0 else i + len(self.end)

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        inner = region[len(self.begin):]
        inner = inner[:-len(self.end)] if inner.endswith(self.end) else inner
        values = _json_values(inner, self.separator)
        calls = [_call(v, self.args_keys) for v in values or []]
        return calls if len(calls) == 1 and calls[0] is not None else None


class LeadingJsonFormat(ToolCallFormat):
    """Calls as JSON that makes up the whole output, after an optional control token: Llama 3, Mistral."""

    marker: str  # the control token that may precede the calls
    opening: str  # the JSON's first character
    name_key: str  # "parameters" or "arguments" (what the grammar writes)

    def find_start(self, text: str, at_output_start: bool) -> int | None:
        i = text.find(self.marker)
        if i >= 0:
            return i
        return 0 if at_output_start and text.lstrip().startswith(self.opening) else None

    def held(self, text: str, at_output_start: bool) -> int:
        body = text.lstrip()
        if at_output_start and (not body or self.marker.startswith(body)):
            return len(text)  # whitespace, or the start of the marker: what follows decides
        return _held_prefix(text, self.marker)

    def find_end(self, region: str) -> int | None:
        return None  # the calls run to the end of the output

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        body = region.strip()
        body = body[len(self.marker):] if body.startswith(self.marker) else body
        values = self.values(body)
        calls = [_call(v, self.args_keys) for v in values or []]
        return calls if calls and all(c is not None for c in calls) else None

    @abstractmethod
    def values(self, body: str) -> list | None:
        """The call objects of the JSON text after the marker."""

    def _tags(self, functions: list[Function]) -> list[dict]:
        return [_call_tag(f, f'{{"name": {json.dumps(f.name)}, "{self.name_key}": ', "}") for f in functions]


class Llama3Format(LeadingJsonFormat):
    marker, opening, name_key, separator = "<|python_tag|>", "{", "parameters", ";"

    def grammar(self, functions: list[Function], single: bool) -> dict:
        return _calls(self._tags(functions), self.separator + " ", single)

    def values(self, body: str) -> list | None:
        return _json_values(body, self.separator)


class MistralFormat(LeadingJsonFormat):
    marker, opening, name_key = "[TOOL_CALLS]", "[", "arguments"

    def grammar(self, functions: list[Function], single: bool) -> dict:
        calls = _calls(self._tags(functions), ", ", single)
        return {"type": "sequence", "elements": [{"type": "const_string", "value": "["}, calls,
                                                 {"type": "const_string", "value": "]"}]}

    def values(self, body: str) -> list | None:
        values = _json_values(body, ",")
        return values[0] if values and len(values) == 1 and isinstance(values[0], list) else None


TOOL_CALL_PARSERS: dict[str, type[ToolCallFormat]] = {
    "qwen25": TaggedJsonFormat, "qwen": TaggedJsonFormat, "hermes": TaggedJsonFormat,
    "llama3": Llama3Format, "mistral": MistralFormat,
}


def tool_call_format(name: str) -> ToolCallFormat:
    return TOOL_CALL_PARSERS[name]()


def detect_parser(chat_template: str | None) -> str | None:
    """The parser whose syntax a chat template writes tool calls in, or None: what the server uses when
    --tool-call-parser is not given."""
    if not chat_template:
        return None
    for marker, name in (("<tool_call>", "qwen25"), ("<|python_tag|>", "llama3"), ("[TOOL_CALLS]", "mistral")):
        if marker in chat_template:
            return name
    return None
