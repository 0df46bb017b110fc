"""HTTP API (aiohttp): OpenAI chat/completions, completions, responses, models, healthz; Anthropic messages."""

from __future__ import annotations

import json
import time

import msgspec
from aiohttp import web

from talaria.services.gateway.anthropic_api import AnthropicApi
from talaria.services.gateway.idempotency import IdempotentCalls, answers_as, claim_for, replayed, restamp
from talaria.services.gateway.idempotency_rules import key_from
from talaria.services.gateway.big_bodies import BigBodies
from talaria.services.gateway.connection_limits import HttpLimits, body_deadline
from talaria.services.gateway.http_errors import json_errors
from talaria.services.gateway.auth import TENANT, KeyStore, client_session, http_middleware, scoped_session
from talaria.services.gateway.error_bodies import error_body, validation_error
from talaria.services.gateway.openai_api import (
    CHAT_DECODER,
    COMPLETION_DECODER,
    chat_chunk,
    chat_messages,
    chat_response,
    logit_bias,
    completion_chunk,
    completion_response,
    openai_tool_calls,
    refuse_unsupported,
    stops,
)
from talaria.shared.tool_calls import TextUntilCalls, parse_calls
from talaria.services.gateway.prepare import RequestError, prepare, tool_format
from talaria.services.gateway.responses_api import ResponsesApi
from talaria.services.gateway.session_ids import InvalidSessionId, named_session_id
from talaria.services.gateway.submitter import Submitter
from talaria.shared.catalog import Catalogue
from talaria.shared.events import CallSubmitted
from talaria.shared.messages import CallRequest, CallResult, ErrorReply, TokenChunk
from talaria.services.gateway.validation import decode

MAX_BODY_BYTES = 8 * 1024 * 1024
# Bodies above this are parsed, validated and tokenised in a worker process, not on the event
# loop: tokenising costs ~35 us/KB here, so 64 KiB is ~2 ms, about what a hop to the worker
# costs; a 3.7 MB body (130 ms) on the loop stalled every other call behind it.
OFFLOAD_BYTES = 64 * 1024


def error_response(err: ErrorReply) -> web.Response:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after_s)))
    return web.json_response(error_body(err), status=err.status, headers=headers)


def parse_request(catalogue: Catalogue, body: bytes, chat: bool, headers, tenant: str = "",
                  prefix_sharing: str = "tenant") -> tuple[CallSubmitted, bool, str | None] | ErrorReply:
    """Decode, validate and tokenise one HTTP body: (the call, include_usage, its tool-call
    format) or the 4xx reply. Pure (no I/O; the catalogue travels with the body), so it may
    run in a worker process."""
    try:
        decoded = decode(CHAT_DECODER if chat else COMPLETION_DECODER, body)
        req, include_usage = _to_call_request(decoded, chat)
        session_id = scoped_session(tenant, named_session_id(headers, decoded.user))
        call = prepare(catalogue, req, session_id, "chat" if chat else "completion", tenant, prefix_sharing)
        return call, include_usage, tool_format(catalogue, req)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return validation_error(exc)
    except InvalidSessionId as exc:
        return ErrorReply(400, "invalid_session_id", str(exc), param="X-Session-Id")
    except RequestError as exc:
        return exc.reply


class HttpApi:
    def __init__(self, submitter: Submitter, models, catalogue: Catalogue, log, keys: KeyStore | None = None,
                 prefix_sharing: str = "tenant", parser_pool=None, idempotency: IdempotentCalls | None = None,
                 body_timeout_s: float = HttpLimits.body_timeout_s) -> None:
        self.body_timeout_s = body_timeout_s
        self.submitter = submitter
        self.models = models  # callable -> list of (model, owned_by) currently served
        self.catalogue = catalogue  # the models requests may name (CommonSettings.catalogue)
        self.log = log
        self.keys = keys or KeyStore()
        self.prefix_sharing = prefix_sharing
        self.parser_pool = parser_pool  # an executor for large bodies; None: parse inline
        self.big_bodies = BigBodies(parser_pool) if parser_pool is not None else None
        self.idempotency = idempotency  # honours Idempotency-Key; None: the header is ignored

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[
            json_errors, http_middleware(self.keys), body_deadline(self.body_timeout_s)])
        app.add_routes([
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.list_models),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.healthz),
            *AnthropicApi(self.submitter, self.catalogue, self.log, self.prefix_sharing, self.idempotency).routes(),
            *ResponsesApi(self.submitter, self.catalogue, self.log, self.prefix_sharing, self.big_bodies,
                          OFFLOAD_BYTES, self.idempotency).routes(),
        ])
        return app

    async def healthz(self, request: web.Request) -> web.Response:
        """Each dependency's state; 503 until the stack can serve every configured model."""
        ready, report = self.models.readiness()
        report["models_served"] = [m for m, _ in self.models()]
        return web.json_response(report, status=200 if ready else 503)

    async def list_models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": owner} for m, owner in self.models()]
        return web.json_response({"object": "list", "data": data})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.read()
        tenant = request.get(TENANT, "")
        args = (self.catalogue, body, chat, {k: v for k, v in request.headers.items()}, tenant, self.prefix_sharing)
        if self.big_bodies is not None and len(body) > OFFLOAD_BYTES:
            parsed = await self.big_bodies.parse(tenant, parse_request, *args)
        else:
            parsed = parse_request(*args)
        if isinstance(parsed, ErrorReply):
            return error_response(parsed)
        call, include_usage, fmt = parsed
        try:
            claim = await claim_for(self.idempotency, call, key_from(request.headers))
        except RequestError as exc:
            return error_response(exc.reply)
        if isinstance(claim, ErrorReply):
            return error_response(claim)
        if claim is not None:
            call = claim.call  # a retry answers as the call it attaches to
        else:
            call = self.submitter.resolve(call)  # the streamed headers name its session
        if call.stream:
            return await self._stream(request, call, chat, include_usage, fmt, claim)
        reply = await (claim.run() if claim else self.submitter.submit(call))
        if isinstance(reply, ErrorReply):
            return error_response(reply)
        body = chat_response(self.catalogue, reply, fmt) if chat else completion_response(reply)
        return web.json_response(body, headers=_call_headers(reply, call.tenant, claim))

    async def _stream(self, request, call, chat: bool, include_usage: bool,
                      fmt: str | None = None, claim=None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Session-Id": client_session(call.tenant, call.session_id),
                                           "X-Talaria-Call-Id": call.call_id, **replayed(claim)})
        text = TextUntilCalls(fmt is not None, fmt or "hermes")  # tool calls go out whole, at the end

        async def send(obj: dict) -> None:
            if not resp.prepared:  # headers go out with the first event, so an early error keeps its status
                restamp(resp, claim, **{"X-Talaria-Call-Id": answers_as(claim, call).call_id})
                await resp.prepare(request)
                if chat:
                    role = {"role": "assistant", "content": ""}
                    await send(self._chunk(answers_as(claim, call), chat, role, None, include_usage))
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        pending: list = []  # logprobs of tokens whose text is not sent yet
        sent = 0  # logprobs sent so far

        def take_logprobs(rest: list | None = None) -> list | None:
            nonlocal sent, pending
            out = pending if rest is None else rest[sent:]
            pending = []
            sent += len(out)
            return out or None

        async def on_token(tok: TokenChunk) -> None:
            pending.extend(tok.logprobs or ())
            if piece := text.push(tok.text):
                await send(self._chunk(answers_as(claim, call), chat, piece, None, include_usage, take_logprobs()))

        reply = await (claim.run(on_token) if claim else self.submitter.submit(call, on_token=on_token))
        call = answers_as(claim, call)
        if isinstance(reply, ErrorReply):
            if not resp.prepared:
                return error_response(reply)
            await send(error_body(reply))  # mid-stream: the status is already sent
        else:
            # Tokens and the reply travel on different subjects: send whatever text the
            # stream missed, so the streamed answer always equals the final one.
            # Likewise the logprobs: the reply holds them all, the stream sent the first `sent`.
            content, calls = parse_calls(reply.text, fmt) if fmt else (reply.text, [])
            finish = reply.finish_reason
            lps = take_logprobs(reply.logprobs) if reply.logprobs is not None else None
            if calls:
                deltas = [{"index": i, **c} for i, c in enumerate(openai_tool_calls(reply.call_id, calls))]
                if rest := text.rest(content):
                    await send(self._chunk(call, chat, rest, None, include_usage, lps))
                    lps = None
                await send(self._chunk(call, chat, {"tool_calls": deltas}, None, include_usage, lps))
                await send(self._chunk(call, chat, "", "tool_calls", include_usage))
            else:
                await send(self._chunk(call, chat, text.rest(content), finish, include_usage, lps))
            if include_usage:
                final = self._chunk(call, chat, "", None, include_usage)
                final["choices"] = []
                final["usage"] = completion_response(reply)["usage"]
                await send(final)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _chunk(self, call, chat: bool, content, finish: str | None, include_usage: bool, logprobs=None) -> dict:
        if chat:
            delta = content if isinstance(content, dict) else ({"content": content} if content else {})
            body = chat_chunk(self.catalogue, call.call_id, call.model, delta, finish, logprobs)
        else:
            body = completion_chunk(call.call_id, call.model, content, finish)
        if include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body


DEFAULT_MAX_TOKENS = {True: 256, False: 16}  # chat, completion (OpenAI's legacy default)


def _to_call_request(decoded, chat: bool) -> tuple[CallRequest, bool]:
    if decoded.n != 1:
        raise RequestError(ErrorReply(400, "invalid_request", "only n=1 is supported", param="n"))
    refuse_unsupported(decoded)
    max_tokens = decoded.max_tokens
    if chat and decoded.max_completion_tokens is not None:
        max_tokens = decoded.max_completion_tokens
    common = dict(
        model=decoded.model,
        max_tokens=DEFAULT_MAX_TOKENS[chat] if max_tokens is None else max_tokens,  # 0 is refused
        temperature=decoded.temperature,
        top_p=decoded.top_p,
        seed=decoded.seed,
        stop=stops(decoded.stop),
        stream=decoded.stream,
        logit_bias=logit_bias(decoded.logit_bias),
    )
    if chat:
        common.update(logprobs=bool(decoded.logprobs), top_logprobs=decoded.top_logprobs or 0)
        chat_in = chat_messages(decoded)
        req = CallRequest(messages=chat_in.messages, tools=chat_in.tools, tool_choice=chat_in.choice,
                          forced_tool=chat_in.forced, **common)
    else:
        prompt = decoded.prompt if isinstance(decoded.prompt, str) else "".join(decoded.prompt[:1])
        if isinstance(decoded.prompt, list) and len(decoded.prompt) > 1:
            raise RequestError(ErrorReply(400, "invalid_request", "batched prompts are not supported",
                                          param="prompt"))
        req = CallRequest(prompt=prompt, **common)
    include_usage = bool(decoded.stream_options and decoded.stream_options.include_usage)
    return req, include_usage


def _call_headers(reply: CallResult, tenant: str, claim=None) -> dict[str, str]:
    return {"X-Session-Id": client_session(tenant, reply.session_id), "X-Talaria-Call-Id": reply.call_id,
            "X-Talaria-Instance": reply.instance_id, "X-Talaria-Served-At": f"{time.time():.3f}",
            **replayed(claim)}
