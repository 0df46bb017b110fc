"""OpenAI Responses API request bodies (`POST /v1/responses`) as chat turns and a CallRequest.

Stateless: this server keeps no responses, so a client sends the whole conversation in
`input` each turn (Codex CLI does, with `store: false`). `input` is a string or a list of
items: messages (`input_text` / `output_text` parts), the assistant's earlier
`function_call`s and their `function_call_output`s. They become the same chat turns as the
chat completions API makes (a function call joins the assistant message before it, as
`tool_calls` do), so one conversation gives one prompt and one KV prefix through either API.
Whatever this server cannot honour is refused with a 400 naming the field, never ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from talaria.services.gateway.openai_api import ROLES, TEXT_PART_TYPES, ChatInput
from talaria.services.gateway.validation import bad
from talaria.shared.messages import CallRequest, ChatMessage, ToolCallMsg, ToolSpec


class Part(Struct, forbid_unknown_fields=False):
    type: str
    text: str = ""


class InputItem(Struct, forbid_unknown_fields=False):
    """One input item; which fields matter depends on `type` (a bare {role, content} is a message)."""

    type: str = "message"
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    namespace: str | None = None  # function_call: the namespace tool it belongs to
    output: str | list[Part] | None = None  # function_call_output


class ResponseTool(Struct, forbid_unknown_fields=False):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: arguments are the model's text, parsed, not constrained
    tools: list[ResponseTool] | None = None  # a namespace's functions


class ToolChoiceIn(Struct, forbid_unknown_fields=False):
    type: str
    name: str | None = None


class TextFormat(Struct, forbid_unknown_fields=False):
    type: str = "text"


class TextConfig(Struct, forbid_unknown_fields=False):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted: a hint for models that have one


class ResponsesRequest(Struct, forbid_unknown_fields=False):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: str | ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    text: TextConfig | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    prompt: Any = None  # a stored prompt template: refused (nothing is stored here)
    reasoning: Any = None  # accepted: these models produce no reasoning items
    prompt_cache_key: str | None = None  # Codex CLI sends its conversation id here
    user: str | None = None


DECODER = msgspec.json.Decoder(ResponsesRequest)

# `include` values we can honour: we never emit reasoning items, so there is nothing to encrypt.
INCLUDABLE = ("reasoning.encrypted_content",)
SKIPPED_ITEMS = ("reasoning",)  # our own output never has them; a client may echo others' back
MAX_METADATA = (16, 64, 512)  # OpenAI's bounds: pairs, key length, value length


def refuse_unsupported(req: ResponsesRequest) -> None:
    def unsupported(field: str, why: str) -> None:
        raise bad(f"`{field}` is not supported: {why}", field, "unsupported_parameter")

    stateless = "this server keeps no responses; send the whole conversation in `input` (with `store: false`)"
    if req.previous_response_id:
        unsupported("previous_response_id", stateless)
    if req.store:
        unsupported("store", stateless)
    if req.conversation is not None:
        unsupported("conversation", stateless)
    if req.prompt is not None:
        unsupported("prompt", "this server stores no prompt templates")
    if req.background:
        unsupported("background", "responses are served while the client waits")
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        unsupported("text.format", f"only 'text' output, not {req.text.format.type!r}")
    if req.truncation not in (None, "disabled"):
        unsupported("truncation", "input is never truncated here; a prompt that does not fit is refused")
    if req.top_logprobs:
        unsupported("top_logprobs", "logprobs are served by /v1/chat/completions")
    for value in req.include or []:
        if value not in INCLUDABLE:
            unsupported("include", f"{value!r} (this server can include: {', '.join(INCLUDABLE)})")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad("`max_output_tokens` must be at least 1", "max_output_tokens")
    pairs, key_len, value_len = MAX_METADATA
    meta = req.metadata or {}
    if len(meta) > pairs or any(len(k) > key_len or len(v) > value_len for k, v in meta.items()):
        raise bad(f"`metadata` takes at most {pairs} pairs, keys up to {key_len} and values up to "
                  f"{value_len} characters", "metadata")


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for p in content:
        if p.type not in TEXT_PART_TYPES:
            raise bad(f"content part type {p.type!r} is not supported (input_text and output_text only)",
                      where, "unsupported_content")
    return "".join(p.text for p in content)


def chat_input(req: ResponsesRequest) -> ChatInput:
    """`instructions` and `input` as chat turns, with the tools and tool choice."""
    turns: list[ChatMessage] = [ChatMessage("system", req.instructions)] if req.instructions else []
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if not items:
        raise bad("`input` must not be empty", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            role = ROLES.get(item.role or "")
            if role not in ("system", "user", "assistant"):
                raise bad(f"unknown role {item.role!r} in {where}; expected user, assistant, system or developer",
                          f"{where}.role")
            turns.append(ChatMessage(role, _text(item.content, f"{where}.content")))
        elif item.type == "function_call":
            if not item.name or not item.call_id:
                raise bad(f"a function_call needs `name` and `call_id` ({where})", where)
            call = ToolCallMsg(qualified(item.namespace, item.name), item.arguments or "{}", item.call_id)
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant":  # the message it came with, as in chat
                turns[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or []), call])
            else:
                turns.append(ChatMessage("assistant", "", tool_calls=[call]))
        elif item.type == "function_call_output":
            if not item.call_id:
                raise bad(f"a function_call_output needs the `call_id` it answers ({where})", f"{where}.call_id")
            turns.append(ChatMessage("tool", _text(item.output, f"{where}.output"), tool_call_id=item.call_id))
        elif item.type not in SKIPPED_ITEMS:
            raise bad(f"input item type {item.type!r} is not supported (message, function_call, "
                      "function_call_output)", f"{where}.type", "unsupported_content")
    choice, forced = tool_choice(req.tool_choice)
    return ChatInput(turns, tools(req.tools or []) or None, choice, forced)


def tools(given: list[ResponseTool]) -> list[ToolSpec]:
    """Function tools, and the functions of `namespace` tools under qualified names
    (`namespace.name`: the model calls them so, the answer splits them back)."""
    out = []

    def function(t: ResponseTool, where: str, namespace: ResponseTool | None = None) -> None:
        if t.type != "function":
            raise bad(f"tool type {t.type!r} is not supported: this server runs no hosted tools; give `function` "
                      "tools (Codex CLI: web_search = \"disabled\" in config.toml)", f"{where}.type",
                      "unsupported_tool")
        if not t.name:
            raise bad("a function tool needs a `name`", f"{where}.name")
        if namespace is None:
            out.append(ToolSpec(t.name, t.description or "", t.parameters or {}))
        else:
            about = " ".join(d for d in (namespace.description, t.description) if d)
            out.append(ToolSpec(qualified(namespace.name, t.name), about, t.parameters or {}))

    for i, t in enumerate(given):
        if t.type == "namespace" and t.name:
            for j, inner in enumerate(t.tools or []):
                function(inner, f"tools[{i}].tools[{j}]", t)
        else:
            function(t, f"tools[{i}]")
    return out


def qualified(namespace: str | None, name: str) -> str:
    return f"{namespace}.{name}" if namespace else name


def namespaces(given: list[ResponseTool] | None) -> list[str]:
    """The namespaces whose functions the model may call (see `tools`)."""
    return [t.name for t in given or [] if t.type == "namespace" and t.name]


def tool_choice(choice: str | ToolChoiceIn | None) -> tuple[str, str | None]:
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, ToolChoiceIn) and choice.type == "function" and choice.name:
        return "tool", choice.name
    shown = choice if isinstance(choice, str) else choice.type
    raise bad(f"unknown tool_choice {shown!r}: auto, none, required or {{type: function, name}}", "tool_choice")


# Without `max_output_tokens` OpenAI lets the answer run to the context's end, but here the
# engine reserves KV for prompt + max tokens up front and the router places a call only where
# that fits beside the KV already held: asking for the whole context made a Codex session's
# second call unplaceable (its first call's KV still held; measured, docs/api.md). So the default
# is what Claude Code asks of /v1/messages whatever the model, cut to the context left.
DEFAULT_MAX_OUTPUT_TOKENS = 32_000


def to_call_request(req: ResponsesRequest, chat: ChatInput) -> CallRequest:
    """Without `max_output_tokens` the caller lets prepare(fit_max_tokens=True) cut the
    default to what the prompt leaves of the context."""
    return CallRequest(model=req.model, messages=chat.messages, tools=chat.tools, tool_choice=chat.choice,
                       forced_tool=chat.forced, max_tokens=req.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS,
                       temperature=1.0 if req.temperature is None else req.temperature,
                       top_p=1.0 if req.top_p is None else req.top_p, stream=req.stream)


def echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request fields a Response object repeats back."""
    choice = req.tool_choice or "auto"
    return {
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "tools": msgspec.to_builtins(req.tools or []),
        "tool_choice": choice if isinstance(choice, str) else msgspec.to_builtins(choice),
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": None,
        "store": False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "user": req.user,
    }
