"""Grammars of the structured-output tests (plain and speculative decoding) and their request parameters."""

from __future__ import annotations

import json

from specserve.tools.formats import Function, TaggedJsonFormat
from tests.engine.helpers import greedy

# half the lowercase letters and spaces: the tiny target's own argmax is often allowed (drafts land) and often
# not (the mask decides)
REGEX = "[a-m ]{0,40}"
SCHEMA = json.dumps({"type": "object", "properties": {
    "kind": {"enum": ["alpha", "beta", "gamma delta"]}, "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3}},
    "required": ["kind", "name", "tags"], "additionalProperties": False})
# forced tool calls (tool_choice "required"): the <tool_call> format's structural tag of two functions
TOOL_CALLS = json.dumps({"type": "structural_tag", "format": TaggedJsonFormat().grammar([
    Function("pick", {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta"]}}, "required": ["kind"]}),
    Function("noop", {"type": "object", "properties": {}, "additionalProperties": False})], single=False)})
GRAMMARS = {"regex": REGEX, "json_schema": SCHEMA, "structural_tag": TOOL_CALLS}


def constrained(field: str, n: int = 24, **extra) -> dict:
    return greedy(n, **{field: GRAMMARS[field]}, **extra)
