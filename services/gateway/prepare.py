"""Turn a validated request into a CallSubmitted, or an ErrorReply saying what is wrong.

Shared by the HTTP and the NATS APIs so both apply the same rules.
"""

from __future__ import annotations

import time
import uuid

from talaria.services.gateway.auth import kv_scope
from talaria.services.gateway.validation import RequestError, bad, check_request
from talaria.shared import subjects
from talaria.shared.catalog import CATALOG
from talaria.shared.events import CallSubmitted
from talaria.shared.messages import CallRequest, ErrorReply
from talaria.shared.wire import MAX_TOKEN_LEN
from talaria.shared.model_text import text_for
from talaria.shared.tokenizer import block_hashes

__all__ = ["RequestError", "bad", "prepare", "tool_format"]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def tool_format(req: CallRequest) -> str | None:
    """The form the model writes tool calls in, when the request offers tools (else None)."""
    spec = CATALOG.get(req.model)
    if spec is None or not req.tools or req.tool_choice == "none":
        return None
    return text_for(spec).tool_format


def prepare(req: CallRequest, session_id: str, api: str, tenant: str = "", sharing: str = "tenant",
            fit_max_tokens: bool = False) -> CallSubmitted:
    """`session_id` is already scoped to `tenant` (auth.scoped_session). `fit_max_tokens`: a
    prompt that fits gets `max_tokens` cut to the context left (Anthropic clients such as
    Claude Code ask for 32,000 whatever the model), instead of a 400."""
    spec = CATALOG.get(req.model)
    if spec is None:
        raise RequestError(
            ErrorReply(404, "model_not_found", f"The model `{req.model}` does not exist.", param="model")
        )
    if (req.messages is None) == (req.prompt is None):
        raise bad("give exactly one of `messages` or `prompt`", "messages")
    if req.messages is not None:
        if not req.messages:
            raise bad("`messages` must not be empty", "messages")
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise bad(f"unknown role {m.role!r} in messages[{i}]; expected one of: {', '.join(CHAT_ROLES)}",
                          f"messages[{i}].role")
    model_text = text_for(spec)
    if req.tool_choice not in ("auto", "required", "none", "tool") or (req.tool_choice == "tool") != bool(
            req.forced_tool):
        raise bad("`tool_choice` is auto, required, none, or tool with `forced_tool`", "tool_choice")
    if req.messages is not None:
        try:
            text = model_text.render(req.messages, req.tools, req.tool_choice, req.forced_tool)
        except Exception as exc:  # a template that raises (e.g. roles out of order) fails this call
            raise bad(f"the chat template of `{req.model}` refused these messages: {exc}", "messages") from None
        ids = model_text.encode(text, chat=True)
    else:
        ids = model_text.encode(req.prompt or "", chat=False)
    check_request(req, spec.vocab_size)
    call_id = req.call_id or uuid.uuid4().hex
    if not subjects.valid_token(call_id) or len(call_id) > MAX_TOKEN_LEN or not call_id.isprintable():
        raise bad("`call_id` must be a NATS subject token (no '.', '*', '>' or spaces)", "call_id")
    scope = kv_scope(sharing, tenant, session_id)
    max_tokens = req.max_tokens
    if fit_max_tokens and len(ids) < spec.context_length:
        max_tokens = min(max_tokens, spec.context_length - len(ids))
    if len(ids) + max_tokens > spec.context_length:
        raise RequestError(
            ErrorReply(
                400,
                "context_length_exceeded",
                f"This model's maximum context length is {spec.context_length} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion).",
                param="messages" if req.messages is not None else "prompt",
            )
        )
    return CallSubmitted(
        call_id=call_id,
        session_id=session_id,
        model=req.model,
        prompt_ids=ids,
        block_hashes=block_hashes(ids, scope=scope),
        max_tokens=max_tokens,
        submitted_at=time.time(),
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=list(req.stop),
        stream=req.stream,
        api=api,
        tenant=tenant,
        kv_scope=scope,
        logit_bias=dict(req.logit_bias) if req.logit_bias else None,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
    )
