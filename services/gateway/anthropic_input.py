"""Anthropic Messages API request side: the body's shape and its translation into chat turns
and a CallRequest (Claude Code's session headers included). The HTTP handlers and answers
are in anthropic_api.py."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from msgspec import Struct

from talaria.services.gateway.openai_api import ChatInput
from talaria.services.gateway.prepare import bad
from talaria.services.gateway.session_ids import named_session_id
from talaria.shared.messages import CallRequest, ChatMessage, ToolCallMsg, ToolSpec

# --------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------


class Block(Struct, forbid_unknown_fields=False):
    """One content block; which fields matter depends on `type`."""

    type: str
    text: str = ""
    id: str = ""
    name: str = ""
    input: Any = None
    tool_use_id: str = ""
    content: str | list[Block] | None = None  # a tool_result's content
    is_error: bool = False
    cache_control: Any = None  # accepted: prefix reuse is automatic


class MessageIn(Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[Block]


class ToolIn(Struct, forbid_unknown_fields=False):
    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused


class ToolChoice(Struct, forbid_unknown_fields=False):
    type: str  # auto | any | tool | none
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(Struct, forbid_unknown_fields=False):
    user_id: str | None = None


class OutputConfig(Struct, forbid_unknown_fields=False):
    effort: str | None = None  # accepted: a hint these models have no use for
    format: Any = None  # structured output: refused, not ignored


class MessagesRequest(Struct, forbid_unknown_fields=False):
    model: str
    messages: list[MessageIn]
    max_tokens: int | None = None  # required by /v1/messages, not by count_tokens
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: Any = None  # accepted; these models produce no thinking blocks
    output_config: OutputConfig | None = None


DECODER = msgspec.json.Decoder(MessagesRequest)

SKIPPED_BLOCKS = ("thinking", "redacted_thinking")  # our own answers never contain them


# --------------------------------------------------------------------------------------
# Messages -> chat turns
# --------------------------------------------------------------------------------------


def _text_of(content: str | list[Block] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for b in content:
        if b.type == "text":
            parts.append(b.text)
        elif b.type not in SKIPPED_BLOCKS:
            raise bad(f"content block type {b.type!r} is not supported in {where}", where, "unsupported_content")
    return "".join(parts)


def chat_turns(req: MessagesRequest) -> ChatInput:
    """Anthropic messages as chat turns (the same ones the OpenAI API makes): tool_use blocks
    become the assistant's tool calls, each tool_result a `tool` turn."""
    turns: list[ChatMessage] = []
    if req.system:
        turns.append(ChatMessage("system", _text_of(req.system, "system")))
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if m.role == "system":  # at its position, applying from there on (Claude Code 2.1.197 sends one)
            turns.append(ChatMessage("system", _text_of(m.content, where)))
            continue
        if m.role not in ("user", "assistant"):
            raise bad(f"unexpected role {m.role!r} in messages.{i}: use 'user', 'assistant' or 'system'",
                      f"messages.{i}.role")
        blocks = [Block("text", m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            text, calls = [], []
            for b in blocks:
                if b.type == "text":
                    text.append(b.text)
                elif b.type == "tool_use":
                    args = json.dumps(b.input if b.input is not None else {}, ensure_ascii=False)
                    calls.append(ToolCallMsg(b.name, args, b.id))
                elif b.type not in SKIPPED_BLOCKS:
                    raise bad(f"content block type {b.type!r} is not supported in an assistant message",
                              where, "unsupported_content")
            turns.append(ChatMessage("assistant", "".join(text), tool_calls=calls or None))
            continue
        pending: list[str] = []  # user text between tool results
        for b in blocks:
            if b.type == "text":
                pending.append(b.text)
            elif b.type == "tool_result":
                if pending:
                    turns.append(ChatMessage("user", "".join(pending)))
                    pending = []
                result = _text_of(b.content, where)
                turns.append(ChatMessage("tool", f"Error: {result}" if b.is_error else result,
                                         tool_call_id=b.tool_use_id))
            elif b.type not in SKIPPED_BLOCKS:
                raise bad(f"content block type {b.type!r} is not supported (text, tool_use and "
                          "tool_result only)", where, "unsupported_content")
        if pending or not blocks:
            turns.append(ChatMessage("user", "".join(pending)))
    tools = _tools(req.tools or [])
    choice = req.tool_choice.type if req.tool_choice else "auto"
    if choice == "none":
        return ChatInput(turns, tools or None, "none")
    return ChatInput(turns, tools or None, *_choice(req.tool_choice))


def _tools(tools: list[ToolIn]) -> list[ToolSpec]:
    out = []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom") or t.input_schema is None:
            raise bad(f"tool {t.name!r} of type {t.type!r} is a server tool, which this server does not run; "
                      "give client tools with an `input_schema`", f"tools.{i}", "unsupported_tool")
        out.append(ToolSpec(t.name, t.description, t.input_schema))
    return out


def _choice(choice: ToolChoice | None) -> tuple[str, str | None]:
    if choice is None or choice.type == "auto":
        return "auto", None
    if choice.type == "any":
        return "required", None
    if choice.type == "tool":
        if not choice.name:
            raise bad("tool_choice of type 'tool' needs a `name`", "tool_choice.name")
        return "tool", choice.name
    raise bad(f"unknown tool_choice type {choice.type!r}: auto, any, tool or none", "tool_choice.type")


CLAUDE_CODE_SESSION = re.compile(r"_session_([0-9A-Za-z-]+)$")


def session_of(headers, metadata: Metadata | None) -> str | None:
    """Claude Code sends `X-Claude-Code-Session-Id`; its `metadata.user_id` also ends in
    `_session_<uuid>`. Any other user_id is taken whole, like OpenAI's `user`. None: unnamed."""
    user = metadata.user_id if metadata else None
    if user and (m := CLAUDE_CODE_SESSION.search(user)):
        user = m.group(1)
    return named_session_id(headers, user)


def to_call_request(req: MessagesRequest, chat: ChatInput) -> CallRequest:
    if req.max_tokens is None:
        raise bad("`max_tokens` is required", "max_tokens")
    if not 0.0 <= req.temperature <= 1.0:
        raise bad("`temperature` must be between 0 and 1", "temperature")
    if req.top_k is not None:
        raise bad("`top_k` is not supported by this server", "top_k", "unsupported_parameter")
    if req.output_config is not None and req.output_config.format is not None:
        raise bad("structured output (`output_config.format`) is not supported by this server",
                  "output_config.format", "unsupported_parameter")
    return CallRequest(model=req.model, messages=chat.messages, tools=chat.tools, tool_choice=chat.choice,
                       forced_tool=chat.forced, max_tokens=req.max_tokens, temperature=req.temperature,
                       top_p=1.0 if req.top_p is None else req.top_p, stop=list(req.stop_sequences or []),
                       stream=req.stream)
