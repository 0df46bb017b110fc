"""The Anthropic Messages API: POST /v1/messages (plain and SSE) and /v1/messages/count_tokens.

What Claude Code and the `anthropic` SDK need: `system` as a string or blocks, text,
`tool_use` and `tool_result` blocks, tools rendered into the prompt and the model's tool
calls returned as `tool_use` blocks, `stop_sequences`, `tool_choice`, usage with
`cache_read_input_tokens` (the KV prefix the engine reused), Anthropic-shaped errors, and
the session id from Claude Code's headers or `metadata.user_id`. Messages become the same
chat turns as OpenAI messages (shared/tool_calls.py), so both APIs share one prompt and one KV prefix.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from aiohttp import web
from msgspec import Struct

from talaria.services.gateway.auth import TENANT, anthropic_error_body, client_session, scoped_session
from talaria.services.gateway.idempotency import IdempotentCalls, claim_for, key_from, replayed
from talaria.services.gateway.openai_api import ChatInput
from talaria.services.gateway.prepare import RequestError, bad, prepare, tool_format
from talaria.services.gateway.validation import decode_bounded
from talaria.services.gateway.sessions import InvalidSessionId, session_id_from
from talaria.services.gateway.submitter import Submitter
from talaria.shared.messages import (
    CallRequest,
    CallResult,
    ChatMessage,
    ErrorReply,
    TokenChunk,
    ToolCallMsg,
    ToolSpec,
)
from talaria.shared.tool_calls import TextUntilCalls, ToolCall, parse_calls

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
        if m.role not in ("user", "assistant", "system"):
            raise bad(f"unexpected role {m.role!r} in messages.{i}: use 'user', 'assistant' or 'system'",
                      f"messages.{i}.role")
        if m.role == "system":  # system messages inside the conversation (Claude Code 2.x sends them)
            turns.append(ChatMessage("system", _text_of(m.content, where)))
            continue
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


def session_of(headers, metadata: Metadata | None) -> str:
    """Claude Code sends `X-Claude-Code-Session-Id`; its `metadata.user_id` also ends in
    `_session_<uuid>`. Any other user_id is taken whole, like OpenAI's `user`."""
    user = metadata.user_id if metadata else None
    if user and (m := CLAUDE_CODE_SESSION.search(user)):
        user = m.group(1)
    return session_id_from(headers, user)


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


# --------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------


def usage(result: CallResult) -> dict[str, int]:
    # Anthropic counts cached input apart: input_tokens + cache_read_input_tokens = prompt.
    u = result.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def stop_reason(result: CallResult, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_sequence else "end_turn"


def tool_use_id(call_id: str, i: int) -> str:
    return f"toolu_{call_id[:20]}_{i}"


def message_body(result: CallResult, fmt: str | None) -> dict[str, Any]:
    """`fmt`: the model's tool-call form when tools were offered (else None)."""
    text, calls = parse_calls(result.text, fmt) if fmt else (result.text, [])
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
    content += [{"type": "tool_use", "id": tool_use_id(result.call_id, i), "name": c.name, "input": c.input()}
                for i, c in enumerate(calls)]
    return {"id": f"msg_{result.call_id}", "type": "message", "role": "assistant", "model": result.model,
            "content": content, "stop_reason": stop_reason(result, calls),
            "stop_sequence": result.stop_sequence if not calls else None, "usage": usage(result)}


def error_body(err: ErrorReply) -> dict[str, Any]:
    return anthropic_error_body(err.status, err.message)


def error_response(err: ErrorReply) -> web.Response:
    headers = {"Retry-After": str(max(1, round(err.retry_after_s)))} if err.retry_after_s is not None else {}
    return web.json_response(error_body(err), status=err.status, headers=headers)


def decode_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> ErrorReply:
    if isinstance(exc, msgspec.ValidationError):
        return ErrorReply(400, "invalid_request", str(exc))
    return ErrorReply(400, "invalid_json", f"request body is not valid JSON: {exc}")


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------


class AnthropicApi:
    """Routes on the gateway's app: its middleware has checked the API key (`x-api-key` or
    `Authorization: Bearer`, auth.py) and put the tenant on the request."""

    def __init__(self, submitter: Submitter, log, prefix_sharing: str = "tenant",
                 idempotency: IdempotentCalls | None = None) -> None:
        self.submitter, self.log, self.prefix_sharing = submitter, log, prefix_sharing
        self.idempotency = idempotency

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.messages), web.post("/v1/messages/count_tokens", self.count_tokens)]

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            req = decode_bounded(DECODER, await request.read())
            chat = chat_turns(req)
            call = prepare(CallRequest(model=req.model, messages=chat.messages, tools=chat.tools,
                                       tool_choice=chat.choice, forced_tool=chat.forced, max_tokens=1),
                           "count", "anthropic", fit_max_tokens=True)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(decode_error(exc))
        except RequestError as exc:
            return error_response(exc.reply)
        return web.json_response({"input_tokens": call.prompt_tokens})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            req = decode_bounded(DECODER, await request.read())
            call_req = to_call_request(req, chat_turns(req))
            tenant = request.get(TENANT, "")
            session_id = scoped_session(tenant, session_of(request.headers, req.metadata))
            call = prepare(call_req, session_id, "anthropic", tenant, self.prefix_sharing, fit_max_tokens=True)
            fmt = tool_format(call_req)
            key = key_from(request.headers)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(decode_error(exc))
        except InvalidSessionId as exc:
            return error_response(ErrorReply(400, "invalid_session_id", str(exc)))
        except RequestError as exc:
            return error_response(exc.reply)
        claim = await claim_for(self.idempotency, call, key)
        if isinstance(claim, ErrorReply):
            return error_response(claim)
        if claim is not None:
            call = claim.call  # a retry answers as the call it attaches to
        if req.stream:
            return await self._stream(request, call, fmt, claim)
        reply = await (claim.run() if claim else self.submitter.submit(call))
        if isinstance(reply, ErrorReply):
            return error_response(reply)
        return web.json_response(message_body(reply, fmt),
                                 headers={"request-id": f"req_{reply.call_id}",
                                          "X-Session-Id": client_session(call.tenant, reply.session_id),
                                          **replayed(claim)})

    async def _stream(self, request: web.Request, call, fmt: str | None, claim=None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "request-id": f"req_{call.call_id}",
                                           "X-Session-Id": client_session(call.tenant, call.session_id),
                                           **replayed(claim)})
        text = TextUntilCalls(fmt is not None, fmt or "hermes")
        state = {"blocks": 0, "text_open": False}

        async def start() -> None:
            # Headers go out with the first event, so an error before any token keeps its status.
            if resp.prepared:
                return
            await resp.prepare(request)
            message = {"id": f"msg_{call.call_id}", "type": "message", "role": "assistant", "model": call.model,
                       "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": call.prompt_tokens, "output_tokens": 0,
                                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
            await resp.write(sse("message_start", {"type": "message_start", "message": message}))
            await resp.write(sse("ping", {"type": "ping"}))

        async def send_text(piece: str) -> None:
            await start()
            if not state["text_open"]:
                state["text_open"] = True
                await resp.write(sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                             "content_block": {"type": "text", "text": ""}}))
            if piece:
                await resp.write(sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                             "delta": {"type": "text_delta", "text": piece}}))

        async def on_token(tok: TokenChunk) -> None:
            if piece := text.push(tok.text):
                await send_text(piece)

        reply = await (claim.run(on_token) if claim else self.submitter.submit(call, on_token=on_token))
        if isinstance(reply, ErrorReply):
            if not resp.prepared:
                return error_response(reply)
            await resp.write(sse("error", error_body(reply)))  # mid-stream: the status is already sent
            await resp.write_eof()
            return resp
        content, calls = parse_calls(reply.text, fmt) if fmt else (reply.text, [])
        if rest := text.rest(content):
            await send_text(rest)
        if not state["text_open"] and not calls:
            await send_text("")  # every answer has at least one (possibly empty) text block
        await start()
        index = 0
        if state["text_open"]:
            await resp.write(sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
            index = 1
        for i, c in enumerate(calls):
            block = {"type": "tool_use", "id": tool_use_id(reply.call_id, i), "name": c.name, "input": {}}
            await resp.write(sse("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": block}))
            await resp.write(sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": {"type": "input_json_delta",
                                                                   "partial_json": c.arguments}}))
            await resp.write(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
            index += 1
        delta = {"stop_reason": stop_reason(reply, calls), "stop_sequence": None if calls else reply.stop_sequence}
        await resp.write(sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(reply)}))
        await resp.write(sse("message_stop", {"type": "message_stop"}))
        await resp.write_eof()
        return resp
