"""The OpenAPI document describes every route's body and answers, and the server holds to it: schemathesis
generates requests from the served /openapi.json (valid ones, and invalid bodies) and checks that none is
answered with a 5xx and that every answer has a documented status, media type and schema."""

from __future__ import annotations

import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from specserve.utils import terminate_process
from tests.server.conftest import start_server

CONTEXT = 256
EXAMPLES = 25  # per operation and mode: CI-sized (a few seconds per generating operation on CPU)
MAX_TOKENS = 8  # generated token limits are cut to this, and n to MAX_N, to keep generation short on CPU
MAX_N = 2
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def api_server(llama_dir, tmp_path_factory):
    """A server of its own (generated aborts and cache flushes land here, not on the shared one), with a short
    context so that a request leaving its token limit unset still generates for well under a second."""
    s = start_server(llama_dir, str(tmp_path_factory.mktemp("openapi") / "server.log"), "--context-length",
                     str(CONTEXT), "--max-total-tokens", "2048", "--enable-metrics")
    yield s
    terminate_process(s.proc)


def test_document_describes_every_body(api_server):
    doc = api_server.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops and path != "/flush_cache"}
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/tokenize", "/abort_request"} <= set(posts)
    for path, op in posts.items():
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in schemas, path
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert chat["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert "text/event-stream" in chat
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert "422" not in str(doc["paths"])  # validation errors answer 400 here


def _steer(case) -> None:
    """Cuts a generated body's token limits and choice counts (wherever they are numbers) to keep generation
    quick, and gives a /generate body without a prompt one (the schema cannot say "exactly one of text and
    input_ids", so most would be refused before generating); anything else is sent as generated."""
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path == "/generate" and body.get("text") is None and body.get("input_ids") is None:
        body["text"] = "def f(x):"
    for field, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS), ("n", MAX_N)):
        if _is_int(body.get(field)):
            body[field] = min(body[field], cap)
    params = body.get("sampling_params")
    for p in params if isinstance(params, list) else [params]:
        if isinstance(p, dict):
            for field, cap in (("max_new_tokens", MAX_TOKENS), ("n", MAX_N)):
                if _is_int(p.get(field)):
                    p[field] = min(p[field], cap)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fuzz(operation, mode: GenerationMode, url: str, session: requests.Session) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        _steer(case)
        case.call_and_validate(base_url=url, session=session, checks=CHECKS, timeout=60)

    run()


def test_schemathesis(api_server):
    schema = schemathesis.openapi.from_url(api_server.url + "/openapi.json")
    failures, start = [], time.monotonic()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            modes = [GenerationMode.POSITIVE]
            if operation.body:  # invalid bodies must be 4xx too (no 5xx), with OpenAI's error body
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:
                try:
                    _fuzz(operation, mode, api_server.url, session)
                except Exception as e:  # every operation runs; the failures are reported together
                    failures.append(f"{operation.label} ({mode.value}): {e}")
    print(f"schemathesis: {time.monotonic() - start:.1f}s")
    assert not failures, "\n\n".join(failures)
