"""The OpenAI Responses API: POST /v1/responses, plain and streamed (what Codex CLI speaks).

A request becomes chat turns (responses_input.py) and then goes the chat path's way:
prepare() checks sampling and the context and tokenises, the submitter runs the call, the
model's tool calls are parsed in its own form. The answer is a Response object whose output
is a `message` item (one `output_text` part) and/or `function_call` items; streamed, it is
the documented event sequence (response.created ... response.completed), each event with
its `sequence_number`. An answer cut by `max_output_tokens` (or the context's end) is
`incomplete`, as OpenAI reports it. Errors are OpenAI-shaped JSON.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from talaria.services.gateway.auth import TENANT, client_session, scoped_session
from talaria.services.gateway.error_bodies import error_body
from talaria.services.gateway.openai_api import openai_tool_calls
from talaria.services.gateway.prepare import RequestError, prepare, tool_format
from talaria.services.gateway.responses_input import (DECODER, chat_input, echo, namespaces, refuse_unsupported,
                                                      to_call_request)
from talaria.services.gateway.session_ids import InvalidSessionId, named_session_id
from talaria.services.gateway.idempotency import IdempotentCalls, answers_as, claim_for, replayed, restamp
from talaria.services.gateway.idempotency_rules import key_from
from talaria.services.gateway.submitter import Submitter
from talaria.services.gateway.validation import decode
from talaria.shared.catalog import Catalogue
from talaria.shared.events import CallSubmitted
from talaria.shared.messages import CallResult, ErrorReply, TokenChunk
from talaria.shared.tool_calls import TextUntilCalls, ToolCall, parse_calls
from talaria.shared.wire import replace

# prepare() names the chat fields; a Responses client knows them by these names.
PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}


@dataclass(frozen=True)
class Parsed:
    call: CallSubmitted
    fmt: str | None  # the model's tool-call form when tools are offered
    fields: dict  # the request fields a Response repeats
    namespaces: tuple[str, ...] = ()  # namespace tools: their functions' calls are named `ns.name`


def parse_request(catalogue: Catalogue, body: bytes, headers: dict[str, str], tenant: str = "",
                  prefix_sharing: str = "tenant") -> Parsed | ErrorReply:
    """Decode, validate and tokenise one body, or say what is wrong (a 4xx reply). Pure
    (no I/O; the catalogue travels with the body), so it may run in a worker process."""
    try:
        req = decode(DECODER, body)
        refuse_unsupported(req)
        call_req = to_call_request(req, chat_input(req))
        # Codex CLI sends a `session-id` header, and its conversation id as `prompt_cache_key`.
        session_id = scoped_session(tenant, named_session_id(headers, req.prompt_cache_key or req.user))
        call = prepare(catalogue, call_req, session_id, "responses", tenant, prefix_sharing,
                       fit_max_tokens=req.max_output_tokens is None)
        return Parsed(call, tool_format(catalogue, call_req), echo(req), tuple(namespaces(req.tools)))
    except InvalidSessionId as exc:
        return ErrorReply(400, "invalid_session_id", str(exc), param="session_id")
    except RequestError as exc:
        reply = exc.reply
        return replace(reply, param=PARAM_NAMES.get(reply.param, reply.param)) if reply.param else reply


# --------------------------------------------------------------------------------------
# Response objects
# --------------------------------------------------------------------------------------


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(call_id: str, text: str | None, status: str) -> dict[str, Any]:
    """`text` None: the item as first announced, before any part."""
    return {"id": f"msg_{call_id}", "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def function_call_items(call_id: str, calls: list[ToolCall], namespaces: tuple[str, ...] = (),
                        status: str = "completed") -> list[dict[str, Any]]:
    items = []
    for i, c in enumerate(openai_tool_calls(call_id, calls)):
        name = c["function"]["name"]
        item = {"id": f"fc_{call_id}_{i}", "type": "function_call", "status": status, "call_id": c["id"],
                "name": name, "arguments": c["function"]["arguments"]}
        space, _, short = name.partition(".")
        if short and space in namespaces:  # a namespace tool's function, named `namespace.name` to the model
            item.update(name=short, namespace=space)
        items.append(item)
    return items


def outcome(result: CallResult, calls: list[ToolCall]) -> str:
    """`incomplete` when generation stopped at the token limit before finishing its answer."""
    return "incomplete" if result.finish_reason == "length" and not calls else "completed"


def usage(result: CallResult) -> dict[str, Any]:
    u = result.usage
    return {"input_tokens": u.prompt_tokens,
            # cached: the KV prefix the engine reused; no explicit cache writes (reuse is automatic)
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def response_body(call: CallSubmitted, fields: dict, status: str, output: list[dict[str, Any]],
                  result: CallResult | None = None, error: ErrorReply | None = None) -> dict[str, Any]:
    body = {"id": f"resp_{call.call_id}", "object": "response", "created_at": int(call.submitted_at),
            "status": status, "model": call.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": usage(result) if result is not None else None, **fields}
    if status == "completed":
        body["completed_at"] = int(time.time())
    if error is not None:  # Response.error's codes: a rate limit, or the server's fault
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        body["error"] = {"code": code, "message": f"{error.message} ({error.code})"}
    return body


def result_body(parsed: Parsed, result: CallResult) -> dict[str, Any]:
    content, calls = parse_calls(result.text, parsed.fmt) if parsed.fmt else (result.text, [])
    status = outcome(result, calls)
    output = [message_item(result.call_id, content, status)] if content or not calls else []
    output += function_call_items(result.call_id, calls, parsed.namespaces)
    return response_body(parsed.call, parsed.fields, status, output, result)


def error_response(err: ErrorReply) -> web.Response:
    headers = {"Retry-After": str(max(1, round(err.retry_after_s)))} if err.retry_after_s is not None else {}
    return web.json_response(error_body(err), status=err.status, headers=headers)


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------


class ResponsesApi:
    """Routes on the gateway's app: its middleware has checked the API key and put the
    tenant on the request. Bodies over `offload_bytes` are parsed in `parser_pool` (big_bodies.BigBodies)."""

    def __init__(self, submitter: Submitter, catalogue: Catalogue, log, prefix_sharing: str = "tenant",
                 parser_pool=None, offload_bytes: int = 0, idempotency: IdempotentCalls | None = None) -> None:
        self.submitter, self.log, self.prefix_sharing = submitter, log, prefix_sharing
        self.catalogue = catalogue  # the models requests may name (CommonSettings.catalogue)
        self.parser_pool, self.offload_bytes = parser_pool, offload_bytes
        self.idempotency = idempotency  # honours Idempotency-Key; None: the header is ignored

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", self.create)]

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        tenant = request.get(TENANT, "")
        args = (self.catalogue, body, dict(request.headers.items()), tenant, self.prefix_sharing)
        if self.parser_pool is not None and len(body) > self.offload_bytes:  # a BigBodies
            parsed = await self.parser_pool.parse(tenant, parse_request, *args)
        else:
            parsed = parse_request(*args)
        if isinstance(parsed, ErrorReply):
            return error_response(parsed)
        try:
            claim = await claim_for(self.idempotency, parsed.call, key_from(request.headers))
        except RequestError as exc:
            return error_response(exc.reply)
        if isinstance(claim, ErrorReply):
            return error_response(claim)
        if claim is not None:
            parsed = dataclasses.replace(parsed, call=claim.call)  # a retry answers as the call it attaches to
        else:  # the streamed headers name its session
            parsed = dataclasses.replace(parsed, call=self.submitter.resolve(parsed.call))
        call = parsed.call
        if call.stream:
            return await ResponseStream(request, parsed, claim).run(self.submitter)
        reply = await (claim.run() if claim else self.submitter.submit(call))
        if isinstance(reply, ErrorReply):
            return error_response(reply)
        return web.json_response(result_body(parsed, reply), headers={
            "X-Session-Id": client_session(call.tenant, reply.session_id), "X-Talaria-Call-Id": reply.call_id,
            "X-Talaria-Instance": reply.instance_id, **replayed(claim)})


class ResponseStream:
    """One streamed response: text deltas as tokens arrive (held back at a tool call's start),
    then the finished items and response.completed. Headers go out with the first event, so a
    call refused before any token keeps its HTTP status."""

    def __init__(self, request: web.Request, parsed: Parsed, claim=None) -> None:
        self.request, self._call, self.fmt = request, parsed.call, parsed.fmt
        self.fields, self.namespaces, self.claim = parsed.fields, parsed.namespaces, claim
        self.resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Session-Id": client_session(self.call.tenant, self.call.session_id),
            "X-Talaria-Call-Id": self.call.call_id, **replayed(claim)})
        self.text = TextUntilCalls(self.fmt is not None, self.fmt or "hermes")
        self.seq = itertools.count()
        self.message_open = False

    @property
    def call(self):
        return answers_as(self.claim, self._call)

    @property
    def item_id(self) -> str:
        return f"msg_{self.call.call_id}"

    async def run(self, submitter: Submitter) -> web.StreamResponse:
        async def on_token(tok: TokenChunk) -> None:
            if piece := self.text.push(tok.text):
                await self._text(piece)

        reply = await (self.claim.run(on_token) if self.claim else submitter.submit(self.call, on_token=on_token))
        if isinstance(reply, ErrorReply):
            if not self.resp.prepared:
                return error_response(reply)
            await self._send("response.failed",
                             response=response_body(self.call, self.fields, "failed", [], error=reply))
        else:
            await self._finish(reply)
        await self.resp.write_eof()
        return self.resp

    async def _send(self, kind: str, **fields: Any) -> None:
        if not self.resp.prepared:
            restamp(self.resp, self.claim, **{"X-Talaria-Call-Id": self.call.call_id})
            await self.resp.prepare(self.request)
            start = response_body(self.call, self.fields, "in_progress", [])
            await self._send("response.created", response=start)
            await self._send("response.in_progress", response=start)
        data = json.dumps({"type": kind, "sequence_number": next(self.seq), **fields}, ensure_ascii=False)
        await self.resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

    async def _text(self, piece: str) -> None:
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if not self.message_open:
            self.message_open = True
            await self._send("response.output_item.added", output_index=0,
                             item=message_item(self.call.call_id, None, "in_progress"))
            await self._send("response.content_part.added", part=output_text(""), **at)
        if piece:
            await self._send("response.output_text.delta", delta=piece, logprobs=[], **at)

    async def _finish(self, reply: CallResult) -> None:
        # Tokens and the reply travel on different subjects: send whatever text the stream
        # missed, so the streamed answer always equals the final one.
        content, calls = parse_calls(reply.text, self.fmt) if self.fmt else (reply.text, [])
        status = outcome(reply, calls)
        if (rest := self.text.rest(content)) or not calls:
            await self._text(rest)
        output = []
        if self.message_open:
            at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
            await self._send("response.output_text.done", text=content, logprobs=[], **at)
            await self._send("response.content_part.done", part=output_text(content), **at)
            output.append(message_item(reply.call_id, content, status))
            await self._send("response.output_item.done", output_index=0, item=output[0])
        for item in function_call_items(reply.call_id, calls, self.namespaces):
            index, at = len(output), {"item_id": item["id"], "output_index": len(output)}
            await self._send("response.output_item.added", output_index=index,
                             item={**item, "status": "in_progress", "arguments": ""})
            await self._send("response.function_call_arguments.delta", delta=item["arguments"], **at)
            await self._send("response.function_call_arguments.done", name=item["name"],
                             arguments=item["arguments"], **at)
            await self._send("response.output_item.done", output_index=index, item=item)
            output.append(item)
        await self._send(f"response.{status}",
                         response=response_body(self.call, self.fields, status, output, reply))
