"""The agent-runtime API on NATS: request `talaria.api.call` with a CallRequest (JSON).

The reply is a CallResult or an ErrorReply (tagged by `"type"`). To stream, set
`call_id` and subscribe to `talaria.tokens.<tenant>.<call_id>` before sending the request
(`Deployment.tokens`); a tenant's NATS user may read only its own tenant's tokens and inboxes.
Send the same `idempotency_key` with each retry of a call (idempotency.py): a given
`call_id` names its first attempt; an attempt re-run after a failure gets a new id.

The gateway answers only inside the caller's own inbox space (`_INBOX.<tenant>.`, what its
tenant's NATS user must connect with): a request naming any other reply subject (another
tenant's inbox, a kept answer, a token stream) is dropped unanswered, so a tenant cannot make
the gateway write into another tenant's replies (nats_auth.reply_allowed).
"""

from __future__ import annotations

import asyncio

import msgspec

from talaria.services.gateway.auth import KeyStore, Unauthenticated, client_session, scoped_session, unauthenticated_reply
from talaria.services.gateway.idempotency import IdempotentCalls, claim_for
from talaria.services.gateway.prepare import RequestError, prepare
from talaria.services.gateway.session_ids import InvalidSessionId, check
from talaria.services.gateway.submitter import Submitter
from talaria.services.gateway.validation import decode
from talaria.shared.catalog import Catalogue
from talaria.shared.subjects import API_QUEUE_GROUP
from talaria.shared.messages import CALL_REQUEST_DECODER, CANCEL_DECODER, CallResult, ErrorReply
from talaria.shared.nats_auth import reply_allowed
from talaria.shared.wire import encode, replace


class NatsApi:
    def __init__(self, nc, submitter: Submitter, catalogue: Catalogue, log, keys: KeyStore | None = None,
                 prefix_sharing: str = "tenant", idempotency: IdempotentCalls | None = None) -> None:
        self.nc, self.submitter, self.log = nc, submitter, log
        self.catalogue = catalogue  # the models requests may name (CommonSettings.catalogue)
        self.deployment = submitter.deployment
        self.idempotency = idempotency  # honours `idempotency_key`; None: it is ignored
        self.keys, self.prefix_sharing = keys or KeyStore(), prefix_sharing
        self._tasks: set[asyncio.Task] = set()
        self._sub = self._cancel_sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.deployment.api_call, queue=API_QUEUE_GROUP, cb=self._on_msg)
        self._cancel_sub = await self.nc.subscribe(self.deployment.api_cancel, queue=API_QUEUE_GROUP,
                                                   cb=self._on_cancel)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            await self._cancel_sub.unsubscribe()
        for task in list(self._tasks):
            await task

    async def _on_msg(self, msg) -> None:
        # Each call runs as its own task: a slow call must not block the subscription.
        task = asyncio.create_task(self._handle(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _foreign(self, msg, tenant: str | None) -> bool:
        """Does this request name a reply subject outside its caller's inbox space? (Dropped.)"""
        if reply_allowed(tenant, msg.reply):
            return False
        self.log.warning("api request whose reply subject is not the caller's inbox dropped",
                         subject=msg.subject, reply=msg.reply, tenant=tenant)
        return True

    async def _on_cancel(self, msg) -> None:
        """A client's cancel: the key names the tenant, and only that tenant's call is stopped."""
        if msg.reply and self._foreign(msg, None):
            return
        try:
            cancel = decode(CANCEL_DECODER, msg.data)
            tenant = self.keys.tenant_for_key(cancel.api_key)
        except RequestError as exc:
            reply = exc.reply
        except Unauthenticated as exc:
            reply = unauthenticated_reply(exc)
        else:
            if msg.reply and self._foreign(msg, tenant):
                return
            await self.submitter.cancel(cancel.call_id, cancel.reason, tenant)
            if msg.reply:  # the agents record the outcome (`cancelled` row; the call's reply says 499)
                await self.nc.publish(msg.reply, msgspec.json.encode({"type": "cancel_sent", "call_id": cancel.call_id}))
            return
        if msg.reply:
            await self.nc.publish(msg.reply, encode(reply))

    async def _handle(self, msg) -> None:
        if not msg.reply:
            self.log.warning("api call without reply subject dropped", subject=msg.subject)
            return
        if self._foreign(msg, None):  # not even a client inbox: not even an error goes there
            return
        try:
            req = decode(CALL_REQUEST_DECODER, msg.data)
            tenant = self.keys.tenant_for_key(req.api_key)
            if self._foreign(msg, tenant):  # checked before anything runs (synchronously, in order)
                return
            session_id = check(req.session_id) if req.session_id else None
            call = prepare(self.catalogue, req, scoped_session(tenant, session_id), "nats", tenant,
                           self.prefix_sharing)
        except InvalidSessionId as exc:
            reply = ErrorReply(400, "invalid_session_id", str(exc), param="session_id")
        except RequestError as exc:
            reply = exc.reply
        except Unauthenticated as exc:
            reply = unauthenticated_reply(exc)
        except Exception as exc:  # a bug, not the input's fault: still answer, never leave it waiting
            self.log.exception("api call could not be prepared")
            reply = ErrorReply(500, "internal_error", f"the gateway could not prepare this call: {exc}")
        else:
            answered = False

            async def answer(reply) -> None:  # as soon as the call's reply is in hand
                nonlocal answered
                answered = True
                if isinstance(reply, CallResult) and call.tenant:
                    reply = replace(reply, session_id=client_session(call.tenant, reply.session_id))
                await self.nc.publish(msg.reply, encode(reply))

            claim = await claim_for(self.idempotency, call, req.idempotency_key)
            if isinstance(claim, ErrorReply):
                reply = claim
            else:
                reply = await (claim.run(on_reply=answer) if claim else self.submitter.submit(call, on_reply=answer))
            if not answered:
                await answer(reply)
            return
        await self.nc.publish(msg.reply, encode(reply))
