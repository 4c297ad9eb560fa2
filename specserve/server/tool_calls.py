"""Tool calling on the chat endpoint: what a request's tools and tool_choice mean for its prompt, its grammar and its
answer (pure functions over the protocol models; the formats themselves are in specserve/tools/).

- tool_choice "none" (the default without tools): the tools are neither shown to the model nor parsed;
- "auto" (the default with tools): the model sees the tools and may call them; calls in its output are parsed out;
- "required": the grammar makes the output one or more calls (one when parallel_tool_calls is false), each call's
  arguments following its function's parameters schema;
- a named function: the grammar makes the output exactly one call of that function.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from specserve.frontend import RequestError
from specserve.server.protocol import ChatCompletionRequest, ChatMessage, FunctionCallOut, ToolCallOut
from specserve.tools.formats import ANY_OBJECT, Function, ParsedCall, ToolCallFormat


def tool_choice(req: ChatCompletionRequest) -> Any:
    """The request's tool_choice with OpenAI's default ("auto" with tools, "none" without); checked."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if choice != "none" and not req.tools:
        raise RequestError("tool_choice needs tools", "tool_choice")
    if not isinstance(choice, str):
        names = [t.function.name for t in req.tools]
        if choice.function.name not in names:
            raise RequestError(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                               f"tools ({', '.join(names)})", "tool_choice")
    return choice


def active_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools the chat template shows the model (as the template takes them), or None when tools are off."""
    if tool_choice(req) == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def tool_grammar(req: ChatCompletionRequest, fmt: ToolCallFormat) -> str | None:
    """The structural tag (JSON text) that forces the calls of tool_choice "required" or a named function; None for
    "auto" and "none"."""
    choice = tool_choice(req)
    if isinstance(choice, str) and choice != "required":
        return None
    tools = req.tools if choice == "required" else [t for t in req.tools if t.function.name == choice.function.name]
    functions = [Function(t.function.name, t.function.parameters if t.function.parameters is not None else ANY_OBJECT)
                 for t in tools]
    single = choice != "required" or not req.parallel_tool_calls
    return json.dumps({"type": "structural_tag", "format": fmt.grammar(functions, single)})


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as plain dicts for the chat template: text parts joined; an assistant turn's tool calls with
    their arguments as objects (what chat templates such as Qwen's and Llama's render)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        out.append(msg)
    return out


def _template_call(call) -> dict[str, Any]:
    try:
        args = json.loads(call.function.arguments)
    except ValueError as e:
        raise RequestError(f"the arguments of the tool call {call.function.name!r} are not JSON: {e}",
                           "messages") from None
    out = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out


def call_out(call: ParsedCall, index: int | None = None) -> ToolCallOut:
    """A parsed call as the answer's tool call (index: its position, for streamed deltas)."""
    return ToolCallOut(index=index, id=f"call_{uuid.uuid4().hex[:24]}",
                       function=FunctionCallOut(name=call.name, arguments=call.arguments))


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish_reason of a choice whose output made tool calls: "tool_calls" where it stopped by itself."""
    return "tool_calls" if has_calls and reason == "stop" else reason
