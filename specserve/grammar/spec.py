"""GrammarSpec: what a request asks its output to follow, in a backend-independent form."""

from __future__ import annotations

import json
from dataclasses import dataclass

#: SGLang's json_schema value for "any JSON value" (its xgrammar backend's builtin JSON grammar)
ANY_JSON = "$$ANY$$"
KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarError(ValueError):
    """An invalid grammar: ``field`` is the request field that held it; the message is the parser's."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    text: str  # the JSON schema as JSON text (or ANY_JSON), the regex, the GBNF grammar, or the structural tag's
    # format form as JSON text (grammar/structural.py)

    @property
    def key(self) -> tuple[str, str]:
        """What compiled grammars are cached by."""
        return self.kind, self.text

    @classmethod
    def from_field(cls, field: str, text: str) -> GrammarSpec:
        """The spec of a SamplingParams grammar field; a json_schema is checked to be JSON here (the backend
        checks the rest), and put in one compact text so equal schemas share a cache entry."""
        if field not in KINDS:
            raise GrammarError(field, f"unknown grammar kind; expected one of {', '.join(KINDS)}")
        if field == "json_schema" and text != ANY_JSON:
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise GrammarError(field, f"not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(field, f"a JSON schema is an object (or a boolean), got {type(schema).__name__}")
            text = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output's order
        if field == "structural_tag":
            from specserve.grammar.structural import normalize

            text = json.dumps(normalize(text), separators=(",", ":"))
        return cls(field, text)
