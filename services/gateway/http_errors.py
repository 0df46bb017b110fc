"""HTTP errors aiohttp raises itself (no such route, wrong method, body too large) answered as
JSON in the shape of the API the path belongs to, so an SDK shows the reason, not a parse error.
An exception no handler caught is answered as JSON too, never aiohttp's plain-text 500: an
OSError (a full disk, too many open files) is a retryable 503 with Retry-After."""

from __future__ import annotations

import errno

from aiohttp import web

from talaria.services.gateway.error_bodies import anthropic_error_body, error_body
from talaria.shared import logs
from talaria.shared.messages import ErrorReply

RETRY_AFTER_S = 5  # the disk check's own Retry-After (admission.py)

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
    except ConnectionError:  # the client went away mid-answer: nobody to tell (aiohttp handles it)
        raise
    except OSError as exc:  # not a bug of the request: the machine ran out of something; retry
        logs.get("gateway").error("request failed on a system error", path=request.path, error=str(exc))
        code = "insufficient_storage" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "system_error"
        reply = ErrorReply(503, code, f"the gateway hit a system error ({exc.strerror or exc}); retry later",
                           retry_after_s=RETRY_AFTER_S)
        return _json(request, reply, {"Retry-After": str(RETRY_AFTER_S)})
    except Exception as exc:
        logs.get("gateway").exception("request failed on an unexpected error", path=request.path)
        return _json(request, ErrorReply(500, "internal_error", f"internal error: {type(exc).__name__}"), {})


def _json(request: web.Request, reply: ErrorReply, headers: dict) -> web.Response:
    if request.path.startswith("/v1/messages"):
        body = anthropic_error_body(reply.status, reply.message)
    else:
        body = error_body(reply)
    return web.json_response(body, status=reply.status, headers=headers)
