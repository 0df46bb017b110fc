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
from typing import Any

import msgspec
from aiohttp import web

from talaria.services.gateway.auth import TENANT, client_session, scoped_session
from talaria.services.gateway.error_bodies import anthropic_error_body
from talaria.services.gateway.idempotency import IdempotentCalls, answers_as, claim_for, replayed, restamp
from talaria.services.gateway.idempotency_rules import key_from
from talaria.services.gateway.anthropic_input import DECODER, chat_turns, session_of, to_call_request
from talaria.services.gateway.prepare import RequestError, prepare, tool_format
from talaria.services.gateway.validation import decode_bounded
from talaria.services.gateway.session_ids import InvalidSessionId
from talaria.services.gateway.submitter import Submitter
from talaria.shared.catalog import Catalogue
from talaria.shared.messages import CallRequest, CallResult, ErrorReply, TokenChunk
from talaria.shared.tool_calls import TextUntilCalls, ToolCall, parse_calls

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

    def __init__(self, submitter: Submitter, catalogue: Catalogue, log, prefix_sharing: str = "tenant",
                 idempotency: IdempotentCalls | None = None) -> None:
        self.submitter, self.log, self.prefix_sharing = submitter, log, prefix_sharing
        self.catalogue = catalogue  # the models requests may name (CommonSettings.catalogue)
        self.idempotency = idempotency

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.messages), web.post("/v1/messages/count_tokens", self.count_tokens)]

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            req = decode_bounded(DECODER, await request.read())
            chat = chat_turns(req)
            counted = CallRequest(model=req.model, messages=chat.messages, tools=chat.tools,
                                  tool_choice=chat.choice, forced_tool=chat.forced, max_tokens=1)
            call = prepare(self.catalogue, counted, "count", "anthropic", fit_max_tokens=True)
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
            call = prepare(self.catalogue, call_req, session_id, "anthropic", tenant, self.prefix_sharing,
                           fit_max_tokens=True)
            fmt = tool_format(self.catalogue, call_req)
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
        else:
            call = self.submitter.resolve(call)  # the streamed headers name its session
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
            now = answers_as(claim, call)
            restamp(resp, claim, **{"request-id": f"req_{now.call_id}"})
            await resp.prepare(request)
            message = {"id": f"msg_{now.call_id}", "type": "message", "role": "assistant", "model": now.model,
                       "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": now.prompt_tokens, "output_tokens": 0,
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
        call = answers_as(claim, call)
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
