"""Turn a validated request into a CallSubmitted, or an ErrorReply saying what is wrong.

Shared by the HTTP and the NATS APIs so both apply the same rules.
"""

from __future__ import annotations

import time
import uuid
from functools import lru_cache

from talaria.services.gateway.auth import kv_scope, scoped_session
from talaria.services.gateway.session_ids import anonymous_id
from talaria.services.gateway.validation import RequestError, bad, check_request
from talaria.shared import subjects
from talaria.shared.catalog import Catalogue
from talaria.shared.events import CallSubmitted
from talaria.shared.messages import CallRequest, ErrorReply
from talaria.shared.wire import MAX_TOKEN_LEN
from talaria.shared import tokenizer as byte_tok
from talaria.shared.model_text import DemoBpeText, text_for
from talaria.shared.tokenizer import block_hashes

__all__ = ["RequestError", "bad", "prepare", "tool_format"]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def tool_format(catalogue: Catalogue, req: CallRequest) -> str | None:
    """The form the model writes tool calls in, when the request offers tools (else None)."""
    spec = catalogue.get(req.model)
    if spec is None or not req.tools or req.tool_choice == "none":
        return None
    return text_for(spec).tool_format


# A normalizer (NFKC and kin) may shrink text before it is tokenised, at most a 4-byte UTF-8
# character to one byte (mathematical alphanumerics -> ASCII).
NORMALIZER_SHRINK = 4
# The demo BPE is tokenised piece by piece, so a prompt is refused as soon as its count passes
# the context: a piece's size sets only how much is tokenised past that point, not the result.
PIECE_CHARS = 64 * 1024


@lru_cache(maxsize=None)
def _bytes_per_token_bound(model_text) -> int:
    """Input bytes one token can cover at most, read off the tokenizer's vocabulary: the
    longest token's UTF-8 spelling (for byte-level BPE an over-estimate, as its characters
    stand for one byte each), times the normalizer's shrink. 1 for the byte tokenizer."""
    tok = getattr(model_text, "tok", None)
    if tok is None:
        return 1
    longest = max(len((tok.id_to_token(i) or "").encode()) for i in range(tok.get_vocab_size(with_added_tokens=True)))
    return max(1, longest) * (NORMALIZER_SHRINK if tok.normalizer is not None else 1)


def prompt_tokens_at_least(model_text, text: str) -> int:
    """A lower bound on the tokens of `text`, without tokenising it (bytes / the most bytes a
    token covers)."""
    return -(-len(text.encode("utf-8", "surrogatepass")) // _bytes_per_token_bound(model_text))


def word_pieces(text: str, size: int = PIECE_CHARS):
    """`text` in pieces of about `size` characters, each cut right before a space that follows
    a non-space. GPT-2's pre-tokenizer regex (the demo BPE's) never runs a pre-token across
    such a space, so the pieces' tokens, joined, are the text's tokens. A run with no such
    space stays one piece."""
    start = 0
    while len(text) - start > size:
        cut = start + size
        while cut < len(text) and not (text[cut] == " " and not text[cut - 1].isspace()):
            cut += 1
        yield text[start:cut]
        start = cut
    yield text[start:]


def encode_within(model_text, text: str, chat: bool, budget: int) -> list[int] | None:
    """The prompt's ids, or None once they are known to pass `budget` (issue 25: a 7.9 MB body
    was tokenised whole, 6-11 s, before the context check refused it). The byte tokenizer's
    count is its length; the demo BPE counts piece by piece and stops; another tokenizer is
    refused by the bound from its bytes, else tokenised whole."""
    if prompt_tokens_at_least(model_text, text) > budget:
        return None
    if isinstance(model_text, DemoBpeText):
        ids = [byte_tok.BOS]
        for piece in word_pieces(text):
            ids += model_text.tok.encode(piece, add_special_tokens=False).ids
            if len(ids) > budget:
                return None
        return ids
    return model_text.encode(text, chat=chat)


def _too_long(spec, prompt: int, max_tokens: int, exact: bool, param: str) -> RequestError:
    prompt_text = f"{prompt} in the prompt" if exact else f"at least {prompt} in the prompt"
    return RequestError(ErrorReply(
        400, "context_length_exceeded",
        f"This model's maximum context length is {spec.context_length} tokens. However, you "
        f"requested {'' if exact else 'at least '}{prompt + max_tokens} tokens ({prompt_text}, "
        f"{max_tokens} for the completion).", param=param))


def prepare(catalogue: Catalogue, req: CallRequest, session_id: str | None, api: str, tenant: str = "",
            sharing: str = "tenant", fit_max_tokens: bool = False) -> CallSubmitted:
    """`catalogue`: the models this gateway serves by name (CommonSettings.catalogue).
    `session_id` is already scoped to `tenant` (auth.scoped_session); None when the client
    named none: the call is "pending" until the Submitter infers its session, and its block
    hashes are salted without a session so that inference can match them. `fit_max_tokens`: a
    prompt that fits gets `max_tokens` cut to the context left (Anthropic clients such as
    Claude Code ask for 32,000 whatever the model), instead of a 400."""
    spec = catalogue.get(req.model)
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
    else:
        text = req.prompt or ""
    param = "messages" if req.messages is not None else "prompt"
    budget = spec.context_length - (1 if fit_max_tokens else req.max_tokens)  # the most prompt tokens that fit
    ids = encode_within(model_text, text, req.messages is not None, budget)
    if ids is None:  # past the budget; a max_tokens past the context leaves it below 1
        at_least = max(budget + 1, prompt_tokens_at_least(model_text, text), 1)
        raise _too_long(spec, at_least, req.max_tokens, exact=False, param=param)
    check_request(req, spec.vocab_size)
    call_id = req.call_id or uuid.uuid4().hex
    if not subjects.valid_token(call_id) or len(call_id) > MAX_TOKEN_LEN or not call_id.isprintable():
        raise bad("`call_id` must be a NATS subject token (no '.', '*', '>' or spaces)", "call_id")
    origin = "named"
    if session_id is None:
        session_id, origin = scoped_session(tenant, anonymous_id()), "pending"
        if sharing == "session":  # salted again once the session is known (SessionInferrer)
            sharing = "tenant"
    scope = kv_scope(sharing, tenant, session_id)
    max_tokens = req.max_tokens
    if fit_max_tokens and len(ids) < spec.context_length:
        max_tokens = min(max_tokens, spec.context_length - len(ids))
    if len(ids) + max_tokens > spec.context_length:
        raise _too_long(spec, len(ids), max_tokens, exact=True, param=param)
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
        session_origin=origin,
    )
