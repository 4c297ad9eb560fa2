"""Pure conversions between the OpenAI protocol and specserve's request/result dicts (no I/O, no state)."""

from __future__ import annotations

from typing import Any

from specserve.frontend import RequestError
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

# OpenAI request field -> SGLang sampling parameter (fields with the same name are listed once)
_SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "stop", "stop_token_ids", "seed", "logit_bias", "ignore_eos",
              "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n")


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, logprobs: bool,
                    top_logprobs: int) -> dict[str, Any]:
    """The SGLang sampling-params dict of an OpenAI request; fields the client left out keep their defaults."""
    sp: dict[str, Any] = {name: getattr(req, name) for name in _SAME_NAME if getattr(req, name) is not None}
    sp["max_new_tokens"] = max_tokens
    sp["min_new_tokens"] = req.min_tokens
    if logprobs:
        sp["return_logprob"] = True
        sp["top_logprobs_num"] = top_logprobs
    return sp


def chat_sampling_params(req: ChatCompletionRequest) -> dict[str, Any]:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return sampling_params(req, max_tokens, req.logprobs, req.top_logprobs or 0)


def completion_sampling_params(req: CompletionRequest) -> dict[str, Any]:
    return sampling_params(req, req.max_tokens, req.logprobs is not None, req.logprobs or 0)


def check_chat_supported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise RequestError("tools / function calling are not supported by this server", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise RequestError("response_format other than text (constrained decoding) is not supported",
                           "response_format")
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs=true", "top_logprobs")


def check_completion_supported(req: CompletionRequest) -> None:
    if req.suffix:
        raise RequestError("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of different from n is not supported", "best_of")
    if req.echo and req.logprobs is not None:
        raise RequestError("echo with logprobs (prompt logprobs) is not supported", "echo")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as plain dicts for the chat template (text parts joined)."""
    out = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def render_chat(tokenizer, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None) -> list[int]:
    """Chat messages -> prompt token ids through the tokenizer's chat template (or --chat-template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; start the server with --chat-template", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - a template may raise anything (e.g. "roles must alternate")
        raise RequestError(f"the chat template failed on these messages: {e}", "messages") from e
    return tokenizer.encode(text, add_special_tokens=False)


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


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, meta: dict) -> ChatLogprobs:
    """meta_info's output_token_logprobs [(logprob, id, None)] (+ output_top_logprobs) -> OpenAI chat form."""
    tops = meta.get("output_top_logprobs")
    content = []
    for i, (lp, tok, _) in enumerate(meta.get("output_token_logprobs", [])):
        text = token_text(tokenizer, tok)
        top = [TopLogprob(token=(t := token_text(tokenizer, tid)), logprob=tlp, bytes=list(t.encode()))
               for tlp, tid, _ in tops[i]] if tops else []
        content.append(TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer, meta: dict, text_offset: int) -> CompletionLogprobs:
    """The same in the completions form; text_offset is where the first token's text starts."""
    out = CompletionLogprobs()
    tops = meta.get("output_top_logprobs")
    if tops is not None:
        out.top_logprobs = []
    for i, (lp, tok, _) in enumerate(meta.get("output_token_logprobs", [])):
        text = token_text(tokenizer, tok)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if tops is not None:
            out.top_logprobs.append({token_text(tokenizer, tid): tlp for tlp, tid, _ in tops[i]})
    return out
