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
from talaria.shared.messages import MAX_TOKEN_LEN, CallRequest, CallSubmitted, ErrorReply
from talaria.shared.tokenizer import block_hashes, encode, render_chat

__all__ = ["RequestError", "bad", "prepare"]


def prepare(req: CallRequest, session_id: str, api: str, tenant: str = "", sharing: str = "tenant") -> CallSubmitted:
    """`session_id` is already scoped to `tenant` (auth.scoped_session)."""
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
        text = render_chat([(m.role, m.content) for m in req.messages])
    else:
        text = req.prompt or ""
    check_request(req)
    call_id = req.call_id or uuid.uuid4().hex
    if not subjects.valid_token(call_id) or len(call_id) > MAX_TOKEN_LEN or not call_id.isprintable():
        raise bad("`call_id` must be a NATS subject token (no '.', '*', '>' or spaces)", "call_id")
    ids = encode(text)
    scope = kv_scope(sharing, tenant, session_id)
    if len(ids) + req.max_tokens > spec.context_length:
        raise RequestError(
            ErrorReply(
                400,
                "context_length_exceeded",
                f"This model's maximum context length is {spec.context_length} tokens. However, you "
                f"requested {len(ids) + req.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{req.max_tokens} for the completion).",
                param="messages" if req.messages is not None else "prompt",
            )
        )
    return CallSubmitted(
        call_id=call_id,
        session_id=session_id,
        model=req.model,
        prompt_ids=ids,
        block_hashes=block_hashes(ids, scope=scope),
        max_tokens=req.max_tokens,
        submitted_at=time.time(),
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=list(req.stop),
        stream=req.stream,
        api=api,
        tenant=tenant,
        kv_scope=scope,
    )
