"""SGLang's native endpoints: /generate, health checks, model/server info, cache flush, abort, metrics."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from specserve.engine import server_info
from specserve.frontend import WEIGHT_VERSION, PreparedRequest, RequestError, prepare_requests
from specserve.server.auth import caller, require_admin
from specserve.server.errors import APIError, from_request_error, parse_body
from specserve.server.http_jobs import DONE, sse, stream_response, submit_job, wait_results
from specserve.server.manager import Job, Overloaded, RequestManager
from specserve.server.openapi import SSE, TEXT, documented
from specserve.server.protocol import AbortRequest, DetokenizeRequest, GenerateRequest, TokenizeRequest
from specserve.server.tool_calls import template_messages

router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 60.0


def _manager(request: Request) -> RequestManager:
    return request.app.state.manager


# ---------------------------------------------------------------------------------------------- generate
@router.post("/generate", **documented(GenerateRequest, content=SSE))
async def generate(request: Request):
    """Like ``Engine.generate``: one result dict, or a list for a batch / n > 1. Streaming sends the
    cumulative result so far as each event (SGLang's format), with "index" for a batch, then [DONE]."""
    manager = _manager(request)
    req = await parse_body(request, GenerateRequest)
    rid = req.rid if isinstance(req.rid, str) else uuid.uuid4().hex
    built: list[tuple[list[PreparedRequest], bool]] = []

    def build() -> list[PreparedRequest]:
        built.append(prepare_requests(manager.factory, req.text, req.sampling_params, req.input_ids, req.rid,
                                      **req.logprob_fields()))
        return built[0][0]

    job = await submit_job(request, manager, build, rid, req.stream)
    prepared, single = built[0]
    prompts = [p.req.origin_input_ids for p in prepared] if req.return_prompt_token_ids else None
    if req.stream:
        return stream_response(request, manager, job, _generate_events(job, single, prompts))
    results = await wait_results(request, manager, job)
    for i, r in enumerate(results):
        _add_prompt_ids(r, prompts, i)
    return JSONResponse(results[0] if single else results)


def _add_prompt_ids(result: dict, prompts: list[list[int]] | None, i: int) -> dict:
    """return_prompt_token_ids: the request's prompt ids beside its output (SGLang's "prompt_token_ids")."""
    if prompts is not None:
        result["prompt_token_ids"] = list(prompts[i])
    return result


async def _generate_events(job: Job, single: bool, prompts: list[list[int]] | None) -> AsyncIterator[str]:
    async for batch in job.chunks():
        for i, _ in batch:
            out = _add_prompt_ids(job.states[i].result(), prompts, i)
            if not single:
                out["index"] = i
            yield sse(out)
    yield DONE


# ---------------------------------------------------------------------------------------------- tokenizer
@router.post("/tokenize", **documented(TokenizeRequest, errors=(400, 401)))
@router.post("/v1/tokenize", **documented(TokenizeRequest, errors=(400, 401)))
async def tokenize(request: Request) -> dict:
    """A prompt -> {"tokens", "count", "max_model_len"} (a list of each for a list of prompts); chat messages
    are rendered through the chat template first, as /v1/chat/completions does."""
    manager = _manager(request)
    req = await parse_body(request, TokenizeRequest)
    tok = manager.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")

    def run():
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            return manager.render_chat(template_messages(req.messages), None, tools=tools)
        if isinstance(req.prompt, list):
            return [tok.encode(p, add_special_tokens=req.add_special_tokens) for p in req.prompt]
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    try:
        ids = await manager.run_in_tokenizer(run)
    except RequestError as e:
        raise from_request_error(e) from e
    count = [len(x) for x in ids] if ids and isinstance(ids[0], list) else len(ids)
    return {"tokens": ids, "count": count, "max_model_len": manager.context_len}


@router.post("/detokenize", **documented(DetokenizeRequest, errors=(400, 401)))
@router.post("/v1/detokenize", **documented(DetokenizeRequest, errors=(400, 401)))
async def detokenize(request: Request) -> dict:
    manager = _manager(request)
    req = await parse_body(request, DetokenizeRequest)
    vocab = manager.info["vocab_size"]
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    text = await manager.run_in_tokenizer(
        lambda: manager.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens))
    return {"text": text}


# ---------------------------------------------------------------------------------------------- health
@router.get("/health", response_class=Response, **documented(errors=(503,)))
async def health(request: Request) -> Response:
    manager = _manager(request)
    if manager.draining or not manager.worker_alive:
        raise APIError(503, "the server is shutting down" if manager.draining else "the model worker is down",
                       code="unavailable")
    return Response(status_code=200)


@router.get("/health_generate", response_class=Response, **documented(errors=(503,)))
async def health_generate(request: Request) -> Response:
    """Runs a one-token generation through the whole stack (counted against the queue; concurrent probes share
    one generation)."""
    try:
        result = await _manager(request).health_generate(HEALTH_GENERATE_TIMEOUT_S)
    except (Overloaded, TimeoutError) as e:
        raise APIError(503, f"health generation failed: {e or 'timed out'}", code="unavailable") from e
    if result["meta_info"]["completion_tokens"] != 1:
        raise APIError(503, f"health generation failed: {result['meta_info']['finish_reason']}",
                       code="unavailable")
    return Response(status_code=200)


# ---------------------------------------------------------------------------------------------- info
@router.get("/model_info", **documented(errors=(401,)))
@router.get("/get_model_info", **documented(errors=(401,)))
async def get_model_info(request: Request) -> dict:
    m = _manager(request)
    admin = caller(request).admin  # where the model was loaded from is the admin's to see
    return {
        "model_path": m.args.model_path if admin else m.served_model_name,
        "tokenizer_path": (m.args.tokenizer_path or m.info["model_dir"]) if admin else m.served_model_name,
        "served_model_name": m.served_model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": WEIGHT_VERSION,
        "architectures": [m.info["architecture"]],
        "architecture": m.info["architecture"],
        "context_length": m.context_len,
        "vocab_size": m.info["vocab_size"],
        "dtype": m.info["dtype"],
        "device": m.info["device"],
    }


@router.get("/server_info", **documented(errors=(401,)))
@router.get("/get_server_info", **documented(errors=(401,)))
async def get_server_info(request: Request) -> dict:
    """Server arguments (secrets hidden; paths and pids shown to the admin only) and the worker's runtime state.
    The state is also under "internal_states" (one element per --dp-size replica) where SGLang clients look for
    e.g. avg_spec_accept_length."""
    m = _manager(request)
    state, replicas = await m.server_info()
    return server_info(m.args, state, private=caller(request).admin, replicas=replicas)


# ---------------------------------------------------------------------------------------------- control
@router.get("/flush_cache", response_class=Response, **documented(errors=(400, 401, 403)))
@router.post("/flush_cache", response_class=Response, **documented(errors=(400, 401, 403)))
async def flush_cache(request: Request) -> Response:
    require_admin(request, "flushing the cache")
    if not all(await _manager(request).call("flush_cache")):
        raise APIError(400, "the cache was not flushed: requests are running or queued; retry when idle",
                       code="busy")
    return Response("Cache flushed.\n", status_code=200)


@router.post("/abort_request", **documented(AbortRequest, errors=(400, 401, 403)))
async def abort_request(request: Request) -> dict:
    """Aborts the caller's request by rid (any client's for the admin), or every request (admin only).
    -> {"aborted": number of samples aborted}; 0 when the caller has nothing running under that rid."""
    manager = _manager(request)
    req = await parse_body(request, AbortRequest)
    who = caller(request)
    if req.abort_all:
        require_admin(request, "abort_all")
        return {"aborted": manager.abort_all()}
    if req.rid is None:
        raise APIError(400, "give rid or abort_all", param="rid")
    return {"aborted": manager.abort(req.rid, owner=who.principal, any_owner=who.admin)}


@router.get("/metrics", response_class=Response, **documented(errors=(404,), content=TEXT))
async def metrics(request: Request) -> Response:
    manager = _manager(request)
    if manager.metrics is None:
        raise APIError(404, "metrics are off; start the server with --enable-metrics", code="not_found")
    body = manager.metrics.render((await manager.server_info())[0])
    return Response(body, media_type=CONTENT_TYPE_LATEST)
