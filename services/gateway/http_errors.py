"""HTTP errors aiohttp raises itself (no such route, wrong method, body too large) answered as
JSON in the shape of the API the path belongs to, so an SDK shows the reason, not a parse error."""

from __future__ import annotations

from aiohttp import web

from talaria.services.gateway.error_bodies import anthropic_error_body, error_body
from talaria.shared.messages import ErrorReply

CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        message = f"{exc.reason}: {request.method} {request.path}"
        if exc.status == 404:
            message += " (this gateway serves /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models)"
        if request.path.startswith("/v1/messages"):
            body = anthropic_error_body(exc.status, message)
        else:
            body = error_body(ErrorReply(exc.status, CODES.get(exc.status, "http_error"), message))
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return web.json_response(body, status=exc.status, headers=headers)
