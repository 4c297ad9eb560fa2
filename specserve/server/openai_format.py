"""Pure conversions between the OpenAI protocol and specserve's request/result dicts (no I/O, no state)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from specserve.frontend import RequestError, token_text
from specserve.sampling.params import GRAMMAR_FIELDS
from specserve.server.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

JSON_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object

# OpenAI request field -> SGLang sampling parameter (fields with the same name are listed once)
_SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "stop", "stop_regex", "stop_token_ids", "seed", "logit_bias", "ignore_eos",
              "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n")


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, logprobs: bool,
                    top_logprobs: int) -> dict[str, Any]:
    """The SGLang sampling-params dict of an OpenAI request; fields the client left out keep their defaults."""
    sp: dict[str, Any] = {name: getattr(req, name) for name in _SAME_NAME if getattr(req, name) is not None}
    sp["max_new_tokens"] = max_tokens
    sp["min_new_tokens"] = req.min_tokens
    sp.update(grammar_params(req))
    if logprobs:
        sp["return_logprob"] = True
        sp["top_logprobs_num"] = top_logprobs
    return sp


def grammar_params(req: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """The grammar sampling parameter of a request: response_format as a json_schema or structural_tag, or SGLang's
    extras."""
    out = {name: getattr(req, name) for name in GRAMMAR_FIELDS if getattr(req, name) is not None}
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return out
    if out:
        raise RequestError(f"response_format and {next(iter(out))} cannot both be given", "response_format")
    if fmt.type == "structural_tag":
        tag = {"format": fmt.format} if fmt.format is not None else {"structures": fmt.structures,
                                                                      "triggers": fmt.triggers}
        return {"structural_tag": json.dumps({"type": "structural_tag", **tag})}
    if fmt.type == "json_object":
        return {"json_schema": JSON_OBJECT}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RequestError("response_format json_schema needs json_schema.schema", "response_format")
    return {"json_schema": json.dumps(fmt.json_schema.schema_)}


def chat_sampling_params(req: ChatCompletionRequest) -> dict[str, Any]:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return sampling_params(req, max_tokens, req.logprobs, req.top_logprobs or 0)


def completion_sampling_params(req: CompletionRequest) -> dict[str, Any]:
    sp = sampling_params(req, req.max_tokens, req.logprobs is not None, req.logprobs or 0)
    if req.echo and req.logprobs is not None:
        sp["logprob_start_len"] = 0  # the echoed prompt's logprobs come first (SGLang, OpenAI)
    return sp


def check_chat_supported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs=true", "top_logprobs")


def check_completion_supported(req: CompletionRequest) -> None:
    if req.suffix:
        raise RequestError("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of different from n is not supported", "best_of")


def render_chat(tokenizer, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None,
                continue_final: bool = False, timeout: float | None = None,
                check_chars: Callable[[int], None] | None = None, tools: list[dict] | None = None) -> list[int]:
    """Chat messages -> prompt token ids through the tokenizer's chat template (or --chat-template), tools (OpenAI's
    tool dicts) shown to the model when given.
    continue_final: the last message is an assistant turn to continue (no end of turn, no new turn).
    timeout: seconds the template may run (RequestError beyond); check_chars(n): raises when the rendered text
    of n characters is too long to tokenize (before it is tokenized)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; start the server with --chat-template", "messages")
    if continue_final and messages[-1]["role"] != "assistant":
        raise RequestError("continue_final_message needs the last message to be the assistant's",
                           "continue_final_message")

    def render() -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not continue_final,
                                             continue_final_message=continue_final, tools=tools,
                                             **(template_kwargs or {}))

    try:
        text = render() if timeout is None else call_with_deadline(render, timeout)
    except TemplateTimeout as e:
        raise RequestError(f"the chat template took longer than {timeout:g} s to render these messages "
                           "(--chat-template-timeout)", "messages") from e
    except Exception as e:  # noqa: BLE001 - a template may raise anything (e.g. "roles must alternate")
        raise RequestError(f"the chat template failed on these messages: {e}", "messages") from e
    if check_chars is not None:
        check_chars(len(text))
    return tokenizer.encode(text, add_special_tokens=False)


class TemplateTimeout(Exception):
    """A Jinja template ran past its deadline."""


JINJA_FILENAME = "<template>"  # the file name of code Jinja compiles from a string (chat templates are)


def call_with_deadline(fn: Callable[[], Any], seconds: float) -> Any:
    """fn() on this thread, interrupted with TemplateTimeout once `seconds` have passed while it is inside
    Jinja-compiled code. A template is Python code that loops without calling anything we could time, so a
    trace function (this thread only) checks the clock on each line the template runs; other code runs
    untraced. Costs a few microseconds per template line."""
    deadline = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout
        return on_line

    def on_call(frame, event, arg):
        return on_line(frame, event, arg) if frame.f_code.co_filename == JINJA_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(previous)


# ---------------------------------------------------------------------------------------------- results
def finish_reason(reason: dict | None) -> tuple[str | None, int | str | None]:
    """Scheduler finish reason -> (OpenAI finish_reason, matched stop token id or string)."""
    if reason is None:
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    return kind, None  # "length" or "abort"


def usage(prompt_tokens: list[int], completion_tokens: list[int], cached_tokens: list[int]) -> Usage:
    """prompt_tokens / cached_tokens: one entry per distinct prompt; completion_tokens: one per sample."""
    p, c = sum(prompt_tokens), sum(completion_tokens)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached_tokens)))


def results_usage(metas: list[dict], n: int) -> Usage:
    """Usage of prompts x n samples in order (sample j of prompt i at i * n + j)."""
    firsts = metas[::n]
    return usage([m["prompt_tokens"] for m in firsts], [m["completion_tokens"] for m in metas],
                 [m["cached_tokens"] for m in firsts])


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's table: printable Latin-1 bytes map to themselves, the other
    bytes to code points from 256 on, in byte order) -> the byte each stands for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_DECODER = _byte_decoder()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """A token's own UTF-8 bytes (OpenAI's logprob "bytes"): exact also for a token holding part of a character,
    whose text decodes to U+FFFD. Byte-level BPE pieces map through the byte table, sentencepiece byte pieces
    (<0xE2>) are that byte, "▁" is a space; anything else falls back to its decoded text."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            return [int(m.group(1), 16)]
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder):
            if all(ch in _BYTE_DECODER for ch in piece):
                return [_BYTE_DECODER[ch] for ch in piece]
    return list(token_text(tokenizer, token_id).encode())


def _top_logprob(tokenizer, logprob: float, token_id: int) -> TopLogprob:
    return TopLogprob(token=token_text(tokenizer, token_id), logprob=logprob, bytes=token_bytes(tokenizer, token_id))


def chat_logprobs(tokenizer, entries: list, tops: list | None) -> ChatLogprobs:
    """Output logprob entries [(logprob, id, text)] and their top-n rows (meta_info's output_token_logprobs and
    output_top_logprobs) -> OpenAI's chat form."""
    content = []
    for i, (lp, tok, _) in enumerate(entries):
        top = [_top_logprob(tokenizer, tlp, tid) for tlp, tid, _ in tops[i]] if tops else []
        content.append(TokenLogprob(token=token_text(tokenizer, tok), logprob=lp, bytes=token_bytes(tokenizer, tok),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer, entries: list, tops: list | None, text_offset: int) -> CompletionLogprobs:
    """The same in the completions form; text_offset is where the first token's text starts. Entries may be
    the prompt's (echo), whose first logprob and top row are None."""
    out = CompletionLogprobs(top_logprobs=[] if tops is not None else None)
    for i, (lp, tok, _) in enumerate(entries):
        text = token_text(tokenizer, tok)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if tops is not None:
            row = tops[i]
            out.top_logprobs.append(None if row is None else {token_text(tokenizer, tid): tlp for tlp, tid, _ in row})
    return out


def join_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """second's entries after first's (the prompt's, then the output's)."""
    tops = None
    if first.top_logprobs is not None and second.top_logprobs is not None:
        tops = first.top_logprobs + second.top_logprobs
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=tops, text_offset=first.text_offset + second.text_offset)


def output_logprobs(meta: dict) -> tuple[list, list | None]:
    """(output entries, their top rows or None) of a meta_info."""
    return meta.get("output_token_logprobs", []), meta.get("output_top_logprobs")


def prompt_logprobs(meta: dict) -> tuple[list, list | None]:
    """(prompt entries, their top rows or None) of a meta_info: echo + logprobs."""
    return meta.get("input_token_logprobs", []), meta.get("input_top_logprobs")
