"""The OpenAPI document (``/openapi.json``): request bodies, success bodies and error bodies of every route.

The POST endpoints take the raw ``Request`` and parse it with ``errors.parse_body`` (strict JSON and OpenAI-style
400s), so FastAPI sees no body parameter to describe. ``documented(...)`` gives a route decorator what its
signature cannot show: the pydantic model of its body (a ``$ref`` into components/schemas), its success model
and media types, and the error answers it can give. ``install_openapi`` adds the JSON schemas of those body
models to the app's document, where the body references point.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from specserve.server.protocol import ErrorResponse

SCHEMA_REF = "#/components/schemas/{model}"

ERRORS = {
    400: "The request is invalid: bad JSON, a field of the wrong type or out of range, a prompt too long",
    401: "The API key is missing or wrong (only when the server runs with --api-key)",
    403: "An admin action without the admin key (--admin-api-key)",
    404: "Not found",
    408: "The request body did not arrive in time",
    413: "The request body is larger than --max-request-bytes",
    503: "The server cannot take the request now: it is full, shutting down, or its model worker is down",
}
BODY_ERRORS = (400, 408, 413, 503)  # what reading any body may answer (errors.read_body, parse_body)

# 200 bodies other than JSON, for `documented(content=...)`
# (an event stream's itemSchema describes each event, as FastAPI's own SSE routes do)
SSE = {"text/event-stream": {"itemSchema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": 'with "stream": true, each event is a JSON chunk; '
                                                             'the last is "[DONE]"'}}}}}
TEXT = {"text/plain": {"schema": {"type": "string"}}}

# Every model a route names as its body, by name (routes are declared at import, before any app exists): their
# schemas go into the document's components
_body_models: dict[str, type[BaseModel]] = {}


def documented(body: type[BaseModel] | None = None, response: type[BaseModel] | None = None, *,
               content: dict | None = None, errors: tuple[int, ...] = (400, 401, 503)) -> dict[str, Any]:
    """Keyword arguments for a route decorator that describe the route in the OpenAPI document: `body` is the
    model parse_body validates the request with, `response` the 200 body's model, `content` its other media
    types (SSE, TEXT), `errors` the statuses it answers with OpenAI's error body."""
    statuses = sorted(set(errors) | (set(BODY_ERRORS) if body is not None else set()))
    responses: dict[int | str, dict] = {status: {"model": ErrorResponse, "description": ERRORS[status]}
                                        for status in statuses}
    ok: dict[str, Any] = {}
    if response is not None:
        ok["model"] = response
    if content is not None:
        ok["content"] = content
    if ok:
        responses[200] = ok
    kwargs: dict[str, Any] = {"responses": responses}
    if body is not None:
        _body_models[body.__name__] = body
        schema = {"$ref": SCHEMA_REF.format(model=body.__name__)}
        kwargs["openapi_extra"] = {"requestBody": {"required": True,
                                                   "content": {"application/json": {"schema": schema}}}}
    return kwargs


def install_openapi(app: FastAPI) -> None:
    """Makes `app`'s document (built once, on the first request for it) hold the body models' schemas."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = build()
            _drop_validation_errors(doc)
            _add_schemas(doc, _body_models.values())
        return app.openapi_schema

    app.openapi = openapi


def _add_schemas(doc: dict, models) -> None:
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=SCHEMA_REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in defs.get("$defs", {}).items():
        if schemas.setdefault(name, schema) != schema:
            raise RuntimeError(f"two different schemas are named {name} in the OpenAPI document")


def _drop_validation_errors(doc: dict) -> None:
    """FastAPI documents a 422 for routes with parameters; this app answers those errors 400 (errors.py)."""
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
