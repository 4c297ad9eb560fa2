"""Structural tags: an output made of literal text and JSON values, as SGLang's ``structural_tag`` takes it.

Two JSON forms are accepted, both SGLang's (and xgrammar's):

- the triggered form: ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``:
  free text, in which each trigger starts one of the structures whose ``begin`` starts with it;
- the format form: ``{"type": "structural_tag", "format": F}``, F built from ``const_string`` (``value``),
  ``json_schema`` (``json_schema``), ``regex`` (``pattern``), ``tag`` (``begin``, ``content``, ``end``),
  ``sequence`` / ``or`` (``elements``), ``tags_with_separator`` (``tags``, ``separator``, ``at_least_one``,
  ``stop_after_first``) and ``triggered_tags`` (``triggers``, ``tags``).

``normalize`` turns either into the format form (what xgrammar compiles); ``to_lark`` turns that into a Lark grammar
for llguidance. Tool calls (specserve/tools/) are built as format-form tags.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from specserve.grammar.spec import GrammarError

FIELD = "structural_tag"
_ELEMENT_KEYS = {
    "const_string": {"value"},
    "json_schema": {"json_schema"},
    "regex": {"pattern"},
    "tag": {"begin", "content", "end"},
    "sequence": {"elements"},
    "or": {"elements"},
    "tags_with_separator": {"tags", "separator"},
    "triggered_tags": {"triggers", "tags"},
}


def _error(message: str) -> GrammarError:
    return GrammarError(FIELD, message)


def normalize(text: str) -> dict:
    """A structural tag's JSON text -> its format form ``{"type": "structural_tag", "format": ...}``, checked."""
    try:
        tag = json.loads(text)
    except ValueError as e:
        raise _error(f"not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise _error("a structural tag is a JSON object")
    if "format" in tag:
        check_format(tag["format"])
        return {"type": "structural_tag", "format": tag["format"]}
    if "structures" not in tag or "triggers" not in tag:
        raise _error('a structural tag needs "format", or "structures" and "triggers"')
    return {"type": "structural_tag", "format": _triggered_format(tag["structures"], tag["triggers"])}


def _triggered_format(structures: Any, triggers: Any) -> dict:
    """The triggered form's structures and triggers as a triggered_tags format."""
    if not isinstance(structures, list) or not structures:
        raise _error('"structures" must be a non-empty list')
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
            raise _error('each structure needs "begin", "schema" and "end"')
        tags.append({"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
                     "end": s["end"]})
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    check_format(fmt)
    return fmt


def check_format(fmt: Any) -> None:
    """Raises GrammarError unless fmt is a format element (recursively) of the kinds this module knows."""
    if not isinstance(fmt, dict) or fmt.get("type") not in _ELEMENT_KEYS:
        raise _error(f"unknown format element {fmt!r:.80}; expected one of {', '.join(_ELEMENT_KEYS)}")
    kind = fmt["type"]
    missing = _ELEMENT_KEYS[kind] - fmt.keys()
    if missing:
        raise _error(f"a {kind} element needs {', '.join(sorted(missing))}")
    if kind == "const_string" and not isinstance(fmt["value"], str):
        raise _error("const_string's value must be a string")
    if kind == "json_schema" and not isinstance(fmt["json_schema"], (dict, bool)):
        raise _error("json_schema's json_schema must be a JSON schema object")
    if kind == "regex" and not isinstance(fmt["pattern"], str):
        raise _error("regex's pattern must be a string")
    if kind == "tag":
        _check_strings(fmt["begin"], "tag's begin")
        for end in _ends(fmt):
            _check_strings(end, "tag's end")
        check_format(fmt["content"])
    if kind in ("sequence", "or"):
        if not isinstance(fmt["elements"], list) or not fmt["elements"]:
            raise _error(f"{kind}'s elements must be a non-empty list")
        for element in fmt["elements"]:
            check_format(element)
    if kind in ("tags_with_separator", "triggered_tags"):
        if not isinstance(fmt["tags"], list) or not fmt["tags"]:
            raise _error(f"{kind}'s tags must be a non-empty list")
        for tag in fmt["tags"]:
            if not isinstance(tag, dict) or tag.get("type", "tag") != "tag":
                raise _error(f"{kind}'s tags must be tag elements")
            check_format({**tag, "type": "tag"})
    if kind == "tags_with_separator":
        _check_strings(fmt["separator"], "tags_with_separator's separator")
    if kind == "triggered_tags":
        _check_triggers(fmt)


def _ends(tag: dict) -> list:
    """A tag's end strings (its ``end`` is one, or a list of alternatives)."""
    return tag["end"] if isinstance(tag["end"], list) else [tag["end"]]


def _guided(schema: dict | bool, json_options: dict) -> dict:
    """A tag's JSON schema with llguidance's JSON options in it (``x-guidance``)."""
    if schema is False:
        raise _error("the json_schema false matches nothing")
    return {**({} if schema is True else schema), "x-guidance": json_options}


def _check_strings(value: Any, what: str) -> None:
    if not isinstance(value, str):
        raise _error(f"{what} must be a string")


def _check_triggers(fmt: dict) -> None:
    triggers = fmt["triggers"]
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise _error("triggered_tags' triggers must be a non-empty list of non-empty strings")
    for tag in fmt["tags"]:
        if not any(tag["begin"].startswith(t) for t in triggers):
            raise _error(f"the tag begin {tag['begin']!r} starts with none of the triggers")
    if fmt.get("at_least_one") or fmt.get("stop_after_first"):
        raise _error("triggered_tags' at_least_one and stop_after_first are not supported; use "
                     "tags_with_separator for tags without free text")


# ---------------------------------------------------------------------------------------------- llguidance
class _Lark:
    """Builds a Lark grammar (llguidance's dialect) of a format element, one rule per element."""

    def __init__(self, json_options: dict) -> None:
        self.json_options = json_options  # llguidance's x-guidance options of every JSON schema
        self.rules: list[str] = []

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def element(self, fmt: dict) -> str:
        """-> the Lark expression of fmt."""
        return getattr(self, "_" + fmt["type"])(fmt)

    def _const_string(self, fmt: dict) -> str:
        return json.dumps(fmt["value"]) if fmt["value"] else '""'

    def _json_schema(self, fmt: dict) -> str:
        return self.rule("%json " + json.dumps(_guided(fmt["json_schema"], self.json_options)))

    def _regex(self, fmt: dict) -> str:
        return self.rule("/" + fmt["pattern"].replace("/", "\\/") + "/")

    def _tag(self, fmt: dict) -> str:
        ends = _ends(fmt)
        end = "(" + " | ".join(json.dumps(e) for e in ends) + ")" if any(ends) else ""
        return self.rule(" ".join(x for x in (_lit(fmt["begin"]), self.element(fmt["content"]), end) if x))

    def _sequence(self, fmt: dict) -> str:
        return self.rule(" ".join(self.element(e) for e in fmt["elements"]))

    def _or(self, fmt: dict) -> str:
        return self.rule(" | ".join(self.element(e) for e in fmt["elements"]))

    def _tags_with_separator(self, fmt: dict) -> str:
        one = self.rule(" | ".join(self._tag({**t, "type": "tag"}) for t in fmt["tags"]))
        if fmt.get("stop_after_first"):
            body = one
        else:
            sep = _lit(fmt["separator"])
            body = f"{one} ({sep} {one})*" if sep else f"{one}+"
        return self.rule(body if fmt.get("at_least_one") else f"({body})?")

    def _triggered_tags(self, fmt: dict) -> str:
        # free text with triggers is llguidance's StructTag construction, a whole grammar (see to_lark)
        raise _error("with the llguidance backend, triggered_tags must be the whole format, not a part of it")


def _lit(text: str) -> str:
    return json.dumps(text) if text else ""


def to_lark(fmt: dict, json_options: dict, struct_tag_grammar: Callable[[list], str]) -> str:
    """A format element -> llguidance's Lark grammar text. json_options: llguidance's JSON options (whitespace);
    struct_tag_grammar: llguidance's StructTag.to_grammar, which builds free text with triggered tags (its lazy
    triggers are llguidance's own construction), called with one (trigger, begin, schema, end) per tag."""
    if fmt["type"] == "triggered_tags":
        tags = []
        for t in fmt["tags"]:
            if t["content"].get("type") != "json_schema" or isinstance(t["end"], list):
                raise _error("with the llguidance backend, a triggered tag holds a json_schema and has one end")
            trigger = next(tr for tr in fmt["triggers"] if t["begin"].startswith(tr))
            tags.append((trigger, t["begin"], _guided(t["content"]["json_schema"], json_options), t["end"]))
        return struct_tag_grammar(tags)
    lark = _Lark(json_options)
    top = lark.element(fmt)
    return "\n".join([f"start: {top}", *lark.rules])
