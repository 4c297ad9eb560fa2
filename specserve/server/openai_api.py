"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions (plain and SSE), /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from specserve.frontend import PreparedRequest, prepare_requests
from specserve.server import openai_format as fmt
from specserve.server.errors import APIError, parse_body
from specserve.server.http_jobs import DONE, sse, stream_response, submit_job, wait_results
from specserve.server.manager import Job, RequestManager
from specserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
)

router = APIRouter()


def _manager(request: Request) -> RequestManager:
    return request.app.state.manager


def check_model(manager: RequestManager, model: str | None) -> None:
    if model is not None and model not in manager.model_names():
        raise APIError(404, f"The model {model!r} does not exist; this server serves {manager.served_model_name!r}",
                       param="model", code="model_not_found")


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    m = _manager(request)
    return ModelList(data=[ModelCard(id=m.served_model_name, root=m.args.model_path, max_model_len=m.context_len)])


# ---------------------------------------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    manager = _manager(request)
    req = await parse_body(request, ChatCompletionRequest)
    check_model(manager, req.model)
    rid = req.rid or uuid.uuid4().hex

    def build() -> list[PreparedRequest]:
        fmt.check_chat_supported(req)
        ids = fmt.render_chat(manager.tokenizer, fmt.chat_messages(req), req.chat_template_kwargs)
        return prepare_requests(manager.factory, None, fmt.chat_sampling_params(req), ids, rid=rid)[0]

    job = await submit_job(manager, build, rid, req.stream, openai_names=True)
    model = req.model or manager.served_model_name
    if req.stream:
        return stream_response(request, manager, job, _chat_events(manager, req, job, model))
    results = await wait_results(request, manager, job)
    choices = []
    for i, r in enumerate(results):
        reason, matched = fmt.finish_reason(r["meta_info"]["finish_reason"])
        lps = fmt.chat_logprobs(manager.tokenizer, r["meta_info"]) if req.logprobs else None
        choices.append(ChatChoice(index=i, message=ChatMessageOut(content=r["text"]), logprobs=lps,
                                  finish_reason=reason, matched_stop=matched))
    usage = fmt.results_usage([r["meta_info"] for r in results], req.n)
    return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage)


async def _chat_events(manager: RequestManager, req: ChatCompletionRequest, job: Job, model: str
                       ) -> AsyncIterator[str]:
    created = int(time.time())
    opts = req.stream_options
    continuous = opts is not None and opts.continuous_usage_stats

    def chunk(choice: ChatChunkChoice) -> str:
        usage = _stream_usage(job, req.n) if continuous else None
        return sse(ChatCompletionChunk(id=job.rid, created=created, model=model, choices=[choice], usage=usage))

    for i in range(len(job.states)):
        yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    async for batch in job.chunks():
        for i, c in batch:
            meta = c["meta_info"]
            finished = job.states[i].finished
            lps = fmt.chat_logprobs(manager.tokenizer, meta) if req.logprobs and meta["output_token_logprobs"] \
                else None
            if not (c["text"] or finished or lps or (continuous and c["output_ids"])):  # nothing to tell
                continue
            reason, matched = fmt.finish_reason(meta["finish_reason"] if finished else None)
            delta = DeltaMessage(content=c["text"]) if c["text"] else DeltaMessage()
            yield chunk(ChatChunkChoice(index=i, delta=delta, logprobs=lps, finish_reason=reason,
                                        matched_stop=matched))
    if opts is not None and opts.include_usage:
        yield sse(ChatCompletionChunk(id=job.rid, created=created, model=model, choices=[],
                                      usage=_stream_usage(job, req.n)))
    yield DONE


def _stream_usage(job: Job, n: int):
    counts = [{"prompt_tokens": s.prompt_tokens, "completion_tokens": len(s.output_ids),
               "cached_tokens": s.cached_tokens} for s in job.states]
    return fmt.results_usage(counts, n)


# ---------------------------------------------------------------------------------------------- completions
def _prompt_inputs(prompt) -> tuple[str | list[str] | None, list[int] | list[list[int]] | None]:
    """OpenAI's prompt (text, texts, ids, id lists) as prepare_requests' (prompt, input_ids)."""
    if isinstance(prompt, str):
        return prompt, None
    if prompt and isinstance(prompt[0], str):
        return prompt, None
    return None, prompt


@router.post("/v1/completions")
async def completions(request: Request):
    manager = _manager(request)
    req = await parse_body(request, CompletionRequest)
    check_model(manager, req.model)
    rid = req.rid or uuid.uuid4().hex
    texts, ids = _prompt_inputs(req.prompt)

    def build() -> list[PreparedRequest]:
        fmt.check_completion_supported(req)
        return prepare_requests(manager.factory, texts, fmt.completion_sampling_params(req), ids, rid=rid)[0]

    job = await submit_job(manager, build, rid, req.stream, openai_names=True)
    model = req.model or manager.served_model_name
    echoes = _echo_texts(manager, req, texts, ids)
    if req.stream:
        return stream_response(request, manager, job, _completion_events(manager, req, job, model, echoes))
    results = await wait_results(request, manager, job)
    choices = []
    for i, r in enumerate(results):
        reason, matched = fmt.finish_reason(r["meta_info"]["finish_reason"])
        echo = echoes[i // req.n]
        lps = fmt.completion_logprobs(manager.tokenizer, r["meta_info"], len(echo)) \
            if req.logprobs is not None else None
        choices.append(CompletionChoice(index=i, text=echo + r["text"], logprobs=lps, finish_reason=reason,
                                        matched_stop=matched))
    usage = fmt.results_usage([r["meta_info"] for r in results], req.n)
    return CompletionResponse(id=rid, model=model, choices=choices, usage=usage)


def _echo_texts(manager: RequestManager, req: CompletionRequest, texts, ids) -> list[str]:
    """Per prompt: the text echoed before the completion ('' unless echo)."""
    if texts is not None:
        prompts = [texts] if isinstance(texts, str) else texts
        return list(prompts) if req.echo else [""] * len(prompts)
    id_lists = ids if ids and isinstance(ids[0], list) else [ids]
    return [manager.tokenizer.decode(x) if req.echo else "" for x in id_lists]


async def _completion_events(manager: RequestManager, req: CompletionRequest, job: Job, model: str,
                             echoes: list[str]) -> AsyncIterator[str]:
    created = int(time.time())
    opts = req.stream_options
    continuous = opts is not None and opts.continuous_usage_stats
    offsets = [len(echoes[i // req.n]) for i in range(len(job.states))]

    def chunk(choice: CompletionChoice) -> str:
        usage = _stream_usage(job, req.n) if continuous else None
        return sse(CompletionResponse(id=job.rid, created=created, model=model, choices=[choice], usage=usage))

    if req.echo:
        for i in range(len(job.states)):
            yield chunk(CompletionChoice(index=i, text=echoes[i // req.n]))
    async for batch in job.chunks():
        for i, c in batch:
            meta = c["meta_info"]
            finished = job.states[i].finished
            lps = None
            if req.logprobs is not None and meta["output_token_logprobs"]:
                lps = fmt.completion_logprobs(manager.tokenizer, meta, offsets[i])
                offsets[i] = lps.text_offset[-1] + len(lps.tokens[-1])
            if not (c["text"] or finished or lps or (continuous and c["output_ids"])):  # nothing to tell
                continue
            reason, matched = fmt.finish_reason(meta["finish_reason"] if finished else None)
            yield chunk(CompletionChoice(index=i, text=c["text"], logprobs=lps, finish_reason=reason,
                                         matched_stop=matched))
    if opts is not None and opts.include_usage:
        yield sse(CompletionResponse(id=job.rid, created=created, model=model, choices=[],
                                     usage=_stream_usage(job, req.n)))
    yield DONE

