"""A JSON-schema extraction workload: schemas with nested objects, enums and arrays, a prompt asking for each, and one
valid instance of each (the grammar benchmarks walk it token by token; tests validate it against its schema).

Used by ``benchmarks/bench_grammar.py`` (grammar engines: compile and mask costs), ``benchmarks/bench_structured.py``
(constrained decoding end to end) and the grammar tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict
    prompt: str  # what a user asks for
    example: dict  # one valid instance


def _obj(props: dict, required: list[str] | None = None) -> dict:
    """A closed object schema: every property required unless listed otherwise."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _arr(items: dict, **kw) -> dict:
    return {"type": "array", "items": items, **kw}


def _enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


SCHEMA_CASES: list[SchemaCase] = [
    SchemaCase("person", _obj({"name": STR, "age": INT, "email": STR}),
               "Extract the person: Ada Lovelace, 36, ada@example.org.",
               {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    SchemaCase("address", _obj({"street": STR, "city": STR, "zip": STR, "country": _enum("UK", "FR", "DE", "US")}),
               "Give the address of 10 Downing Street, London SW1A 2AA as JSON.",
               {"street": "10 Downing Street", "city": "London", "zip": "SW1A 2AA", "country": "UK"}),
    SchemaCase("function_signature",
               _obj({"name": STR, "args": _arr(_obj({"name": STR, "type": _enum("int", "str", "float", "list")})),
                     "returns": _enum("int", "str", "float", "list", "None")}),
               "Describe the signature of def merge(a: list, b: list) -> list.",
               {"name": "merge", "args": [{"name": "a", "type": "list"}, {"name": "b", "type": "list"}],
                "returns": "list"}),
    SchemaCase("sentiment", _obj({"label": _enum("positive", "negative", "neutral"), "score": NUM}),
               "Classify: 'The tests pass and the code is clean.'", {"label": "positive", "score": 0.93}),
    SchemaCase("todo", _obj({"title": STR, "done": BOOL, "priority": _enum("low", "medium", "high")}),
               "Make a todo item to fix the flaky test, high priority.",
               {"title": "fix the flaky test", "done": False, "priority": "high"}),
    SchemaCase("git_commit", _obj({"type": _enum("feat", "fix", "docs", "refactor", "test"), "scope": STR,
                                   "subject": STR, "breaking": BOOL}),
               "Write a commit message for a fix in the parser.",
               {"type": "fix", "scope": "parser", "subject": "handle empty input", "breaking": False}),
    SchemaCase("http_request", _obj({"method": _enum("GET", "POST", "PUT", "DELETE"), "path": STR,
                                     "headers": _arr(_obj({"name": STR, "value": STR})), "body": STR},
                                    ["method", "path", "headers"]),
               "Describe a request that lists the users.",
               {"method": "GET", "path": "/users", "headers": [{"name": "Accept", "value": "application/json"}]}),
    SchemaCase("book", _obj({"title": STR, "authors": _arr(STR, minItems=1), "year": INT,
                             "genres": _arr(_enum("fiction", "science", "history", "poetry"))}),
               "Catalogue 'Structure and Interpretation of Computer Programs'.",
               {"title": "Structure and Interpretation of Computer Programs", "authors": ["Abelson", "Sussman"],
                "year": 1985, "genres": ["science"]}),
    SchemaCase("weather", _obj({"city": STR, "temperature_c": NUM, "conditions": _enum("sunny", "cloudy", "rain",
                                                                                        "snow")}),
               "What is the weather in Paris? (18.5 C, cloudy)",
               {"city": "Paris", "temperature_c": 18.5, "conditions": "cloudy"}),
    SchemaCase("recipe", _obj({"name": STR, "servings": INT,
                               "ingredients": _arr(_obj({"item": STR, "grams": INT})), "steps": _arr(STR)}),
               "A recipe for pancakes.",
               {"name": "pancakes", "servings": 4, "ingredients": [{"item": "flour", "grams": 200},
                                                                   {"item": "milk", "grams": 300}],
                "steps": ["mix", "rest", "fry"]}),
    SchemaCase("bug_report", _obj({"title": STR, "severity": _enum("minor", "major", "critical"),
                                   "component": STR, "steps_to_reproduce": _arr(STR), "regression": BOOL}),
               "File a bug: the server crashes on empty prompts.",
               {"title": "crash on empty prompt", "severity": "critical", "component": "server",
                "steps_to_reproduce": ["start the server", "send an empty prompt"], "regression": True}),
    SchemaCase("calendar_event", _obj({"title": STR, "date": STR, "attendees": _arr(_obj({"name": STR,
                                                                                          "optional": BOOL}))}),
               "Schedule a design review on 2026-12-01 with Ann and Bo (optional).",
               {"title": "design review", "date": "2026-12-01",
                "attendees": [{"name": "Ann", "optional": False}, {"name": "Bo", "optional": True}]}),
    SchemaCase("product", _obj({"sku": STR, "price": NUM, "currency": _enum("EUR", "USD", "GBP"), "in_stock": BOOL,
                                "dimensions": _obj({"w": NUM, "h": NUM, "d": NUM})}),
               "Describe the product A-113, 19.99 EUR, in stock, 10x20x5 cm.",
               {"sku": "A-113", "price": 19.99, "currency": "EUR", "in_stock": True,
                "dimensions": {"w": 10, "h": 20, "d": 5}}),
    SchemaCase("tool_call", _obj({"name": _enum("search", "calculator", "weather"),
                                  "arguments": _obj({"query": STR}, [])}),
               "Call a tool to search for the capital of France.",
               {"name": "search", "arguments": {"query": "capital of France"}}),
    SchemaCase("math_answer", _obj({"steps": _arr(_obj({"explanation": STR, "output": STR})), "final_answer": STR}),
               "Solve 8x + 7 = -23 step by step.",
               {"steps": [{"explanation": "subtract 7", "output": "8x = -30"},
                          {"explanation": "divide by 8", "output": "x = -3.75"}], "final_answer": "x = -3.75"}),
    SchemaCase("dependency", _obj({"package": STR, "version": STR, "extras": _arr(STR),
                                   "source": _enum("pypi", "git", "local")}),
               "Describe the dependency torch==2.13.0 from PyPI.",
               {"package": "torch", "version": "2.13.0", "extras": [], "source": "pypi"}),
    SchemaCase("country", _obj({"name": STR, "capital": STR, "population_millions": NUM,
                                "languages": _arr(STR, minItems=1),
                                "continent": _enum("Africa", "Asia", "Europe", "Americas", "Oceania")}),
               "Describe France.",
               {"name": "France", "capital": "Paris", "population_millions": 68.2, "languages": ["French"],
                "continent": "Europe"}),
    SchemaCase("log_line", _obj({"level": _enum("DEBUG", "INFO", "WARNING", "ERROR"), "logger": STR,
                                 "message": STR, "line": INT}),
               "Parse: [ERROR] specserve.server: request failed (line 42)",
               {"level": "ERROR", "logger": "specserve.server", "message": "request failed", "line": 42}),
    SchemaCase("matrix", _obj({"rows": INT, "cols": INT, "data": _arr(_arr(INT))}),
               "Give the 2x2 identity matrix.", {"rows": 2, "cols": 2, "data": [[1, 0], [0, 1]]}),
    SchemaCase("org_chart", _obj({"team": STR, "lead": _obj({"name": STR, "title": STR}),
                                  "members": _arr(_obj({"name": STR, "role": _enum("engineer", "designer",
                                                                                   "manager")}))}),
               "Describe the inference team: lead Kim (staff engineer), members Lee (engineer) and Ng (designer).",
               {"team": "inference", "lead": {"name": "Kim", "title": "staff engineer"},
                "members": [{"name": "Lee", "role": "engineer"}, {"name": "Ng", "role": "designer"}]}),
]
