"""Errors as HTTP answers with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, and the
strict JSON body parser every POST endpoint uses."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.frontend import RequestError

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

BODY_READ_TIMEOUT_S = 60.0  # a client that has not finished sending its body by then is cut (408)

# SGLang sampling names -> the OpenAI request field a client sent
OPENAI_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                      "top_logprobs_num": "top_logprobs", "input_ids": "prompt"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status,
                        headers=headers)


def from_request_error(e: RequestError, openai_names: bool = False) -> APIError:
    """A RequestError as 400; for the OpenAI endpoints, SGLang parameter names become the OpenAI fields."""
    param, message = e.param, str(e)
    if openai_names:
        param = OPENAI_PARAM_NAMES.get(param, param)
        for sglang_name, openai_name in OPENAI_PARAM_NAMES.items():
            message = message.replace(sglang_name, openai_name)
    return APIError(400, message, param=param, code="invalid_value")


# ---------------------------------------------------------------------------------------------- parsing
def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's JSON body validated into `model`; APIError(400) for any problem with it."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(400, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                       code="invalid_content_type")
    raw = await read_body(request)
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError as e:
        raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from e
    if not isinstance(data, dict):
        raise APIError(400, f"the JSON body must be an object, got {type(data).__name__}", code="invalid_json")
    if (where := _lone_surrogate(data)) is not None:
        raise APIError(400, "the body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                       "which is not a Unicode character", param=where, code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


async def read_body(request: Request) -> bytes:
    """The request's body, at most ``app.state.max_request_bytes`` of it (413 beyond: the body is not kept).
    A body that takes longer than BODY_READ_TIMEOUT_S to arrive gets 408, and one still arriving when the server
    starts draining gets 503 at once: a stalled client can neither hold a connection nor hold up a shutdown."""
    state = request.app.state
    limit = getattr(state, "max_request_bytes", None)
    declared = request.headers.get("content-length", "")
    if limit is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    reading = asyncio.ensure_future(_read_limited(request, limit))
    stop = getattr(state, "stop_reading", None)
    waiting = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        done, _ = await asyncio.wait({reading, waiting} - {None}, timeout=BODY_READ_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (reading, waiting):
            if task is not None and not task.done():
                task.cancel()
    if reading in done:
        return reading.result()
    if waiting is not None and waiting in done:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    raise APIError(408, f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s", code="timeout")


async def _read_limited(request: Request, limit: int | None) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit is not None and size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-request-bytes)",
                    code="request_too_large")


def _lone_surrogate(data) -> str | None:
    """The top-level field (or "body") holding a string that is not valid Unicode (JSON may escape half of a
    UTF-16 surrogate pair alone), or None. Walks the parsed body without recursion."""
    stack = [(data, None)]
    while stack:
        value, field = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return field or "body"
        elif isinstance(value, dict):
            stack.extend((v, field or k) for k, v in value.items())
            stack.extend((k, field or k) for k in value)
        elif isinstance(value, list):
            stack.extend((v, field) for v in value)
    return None


def validation_error(e: ValidationError) -> APIError:
    first = e.errors()[0]
    param = loc_to_param(first.get("loc", ()))
    extra = f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else ""
    return APIError(400, f"{param}: {first['msg']}{extra}" if param else first["msg"] + extra, param=param,
                    code="invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; union member tags ('str', 'list[int]') are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in str(part) or part == "body":
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or None


# ---------------------------------------------------------------------------------------------- handlers
def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, e: RequestError) -> JSONResponse:
        return error_response(from_request_error(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        return error_response(APIError(400, first["msg"], param=loc_to_param(tuple(first.get("loc", ())))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(_request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))
