"""The gateway's shell around SessionIndex: before a call that named no session is submitted
it gets the session it continues (or a new one), its KV scope and, under `session` sharing,
its block hashes salted again; once answered, the call is remembered as its session's newest
turn, or, when it failed, the turn it continued is handed back for the client's retry."""

from __future__ import annotations

import time
from collections.abc import Callable

from talaria.services.gateway.auth import kv_scope, scoped_session
from talaria.services.gateway.session_ids import anonymous_id
from talaria.services.gateway.session_inference import ANSWER_TOKENS, Inferred, SessionIndex
from talaria.shared.catalog import Catalogue
from talaria.shared.events import CallSubmitted
from talaria.shared.messages import CallResult, Reply
from talaria.shared.metrics import FrontendMetrics
from talaria.shared.model_text import text_for
from talaria.shared.tokenizer import block_hashes
from talaria.shared.wire import replace

# The answer's head is tokenised from its first characters only: ANSWER_TOKENS tokens never
# cover more than this in the built-in or common tokenizers, and the rest is never looked at.
ANSWER_CHARS = 64 * ANSWER_TOKENS


class SessionInferrer:
    def __init__(self, catalogue: Catalogue, sharing: str = "tenant", metrics: FrontendMetrics | None = None,
                 index: SessionIndex | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.catalogue, self.sharing, self.clock = catalogue, sharing, clock
        self.metrics = metrics
        self.index = index or SessionIndex()
        self._claims: dict[str, tuple[Inferred, list[int]]] = {}  # call id -> decision, hashes it matched on
        self._lead: dict[str, list[int]] = {}  # model -> what its encoder puts before any text (BOS)

    def resolve(self, call: CallSubmitted) -> CallSubmitted:
        """`call` with its session settled; a named or already settled call as it is."""
        if call.session_origin != "pending":
            return call
        if call.call_id in self._claims:  # a duplicate call id, refused by the Submitter: claims nothing
            return replace(call, session_origin="new")
        hashes = call.block_hashes  # prepare() salted a pending call's hashes without a session
        got = self.index.infer(call.tenant, hashes, call.prompt_ids, self.clock(),
                               scoped_session(call.tenant, anonymous_id()))
        scope = got.kv_scope if got.kv_scope is not None else kv_scope(self.sharing, call.tenant, got.session_id)
        salted = hashes if scope == call.kv_scope else block_hashes(call.prompt_ids, scope=scope)
        self._claims[call.call_id] = (got, hashes)
        if self.metrics is not None:
            self.metrics.sessions_inferred.labels(got.kind).inc()
        return replace(call, session_id=got.session_id, session_origin=got.kind, kv_scope=scope, block_hashes=salted)

    def settle(self, call: CallSubmitted, reply: Reply | None) -> None:
        """After `call`'s reply (None: its client went away)."""
        claim = self._claims.pop(call.call_id, None)
        if claim is None:
            return
        got, hashes = claim
        if isinstance(reply, CallResult) and reply.text:
            self.index.record(call.tenant, call.session_id, hashes, call.prompt_ids,
                              self.answer_ids(call.model, reply.text), call.kv_scope, self.clock())
        else:
            self.index.release(call.tenant, got)

    def answer_ids(self, model: str, text: str) -> list[int]:
        """The answer's first tokens as the next prompt holds them (without the BOS the model's
        encoder puts first)."""
        spec = self.catalogue.get(model)
        if spec is None:
            return []
        model_text = text_for(spec)
        lead = self._lead.get(model)
        if lead is None:
            lead = self._lead[model] = model_text.encode("", chat=False)
        ids = model_text.encode(text[:ANSWER_CHARS], chat=False)
        return ids[len(lead):ANSWER_TOKENS + len(lead)] if ids[:len(lead)] == lead else ids[:ANSWER_TOKENS]
