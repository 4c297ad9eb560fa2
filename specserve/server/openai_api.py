"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions (plain and SSE), /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from specserve.frontend import PreparedRequest, RequestError, prepare_requests
from specserve.sampling.params import GRAMMAR_FIELDS
from specserve.server import openai_format as fmt
from specserve.server.auth import caller
from specserve.server.errors import APIError, parse_body
from specserve.server.http_jobs import DONE, sse, stream_response, submit_job, wait_results
from specserve.server.manager import Job, RequestManager
from specserve.server.openapi import SSE, documented
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
from specserve.server.tool_calls import active_tools, call_out, template_messages, tool_choice, tool_grammar
from specserve.server.tool_calls import finish_reason as tool_finish_reason
from specserve.tools.stream import ToolCallStream

router = APIRouter()


def _manager(request: Request) -> RequestManager:
    return request.app.state.manager


def _model_card(request: Request) -> ModelCard:
    """The served model; its root (where it was loaded from) is shown to the admin only."""
    m = _manager(request)
    root = m.args.model_path if caller(request).admin else m.served_model_name
    return ModelCard(id=m.served_model_name, root=root, max_model_len=m.context_len)


@router.get("/v1/models", **documented(errors=(401,)))
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_model_card(request)])


@router.get("/v1/models/{model:path}", **documented(errors=(401, 404)))
async def retrieve_model(request: Request, model: str) -> ModelCard:
    """The served model's card; 404 for any other name (requests may name any model: see the endpoints)."""
    m = _manager(request)
    if model != m.served_model_name:
        raise APIError(404, f"The model {model!r} does not exist; this server serves {m.served_model_name!r}",
                       param="model", code="model_not_found")
    return _model_card(request)


# ---------------------------------------------------------------------------------------------- chat
@router.post("/v1/chat/completions", **documented(ChatCompletionRequest, ChatCompletionResponse, content=SSE))
async def chat_completions(request: Request):
    manager = _manager(request)
    req = await parse_body(request, ChatCompletionRequest)
    rid = req.rid or uuid.uuid4().hex

    def build() -> list[PreparedRequest]:
        fmt.check_chat_supported(req)
        tools = active_tools(req)
        sampling = fmt.chat_sampling_params(req)
        if tools is not None:
            sampling.update(_tool_sampling(manager, req, sampling))
        ids = manager.render_chat(template_messages(req.messages), req.chat_template_kwargs, req.continue_final_message,
                                  tools=tools)
        try:
            return prepare_requests(manager.factory, None, sampling, ids, rid=rid)[0]
        except RequestError as e:
            if e.param == "structural_tag" and req.structural_tag is None and req.response_format is None:
                raise RequestError(f"the tools' parameters: {e}", "tools") from None  # the tools' grammar
            raise

    job = await submit_job(request, manager, build, rid, req.stream, openai_names=True)
    model = manager.served_model_name  # any name is accepted (SGLang's rule); the answer names the model
    parse_tools = manager.tool_format is not None and tool_choice(req) != "none"
    if req.stream:
        return stream_response(request, manager, job, _chat_events(manager, req, job, model, parse_tools))
    results = await wait_results(request, manager, job)
    choices = []
    for i, r in enumerate(results):
        reason, matched = fmt.finish_reason(r["meta_info"]["finish_reason"])
        lps = fmt.chat_logprobs(manager.tokenizer, *fmt.output_logprobs(r["meta_info"])) if req.logprobs else None
        message = ChatMessageOut(content=r["text"])
        if parse_tools:
            content, calls = ToolCallStream(manager.tool_format).feed(r["text"], final=True)
            message = ChatMessageOut(content=content.strip() or None if calls else content,
                                     tool_calls=[call_out(c) for c in calls] or None)
            reason = tool_finish_reason(reason, bool(calls))
        choices.append(ChatChoice(index=i, message=message, logprobs=lps, finish_reason=reason,
                                  matched_stop=matched))
    usage = fmt.results_usage([r["meta_info"] for r in results], req.n)
    return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage)


def _tool_sampling(manager: RequestManager, req: ChatCompletionRequest, sampling: dict) -> dict:
    """The sampling parameters a request's tools add: the grammar of a forced call (tool_choice required or named)."""
    if manager.tool_format is None:
        raise RequestError("this server has no tool-call parser for its chat template; start it with "
                           "--tool-call-parser", "tools")
    grammar = tool_grammar(req, manager.tool_format)
    if grammar is None:
        return {}
    if any(name in sampling for name in GRAMMAR_FIELDS):
        raise RequestError("a forced tool call (tool_choice required or a named function) cannot be combined with "
                           "response_format or another grammar", "tool_choice")
    return {"structural_tag": grammar}


async def _chat_events(manager: RequestManager, req: ChatCompletionRequest, job: Job, model: str,
                       parse_tools: bool) -> AsyncIterator[str]:
    created = int(time.time())
    opts = req.stream_options
    continuous = opts is not None and opts.continuous_usage_stats

    def chunk(choice: ChatChunkChoice) -> str:
        usage = _stream_usage(job, req.n) if continuous else None
        return sse(ChatCompletionChunk(id=job.rid, created=created, model=model, choices=[choice], usage=usage))

    for i in range(len(job.states)):
        yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    held = [LogprobsHeld() for _ in job.states]
    tools = [ToolDeltas(manager.tool_format) if parse_tools else None for _ in job.states]
    async for batch in job.chunks():
        for i, c in batch:
            meta = c["meta_info"]
            finished = job.states[i].finished
            held[i].add(meta)
            delta = DeltaMessage(content=c["text"] or None)
            if tools[i] is not None:
                delta = tools[i].delta(c["text"], finished)
            if not (delta.content or delta.tool_calls or finished):  # text held back (part of a character, a
                continue  # possible stop, a possible tool call): wait
            lps = fmt.chat_logprobs(manager.tokenizer, *held[i].take()) if req.logprobs else None
            reason, matched = fmt.finish_reason(meta["finish_reason"] if finished else None)
            if tools[i] is not None:
                reason = tool_finish_reason(reason, tools[i].count > 0)
            yield chunk(ChatChunkChoice(index=i, delta=delta, logprobs=lps, finish_reason=reason,
                                        matched_stop=matched))
    if opts is not None and opts.include_usage:
        yield sse(ChatCompletionChunk(id=job.rid, created=created, model=model, choices=[],
                                      usage=_stream_usage(job, req.n)))
    yield DONE


class ToolDeltas:
    """One streamed choice's deltas when tools are parsed: content as soon as it is known to be text, each tool call
    whole in one delta once its text is complete."""

    def __init__(self, tool_format) -> None:
        self.stream = ToolCallStream(tool_format)
        self.count = 0  # calls sent so far

    def delta(self, text: str, final: bool) -> DeltaMessage:
        content, calls = self.stream.feed(text, final)
        outs = [call_out(c, self.count + k) for k, c in enumerate(calls)]
        self.count += len(outs)
        return DeltaMessage(content=content or None, tool_calls=outs or None)


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


@router.post("/v1/completions", **documented(CompletionRequest, CompletionResponse, content=SSE))
async def completions(request: Request):
    manager = _manager(request)
    req = await parse_body(request, CompletionRequest)
    rid = req.rid or uuid.uuid4().hex
    texts, ids = _prompt_inputs(req.prompt)

    def build() -> list[PreparedRequest]:
        fmt.check_completion_supported(req)
        return prepare_requests(manager.factory, texts, fmt.completion_sampling_params(req), ids, rid=rid)[0]

    job = await submit_job(request, manager, build, rid, req.stream, openai_names=True)
    model = manager.served_model_name  # any name is accepted (SGLang's rule); the answer names the model
    echoes = _echo_texts(manager, req, texts, ids)
    if req.stream:
        return stream_response(request, manager, job, _completion_events(manager, req, job, model, echoes))
    results = await wait_results(request, manager, job)
    choices = []
    for i, r in enumerate(results):
        reason, matched = fmt.finish_reason(r["meta_info"]["finish_reason"])
        echo = echoes[i // req.n]
        lps = _completion_logprobs(manager, req, r["meta_info"], echo, 0) if req.logprobs is not None else None
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


def _completion_logprobs(manager: RequestManager, req: CompletionRequest, meta: dict, echo: str, offset: int):
    """A completion choice's logprobs: with echo, the prompt's entries first (from offset 0, echo's text);
    then the output's, from where the text so far ends."""
    rest = fmt.completion_logprobs(manager.tokenizer, *fmt.output_logprobs(meta), offset + len(echo))
    if not req.echo:
        return rest
    return fmt.join_logprobs(fmt.completion_logprobs(manager.tokenizer, *fmt.prompt_logprobs(meta), 0), rest)


class LogprobsHeld:
    """One streamed choice's logprob entries not sent yet: a chunk whose text is held back (part of a character,
    a possible stop string) keeps its entries until a chunk with text, or the last one, carries them."""

    def __init__(self) -> None:
        self.entries: list = []
        self.tops: list | None = None

    def add(self, meta: dict) -> None:
        entries, tops = fmt.output_logprobs(meta)
        self.entries += entries
        if tops is not None:
            self.tops = (self.tops or []) + tops

    def take(self) -> tuple[list, list | None]:
        out = (self.entries, self.tops)
        self.entries, self.tops = [], None
        return out


async def _completion_events(manager: RequestManager, req: CompletionRequest, job: Job, model: str,
                             echoes: list[str]) -> AsyncIterator[str]:
    created = int(time.time())
    opts = req.stream_options
    continuous = opts is not None and opts.continuous_usage_stats
    sent = [0] * len(job.states)  # characters of each choice's text sent so far (echo included)
    echo_first = [req.echo] * len(job.states)  # the echo goes out with the choice's first chunk
    held = [LogprobsHeld() for _ in job.states]

    def chunk(choice: CompletionChoice) -> str:
        usage = _stream_usage(job, req.n) if continuous else None
        return sse(CompletionResponse(id=job.rid, created=created, model=model, choices=[choice], usage=usage))

    if req.echo and req.logprobs is None:  # no prompt logprobs to wait for: echo at once
        for i in range(len(job.states)):
            echo_first[i] = False
            sent[i] = len(echoes[i // req.n])
            yield chunk(CompletionChoice(index=i, text=echoes[i // req.n]))
    async for batch in job.chunks():
        for i, c in batch:
            meta = c["meta_info"]
            finished = job.states[i].finished
            held[i].add(meta)
            if not (c["text"] or finished or echo_first[i]):  # text held back: wait
                continue
            echo = echoes[i // req.n] if echo_first[i] else ""
            lps = None
            if req.logprobs is not None:
                entries, tops = held[i].take()
                lps = fmt.completion_logprobs(manager.tokenizer, entries, tops, sent[i] + len(echo))
                if echo:
                    lps = fmt.join_logprobs(fmt.completion_logprobs(manager.tokenizer, *fmt.prompt_logprobs(meta), 0),
                                            lps)
            reason, matched = fmt.finish_reason(meta["finish_reason"] if finished else None)
            echo_first[i] = False
            sent[i] += len(echo) + len(c["text"])
            yield chunk(CompletionChoice(index=i, text=echo + c["text"], logprobs=lps, finish_reason=reason,
                                         matched_stop=matched))
    if opts is not None and opts.include_usage:
        yield sse(CompletionResponse(id=job.rid, created=created, model=model, choices=[],
                                     usage=_stream_usage(job, req.n)))
    yield DONE
