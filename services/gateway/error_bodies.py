"""Error bodies in each API's own shape: OpenAI's `{"error": {...}}` and Anthropic's
`{"type": "error", "error": {...}}`, and a decode error as the ErrorReply that names its field."""

from __future__ import annotations

from typing import Any

import msgspec

from talaria.shared.messages import ErrorReply

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


def error_body(err: ErrorReply) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": ERROR_TYPES.get(err.status, "server_error"),
            "param": err.param,
            "code": err.code,
        }
    }


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error shape, for an Anthropic-style API."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
            422: "invalid_request_error",
            429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> ErrorReply:
    """msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`": name that field."""
    text = str(exc)
    param = None
    if "at `$." in text:
        param = text.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
    elif text.startswith("Object missing required field `"):  # a top-level field: name it
        param = text.split("`")[1]
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return ErrorReply(400, "invalid_json", f"request body is not valid JSON: {text}")
    return ErrorReply(400, "invalid_request", text, param=param)
