"""HTTP plumbing shared by the generation endpoints: submitting a job, server-sent events, disconnects.

A client that goes away (streaming or not) has its job aborted at once, so the worker frees the KV of its
requests at its next step. Disconnects are watched on the ASGI receive channel by a task that lives as
long as the job, independent of how the response is being sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from specserve.frontend import PreparedRequest, RequestError
from specserve.server.auth import caller
from specserve.server.errors import APIError, from_request_error
from specserve.server.manager import Job, Overloaded, RequestManager

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def submit_job(request: Request, manager: RequestManager, build: Callable[[], list[PreparedRequest]], rid: str,
                     stream: bool, openai_names: bool = False) -> Job:
    """Builds the prepared requests on the tokenizer pool, then submits them as one job of the caller. Invalid
    input raises APIError 400 (parameter names in OpenAI's spelling for the OpenAI endpoints); no room, 503."""
    try:
        prepared = await manager.run_in_tokenizer(build)
        return manager.submit(rid, prepared, stream, owner=caller(request).principal)
    except RequestError as e:
        raise from_request_error(e, openai_names=openai_names) from e
    except Overloaded as e:
        raise APIError(503, str(e), code=e.reason) from e


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _abort_on_disconnect(request: Request, manager: RequestManager, job: Job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not job.done.is_set():
                manager.abort_job(job)
            return


def watch_disconnect(request: Request, manager: RequestManager, job: Job) -> asyncio.Task:
    """Aborts `job` if the client disconnects before it is done; the watcher ends with the job."""
    task = asyncio.create_task(_abort_on_disconnect(request, manager, job))
    job.watcher = task  # the event loop keeps only a weak reference to tasks
    job.on_done(task.cancel)
    return task


async def wait_results(request: Request, manager: RequestManager, job: Job) -> list[dict]:
    watcher = watch_disconnect(request, manager, job)
    try:
        return await job.results()
    finally:
        watcher.cancel()


def stream_response(request: Request, manager: RequestManager, job: Job, events: AsyncIterator[str]):
    """An SSE response of `events`; the job is aborted if the client leaves or the stream stops early."""
    watch_disconnect(request, manager, job)

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:
            if not job.done.is_set():
                manager.abort_job(job)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
