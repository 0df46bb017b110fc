"""Submit calls on the event stream and wait for their replies (and streamed tokens).

Every accepted call ends in exactly one reply: the agent's CallResult, the router's
ErrorReply, or, if neither comes within the call timeout, a 504 that the gateway
also records as a CallFailed event. Nothing accepted is lost silently.

A reply is a core-NATS message, which a broker restart (or a cut connection) can drop on its
way to the gateway. Replies are kept, so nothing waits for the timeout for that: the stream
REPLIES_STREAM keeps every reply on a gateway inbox for twice the call timeout (a keyed call's
kept answer lives in the idempotency stream), and when the gateway's connection comes back it
looks up the reply of every call still waiting (`recover`). An agent whose connection dropped
after replying publishes its replies again (instance_agent/record_sender.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from opentelemetry import trace

from talaria.services.gateway.admission import Admission, DiskCheck
from talaria.services.gateway.call_flow import CallFlow
from talaria.services.gateway.idempotency_rules import is_outcome_subject, reply_call_id
from talaria.services.gateway.session_inferrer import SessionInferrer
from talaria.services.gateway.validation import check_size
from talaria.shared.logs import call_context
from talaria.shared.metrics import FrontendMetrics
from talaria.shared.nats_auth import ANSWERING_ROLES, SENDER_HEADER, STREAMING_ROLES, sender_of, sent_by
from talaria.shared.bus import (BUS_ERRORS, 
    FAILOVER_S, RECONNECT_WAIT_S, REPLIES_DISK_SHARE, deployment_of, disk_cap, emit, emit_new, ensure_stream_config,
    replicas, written,
)
from talaria.shared.events import CallFailed, CallSubmitted
from talaria.shared.messages import (
    CANCELLED_STATUS,
    CallResult,
    CancelCall,
    ErrorReply,
    REPLY_DECODER,
    Reply,
    TOKEN_DECODER,
    TokenChunk,
)
from talaria.shared.wire import encode, replace
from talaria.shared.tracing import (
    call_span_name,
    error_attributes,
    request_attributes,
    result_attributes,
    session_context,
    trace_id_hex,
)

TokenCallback = Callable[[TokenChunk], Awaitable[None]]
ReplyCallback = Callable[[Reply], Awaitable[None]]


class Submitter:
    def __init__(self, nc: NATS, js: JetStreamContext, tracer: trace.Tracer, timeout_s: float, log,
                 admission: Admission | None = None, disk: DiskCheck | None = None,
                 metrics: FrontendMetrics | None = None, sessions: SessionInferrer | None = None) -> None:
        self.nc, self.js, self.tracer, self.timeout_s, self.log = nc, js, tracer, timeout_s, log
        self.admission, self.disk = admission, disk  # None: every call is admitted
        self.metrics = metrics or FrontendMetrics()
        self.sessions = sessions  # infers the session of calls that name none; None: each is its own
        self.deployment = deployment_of(js)  # the deployment its connection was opened for
        self.inbox = f"{self.deployment.live_replies}.{uuid.uuid4().hex}"  # only agents and the router may publish here
        self.flow = CallFlow()  # readiness: red from an unanswered call until one is answered
        self._pending: dict[str, asyncio.Future[Reply]] = {}
        self._calls: dict[str, CallSubmitted] = {}  # accepted and still waiting, for stop()
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_reply)
        # A reply is read by the gateway waiting for it, at most until the call's deadline:
        # twice the timeout covers clock skew between the agent and the gateway.
        config = StreamConfig(name=self.deployment.replies_stream, subjects=[f"{self.deployment.live_replies}.*.*"],
                              retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                              discard=DiscardPolicy.OLD, max_age=2 * self.timeout_s, max_msgs_per_subject=1,
                              max_bytes=disk_cap(self.js, REPLIES_DISK_SHARE), num_replicas=replicas(self.js))
        await ensure_stream_config(self.js, config)

    async def recover(self) -> int:
        """After the connection to NATS came back: answer every waiting call whose reply was
        kept meanwhile (it was published while this gateway was cut off). Returns how many.

        A lookup that fails (not "no such reply": the stream has no leader while a cluster
        elects one, or the server is still coming back) is tried again, backing off, for up
        to FAILOVER_S: the reply is kept there and nothing else would fetch it (seen: a
        follower killed under load, the lookup timed out and the call ran into its 504)."""
        loop = asyncio.get_running_loop()
        deadline, wait = loop.time() + FAILOVER_S, 0.05
        found, todo = 0, list(self._calls)
        while todo:
            failed: dict[str, str] = {}
            for call_id in todo:
                call, fut = self._calls.get(call_id), self._pending.get(call_id)
                if call is None or fut is None or fut.done():
                    continue
                stream = (self.deployment.idempotency_stream if is_outcome_subject(call.reply_to)
                          else self.deployment.replies_stream)
                try:
                    raw = await self.js.get_last_msg(stream, call.reply_to)
                except NotFoundError:
                    continue  # not answered yet: the answer comes live (the agent sends it again too)
                except BUS_ERRORS as exc:
                    failed[call_id] = str(exc) or type(exc).__name__
                    continue
                await self._on_reply(raw)
                found += fut.done()
            todo = list(failed)
            if todo and loop.time() + wait > deadline:
                for call_id, error in failed.items():
                    self.log.warning("could not look up a kept reply", call_id=call_id, error=error)
                break
            if todo:
                await asyncio.sleep(wait)  # no event says "the stream has a leader again"
                wait = min(2 * wait, RECONNECT_WAIT_S)
        if found:
            self.log.info("replies recovered after a reconnect", calls=found)
        return found

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        for call_id, fut in list(self._pending.items()):
            if not fut.done():
                fut.set_result(ErrorReply(503, "gateway_stopping", "the gateway is shutting down",
                                          retry_after_s=1.0, call_id=call_id))
        # Record each as failed: a call not placed yet is then never placed (its client has
        # its 503 and retries), even when the router consumes the submission after a restart.
        # Not a call with an idempotency key: its client's retry attaches to it, so it runs on.
        for call in list(self._calls.values()):
            if is_outcome_subject(call.reply_to):
                continue
            try:
                await emit(self.js, CallFailed(call.call_id, call.session_id, call.model, "the gateway stopped",
                                               "gateway", time.time(), status=503))
            except BUS_ERRORS as exc:
                self.log.error("could not record a call cut off by the stop", call_id=call.call_id, error=str(exc))

    async def _on_reply(self, msg) -> None:
        """A reply (live, or a kept one looked up by `recover`: both have subject, data, headers)."""
        call_id = reply_call_id(msg.subject)
        fut = self._pending.get(call_id)
        if fut is None or fut.done():
            return
        if not sent_by(msg.headers, ANSWERING_ROLES):  # only the router or an agent answers a call
            self.log.warning("reply not from the router or an agent dropped", call_id=call_id,
                             sender=sender_of(msg))
            return
        self.flow.answered(time.monotonic())
        try:
            fut.set_result(REPLY_DECODER.decode(msg.data))
        except msgspec.DecodeError as exc:
            self.log.error("undecodable reply", call_id=call_id, error=str(exc))
            fut.set_result(ErrorReply(502, "bad_reply", f"undecodable reply from the serving instance: {exc}"))

    def refusal(self, call: CallSubmitted) -> ErrorReply | None:
        """Would `call` be refused now (disk, or load or its tenant's share of work: admission.py)?"""
        if self.disk is not None and (refused := self.disk.refusal()) is not None:
            return refused
        if self.admission is None:
            return None
        work = self.admission.work_s(call.model, call.prompt_tokens)
        return self.admission.refusal(call.tenant, work, time.monotonic())

    def resolve(self, call: CallSubmitted) -> CallSubmitted:
        """`call` with its session settled (session_inferrer.py); submit() does it too, the APIs
        earlier when a response header names the session before the reply."""
        if self.sessions is not None:
            return self.sessions.resolve(call)
        return replace(call, session_origin="new") if call.session_origin == "pending" else call

    async def submit(self, call: CallSubmitted, on_token: TokenCallback | None = None,
                     on_reply: ReplyCallback | None = None) -> Reply:
        """The call's reply. `on_reply`, when given, gets the answer of a submitted call as
        soon as it is in hand, ahead of the gateway's own logging and span (the NATS API
        forwards it from there); a call refused before submission is only returned."""
        call = self.resolve(call)
        with call_context(call.session_id, call.call_id):
            watch = self.metrics.call(call.model, call.api)
            if on_token is not None:
                on_token = _timed(on_token, watch)
            reply: Reply | None = None
            try:
                reply = await self._submit(call, on_token, on_reply)
                return reply
            finally:  # no reply: the client went away (499, as for a cancel)
                if self.sessions is not None:
                    self.sessions.settle(call, reply)
                if isinstance(reply, CallResult):
                    watch.answered(200, reply.usage, reply.timings)
                else:
                    watch.answered(reply.status if reply is not None else CANCELLED_STATUS)

    async def _submit(self, call: CallSubmitted, on_token: TokenCallback | None,
                      on_reply: ReplyCallback | None) -> Reply:
        if call.call_id in self._pending:
            return ErrorReply(409, "duplicate_call_id", f"call {call.call_id} is already in flight",
                              param="call_id", call_id=call.call_id)
        # The deadline rides with the call: past it nobody reads the answer, so agents drop it.
        # A call with an idempotency key comes with its reply subject (its answer is kept there).
        kept = is_outcome_subject(call.reply_to)
        call = replace(call, reply_to=call.reply_to if kept else f"{self.inbox}.{call.call_id}",
                       deadline_at=call.deadline_at or call.submitted_at + self.timeout_s)
        data = encode(call)  # once: its size is checked on the bytes that are published
        too_large = check_size(call, self.nc.max_payload, data)
        if too_large is not None:  # permanent: retrying cannot make it fit
            return too_large
        refused = self.disk.refusal() if self.disk is not None else None
        work = self.admission.work_s(call.model, call.prompt_tokens) if self.admission is not None else 0.0
        if refused is None and self.admission is not None:
            refused = self.admission.admit(call.tenant, time.monotonic(), work)
        if refused is not None:  # nothing was submitted: the client retries after Retry-After
            if refused.code == "insufficient_storage":  # ready again only once a call is answered
                self.flow.stalled(refused.message, time.monotonic())
            self.log.warning("call refused", code=refused.code, reason=refused.message)
            return replace(refused, call_id=call.call_id)
        started, reply = time.monotonic(), None
        try:
            reply = await self._admitted(call, data, kept, on_token, on_reply)
            return reply
        finally:
            if self.admission is not None:
                self.admission.done(call.tenant, reply, time.monotonic() - started, time.monotonic(), work,
                                    call.model)

    async def _admitted(self, call: CallSubmitted, data: bytes, kept: bool, on_token: TokenCallback | None,
                        on_reply: ReplyCallback | None) -> Reply:
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[call.call_id] = fut
        token_sub = reply_sub = None
        with self.tracer.start_as_current_span(
            call_span_name(call.api, call.model), context=session_context(call.session_id),
            kind=trace.SpanKind.SERVER, attributes=request_attributes(call),
        ) as span:
            try:
                if kept:
                    reply_sub = await self.nc.subscribe(call.reply_to, cb=self._on_reply)
                if on_token is not None:
                    token_sub = await self.nc.subscribe(
                        self.deployment.tokens(call.tenant, call.call_id), cb=self._token_handler(on_token)
                    )
                try:
                    if await emit_new(self.js, call, data) is None:
                        return ErrorReply(409, "duplicate_call_id",
                                          f"call {call.call_id} was already submitted", param="call_id",
                                          call_id=call.call_id)
                except BUS_ERRORS as exc:  # the bus refused: the call was never accepted
                    self.log.error("submit failed", call_id=call.call_id, error=str(exc))
                    self.flow.stalled(f"the bus refused a call: {exc or type(exc).__name__}", time.monotonic())
                    return ErrorReply(503, "bus_unavailable", f"could not submit the call: {exc}",
                                      retry_after_s=1.0, call_id=call.call_id)
                self._calls[call.call_id] = call
                try:  # to its deadline, not a full timeout from here: submitting may have taken a failover
                    reply = await asyncio.wait_for(fut, max(0.0, call.deadline_at - time.time()))
                except TimeoutError:
                    self.flow.stalled(f"no reply to a call by its deadline ({self.timeout_s:.0f}s)", time.monotonic())
                    reply = await self.timed_out(call, f"no reply by the call's deadline ({self.timeout_s:.0f}s)")
                except asyncio.CancelledError:  # the client went away (HTTP disconnect)
                    if not kept:  # with a key, a retry may attach: Claim.run gives it a grace first
                        await self.cancel(call.call_id, "client disconnected", call.tenant)
                    raise
                if on_reply is not None:  # the client's answer leaves before the bookkeeping below
                    await on_reply(reply)
                    await written()
                _annotate(span, reply)
                if isinstance(reply, CallResult):
                    self.log.info("call served", instance_id=reply.instance_id, kv_source=reply.kv_source,
                                  ttft_s=round(reply.timings.ttft_s, 4), tokens=reply.usage.completion_tokens)
                else:
                    self.log.warning("call failed", status=reply.status, code=reply.code, reason=reply.message)
                return reply
            finally:
                self._pending.pop(call.call_id, None)
                self._calls.pop(call.call_id, None)
                if token_sub is not None:
                    await token_sub.unsubscribe()
                if reply_sub is not None:
                    await reply_sub.unsubscribe()

    async def cancel(self, call_id: str, reason: str, tenant: str) -> None:
        """Tell the agents to abort `call_id` of `tenant` (they record it as cancelled)."""
        try:
            await self.nc.publish(self.deployment.call_cancel, encode(CancelCall(call_id, reason, tenant=tenant)),
                                  headers={SENDER_HEADER: self.nc.options.get("name") or ""})
            self.log.info("call cancelled", call_id=call_id, reason=reason)
        except BUS_ERRORS as exc:  # the bus is down: the call runs to its end, nothing is lost
            self.log.warning("could not send cancel", call_id=call_id, error=str(exc))

    def _token_handler(self, on_token: TokenCallback):
        async def handle(msg) -> None:
            if not sent_by(msg.headers, STREAMING_ROLES):  # only the serving agent streams a call
                self.log.warning("token chunk not from an agent dropped", subject=msg.subject, sender=sender_of(msg))
                return
            try:
                chunk = TOKEN_DECODER.decode(msg.data)
            except msgspec.DecodeError as exc:
                self.log.warning("undecodable token chunk", subject=msg.subject, error=str(exc))
                return
            await on_token(chunk)

        return handle

    async def timed_out(self, call: CallSubmitted, reason: str) -> ErrorReply:
        """The 504 of a call nobody answered in time, recorded as the gateway's CallFailed."""
        try:
            await emit(self.js, CallFailed(call.call_id, call.session_id, call.model, reason, "gateway",
                                           time.time(), status=504))
        except BUS_ERRORS as exc:
            self.log.error("could not record timeout", call_id=call.call_id, error=str(exc))
        return ErrorReply(504, "timeout", reason, call_id=call.call_id)


def _timed(on_token: TokenCallback, watch) -> TokenCallback:
    async def timed(chunk: TokenChunk) -> None:
        if chunk.text:  # the closing chunk carries no token
            watch.token()
        await on_token(chunk)

    return timed


def _annotate(span: trace.Span, reply: Reply) -> None:
    span.set_attribute("talaria.session.trace_id", trace_id_hex(span.get_span_context().trace_id))
    if isinstance(reply, CallResult):
        span.set_attributes(result_attributes(reply))
    else:
        span.set_status(trace.Status(trace.StatusCode.ERROR, reply.message))
        span.set_attributes(error_attributes(reply))
