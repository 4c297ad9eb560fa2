"""Pydantic models of the HTTP protocol: OpenAI's chat/completions requests and responses, SGLang's native
``/generate`` request, and the OpenAI error body.

Requests are validated strictly (a string where a number belongs is an error, not a coercion) and answer
400 with the OpenAI error body; unknown fields of the OpenAI requests are ignored (clients send vendor
extras), unknown fields of the native request are rejected (as SGLang's dataclass does).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, WithJsonSchema, model_serializer

from specserve.frontend import WEIGHT_VERSION
from specserve.sampling.params import ALIASES, UNSUPPORTED_FIELDS, SamplingParams

MAX_N = 128
MAX_TOP_LOGPROBS = 20


def _only(*allowed: Any, why: str = "is not supported by this server"):
    """A field SGLang accepts that specserve does not honour (yet): its "off" values pass, anything else is a 400
    naming the field, so a request never silently loses what it asked for. The OpenAPI document lists the
    values it accepts."""
    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(f"{why} (accepted: {', '.join(repr(a) for a in allowed)})")
        return value
    return Annotated[Any, AfterValidator(check), WithJsonSchema({"enum": list(allowed), "description": why})]


_Off = _only(None)
_OffBool = _only(None, False)


# ---------------------------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``: the schema the output follows (``strict`` is always honoured)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag (SGLang's): its triggered form (structures, triggers) or its format form (format)
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OffExtras(BaseModel):
    """SGLang request fields of both APIs that specserve does not honour yet: their off values only."""

    lora_path: _Off = None
    custom_logit_processor: _Off = None
    return_hidden_states: _OffBool = False
    return_routed_experts: _OffBool = False
    session_params: _Off = None
    priority: _Off = None
    extra_key: _only(None, "") = None
    cache_salt: _only(None, "") = None


class _SamplingFields(_Strict, _OffExtras):
    """The sampling fields both OpenAI endpoints share, OpenAI's and SGLang's extras."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_token_ids: list[int] | None = None
    rid: str | None = None
    # structured outputs: OpenAI's response_format, SGLang's grammar extras (at most one of them)
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None
    # SGLang extras specserve does not honour yet (and those of _OffExtras): refused unless off
    custom_params: _Off = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the JSON schema of the arguments (None: any object)
    strict: bool | None = None  # the arguments always follow parameters when the grammar forces the call


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False  # the last (assistant) message is continued, not answered
    separate_reasoning: bool = True  # no reasoning parser runs: there is never reasoning to separate
    stream_reasoning: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: _only(None, why="reasoning controls are not supported") = None
    input_ids: _only(None, why="use /v1/completions or /generate for token-id prompts") = None
    return_token_ids: _OffBool = False
    return_prompt_token_ids: _OffBool = False
    return_meta_info: _OffBool = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    return_token_ids: _OffBool = False


def _sampling_params_schema() -> dict:
    """The JSON schema of /generate's sampling_params (one dict, or one per prompt): the keys
    ``SamplingParams.from_dict`` reads (it validates them, not this model), SGLang's aliases, and the SGLang
    keys accepted only as null."""
    fields = TypeAdapter(SamplingParams).json_schema()["properties"]
    keys = {f.name: fields[f.name] for f in dataclasses.fields(SamplingParams) if f.init}
    keys |= {alias: keys[name] for alias, name in ALIASES.items()}
    keys |= {name: {"enum": [None], "description": why} for name, why in UNSUPPORTED_FIELDS.items()}
    one = {"type": "object", "properties": keys, "additionalProperties": False}
    return {"anyOf": [one, {"type": "array", "items": one}, {"type": "null"}]}


class GenerateRequest(_OffExtras):
    """SGLang's native ``/generate`` input (``GenerateReqInput``): its fields, with SGLang's defaults; the ones
    specserve does not honour yet are accepted only at their off value."""

    model_config = ConfigDict(strict=True, extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: Annotated[dict[str, Any] | list[dict[str, Any]] | None,
                               WithJsonSchema(_sampling_params_schema())] = None
    stream: bool = False
    rid: str | list[str] | None = None
    # logprobs: one value, or a list of one per prompt
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    temp_scaled_logprobs: bool = False
    return_prompt_token_ids: bool = False
    log_metrics: bool = True
    no_logs: bool = False  # specserve logs no request content either way
    model: str | None = None  # sglang-router sends it; the one served model answers
    # not honoured (yet): off values only (and those of _OffExtras)
    input_embeds: _Off = None
    image_data: _Off = None
    video_data: _Off = None
    audio_data: _Off = None
    modalities: _Off = None
    lora_id: _Off = None
    routed_experts_start_len: _only(None, 0) = 0
    bootstrap_host: _Off = None
    bootstrap_port: _Off = None
    bootstrap_room: _Off = None
    bootstrap_pair_key: _Off = None
    data_parallel_rank: _only(None, 0) = None
    routed_dp_rank: _only(None, 0) = None
    custom_labels: _Off = None
    background: _OffBool = False
    return_bytes: _OffBool = False
    return_entropy: _OffBool = False

    def logprob_fields(self) -> dict[str, Any]:
        """The request-level logprob fields as ``prepare_requests`` takes them (None / False: not given)."""
        return {"return_logprob": self.return_logprob, "logprob_start_len": self.logprob_start_len,
                "top_logprobs_num": self.top_logprobs_num, "token_ids_logprob": self.token_ids_logprob,
                "return_text_in_logprobs": self.return_text_in_logprobs or None,
                "temp_scaled_logprobs": self.temp_scaled_logprobs or None}


class TokenizeRequest(_Strict):
    """SGLang's /tokenize (and /v1/tokenize): a prompt (or prompts), or chat messages to render first."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[Tool] | None = None  # rendered into the chat template with the messages


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = True


class AbortRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    rid: str | None = None
    abort_all: bool = False


# ---------------------------------------------------------------------------------------------- responses
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: a prompt's first token (echo)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    """A tool call of an answer, or (streamed) of a delta: a streamed call comes whole in one delta."""

    index: int | None = None  # streamed deltas only
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metadata: dict[str, str] = Field(default_factory=lambda: {"weight_version": WEIGHT_VERSION})  # as SGLang's


class DeltaMessage(BaseModel):
    """A streamed message delta: only the fields it carries are sent (as OpenAI does)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metadata: dict[str, str] = Field(default_factory=lambda: {"weight_version": WEIGHT_VERSION})  # as SGLang's


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
