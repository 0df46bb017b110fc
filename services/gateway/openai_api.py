"""OpenAI request bodies (validated with msgspec) and response shapes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import Struct

from talaria.services.gateway.validation import bad
from talaria.shared import tokenizer as byte_tok
from talaria.shared.catalog import Catalogue
from talaria.shared.messages import CallResult, ChatMessage, TokenLogprob, ToolCallMsg, ToolSpec
from talaria.shared.model_text import text_for
from talaria.shared.tool_calls import ToolCall, parse_calls


TEXT_PART_TYPES = ("text", "input_text", "output_text")


class TextPart(Struct, forbid_unknown_fields=False):
    type: str
    text: str = ""


class FunctionCallIn(Struct, forbid_unknown_fields=False):
    name: str
    arguments: str = "{}"


class ToolCallIn(Struct, forbid_unknown_fields=False):
    function: FunctionCallIn
    id: str = ""
    type: str = "function"


class ChatMessageIn(Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.type in TEXT_PART_TYPES)


class FunctionDef(Struct, forbid_unknown_fields=False):
    name: str
    description: str = ""
    parameters: dict[str, Any] = {}


class ToolDef(Struct, forbid_unknown_fields=False):
    function: FunctionDef
    type: str = "function"


class NamedFunction(Struct, forbid_unknown_fields=False):
    name: str


class ToolChoiceNamed(Struct, forbid_unknown_fields=False):
    function: NamedFunction
    type: str = "function"


class ResponseFormat(Struct, forbid_unknown_fields=False):
    type: str = "text"


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
    presence_penalty: float = 0.0  # typed so a string is a 400; anything but 0 is refused (not implemented)
    frequency_penalty: float = 0.0


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = []
    max_completion_tokens: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | ToolChoiceNamed | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] = ""
    logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)


def stops(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool", "function": "tool"}


PENALTIES = ("presence_penalty", "frequency_penalty")


def refuse_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Fields we do not implement get a 400 naming them: silently ignoring one would hand
    the client an answer it did not ask for. (Chat's `logprobs`/`top_logprobs` and both
    APIs' `logit_bias` are implemented; the legacy completions `logprobs` is not.)"""
    if isinstance(req, CompletionRequest) and req.logprobs:
        raise bad("`logprobs` is not supported on /v1/completions (use chat completions)", "logprobs",
                  "unsupported_parameter")
    for name in PENALTIES:
        value = getattr(req, name)
        if not -2.0 <= value <= 2.0:
            raise bad(f"`{name}` must be between -2 and 2", name)
        if value != 0.0:
            raise bad(f"`{name}` is not supported by this server (only 0)", name, "unsupported_parameter")
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        raise bad(f"`response_format` {fmt.type!r} is not supported by this server (only 'text')",
                  "response_format", "unsupported_parameter")
    if isinstance(req, CompletionRequest):
        if req.echo or req.suffix or (req.best_of or 1) != 1:
            field = "echo" if req.echo else "suffix" if req.suffix else "best_of"
            raise bad(f"`{field}` is not supported by this server", field, "unsupported_parameter")


@dataclass(frozen=True)
class ChatInput:
    """A chat request's turns and tools, as the model's chat template takes them."""

    messages: list[ChatMessage]
    tools: list[ToolSpec] | None
    choice: str = "auto"  # auto | required | none | tool
    forced: str | None = None



def chat_messages(req: ChatCompletionRequest) -> ChatInput:
    """OpenAI messages as chat turns, keeping assistant tool calls and tool results."""
    turns: list[ChatMessage] = []
    for i, m in enumerate(req.messages):
        role = ROLES.get(m.role)
        if role is None:
            raise bad(f"unknown role {m.role!r} in messages[{i}]; expected one of: {', '.join(ROLES)}",
                      f"messages[{i}].role")
        if m.content is None and not (role == "assistant" and m.tool_calls):
            # OpenAI: only an assistant turn that calls tools may leave its content null
            raise bad(f"messages[{i}].content must be a string or a list of text parts (null only in an "
                      "assistant message with tool_calls)", f"messages[{i}].content")
        if isinstance(m.content, list):
            for part in m.content:
                if part.type not in TEXT_PART_TYPES:
                    raise bad(f"content part type {part.type!r} is not supported (text only)",
                              f"messages[{i}].content", "unsupported_content")
        calls = [ToolCallMsg(c.function.name, c.function.arguments, c.id) for c in m.tool_calls or []]
        turns.append(ChatMessage(role, m.text(), tool_calls=calls or None,
                                 tool_call_id=m.tool_call_id if role == "tool" else None,
                                 name=m.name if role == "tool" else None))
    choice, forced = "auto", None
    if isinstance(req.tool_choice, ToolChoiceNamed):
        choice, forced = "tool", req.tool_choice.function.name
    elif req.tool_choice in ("required", "none"):
        choice = req.tool_choice
    elif req.tool_choice not in (None, "auto"):
        raise bad(f"unknown tool_choice {req.tool_choice!r}", "tool_choice")
    tools = [ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in req.tools or []]
    return ChatInput(turns, tools or None, choice, forced)


def logit_bias(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` keys are token ids written as strings (bounds: shared/limits.py)."""
    if not value:
        return None
    try:
        return {int(k): float(v) for k, v in value.items()}
    except ValueError:
        raise bad("`logit_bias` keys must be token ids (integers)", "logit_bias") from None


def token_bytes(catalogue: Catalogue, model: str, token_id: int) -> bytes:
    """The bytes one token stands for (special tokens as their name; b"" if the model is unknown)."""
    spec = catalogue.get(model)
    if spec is None:
        return b""
    text = text_for(spec)
    tok = getattr(text, "tok", None)
    if tok is not None:
        return tok.decode([token_id], skip_special_tokens=False).encode()
    if token_id < 256:
        return bytes([token_id])  # byte-level: a token may be part of a UTF-8 character
    return {byte_tok.BOS: b"<|bos|>", byte_tok.EOS: b"<|end|>"}.get(token_id, b"")


def logprobs_content(catalogue: Catalogue, model: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """`choices[i].logprobs` in OpenAI's chat shape, or None when the call did not ask."""
    if logprobs is None:
        return None

    def entry(tid: int, lp: float) -> dict[str, Any]:
        raw = token_bytes(catalogue, model, tid)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}

    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, v) for i, v in zip(t.top_ids, t.top_logprobs)]}
                        for t in logprobs], "refusal": None}


def openai_tool_calls(call_id: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": f"call_{call_id[:16]}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


def usage(result: CallResult) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def chat_response(catalogue: Catalogue, result: CallResult, tool_format: str | None = None) -> dict[str, Any]:
    """`catalogue` spells the logprobs' tokens; `tool_format`: the model's tool-call form when
    tools were offered (else None)."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    finish = result.finish_reason
    if tool_format:
        content, calls = parse_calls(result.text, tool_format)
        if calls:
            message = {"role": "assistant", "content": content or None,
                       "tool_calls": openai_tool_calls(result.call_id, calls)}
            finish = "tool_calls"
    return {
        "id": f"chatcmpl-{result.call_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": result.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": logprobs_content(catalogue, result.model, result.logprobs),
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


def chat_chunk(catalogue: Catalogue, call_id: str, model: str, delta: dict, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{call_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                     "logprobs": logprobs_content(catalogue, model, logprobs)}],
    }


def completion_chunk(call_id: str, model: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": f"cmpl-{call_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }
