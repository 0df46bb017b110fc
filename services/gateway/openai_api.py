"""OpenAI request bodies (validated with msgspec) and response shapes."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from msgspec import Struct

from talaria.shared.messages import CallResult, ErrorReply


class TextPart(Struct, forbid_unknown_fields=False):
    type: str
    text: str = ""


class ChatMessageIn(Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.type in ("text", "input_text"))


class StreamOptions(Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class _Common(Struct, forbid_unknown_fields=False):
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default; send 0 for greedy
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = []
    max_completion_tokens: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] = ""


CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)


def stops(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def usage(result: CallResult) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def chat_response(result: CallResult) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{result.call_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": result.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": result.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage(result),
        "system_fingerprint": None,
    }


def completion_response(result: CallResult) -> dict[str, Any]:
    return {
        "id": f"cmpl-{result.call_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": result.model,
        "choices": [
            {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
        ],
        "usage": usage(result),
    }


def chat_chunk(call_id: str, model: str, delta: dict, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{call_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def completion_chunk(call_id: str, model: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": f"cmpl-{call_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
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


def validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> ErrorReply:
    """msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`": name that field."""
    text = str(exc)
    param = None
    if "at `$." in text:
        param = text.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return ErrorReply(400, "invalid_json", f"request body is not valid JSON: {text}")
    return ErrorReply(400, "invalid_request", text, param=param)
