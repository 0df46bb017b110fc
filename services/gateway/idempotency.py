"""Idempotency keys: a client's retry of a call attaches to the original instead of running it again.
(The pure rules, record and subjects are in idempotency_rules.py; this is the protocol.)

A client sends `Idempotency-Key` (HTTP header; `idempotency_key` on the NATS API) with a call and
each retry of it (as Stripe's and OpenAI's APIs take it), scoped to the API key's tenant. The first
request claims the key; a later one with the same key and request gets the stored answer if the call
completed, waits for it if it is running, and runs it anew if the attempt failed (an error reply or
a deadline passed unanswered: it never completed, so nothing runs twice). The same key with another
request is a 422. A key is kept for `TALARIA_IDEMPOTENCY_WINDOW_S` (default 24 h, longer than the
call timeout). A client that disconnects does not cancel its keyed call at once: when every request
waiting for it has gone, it is cancelled after a grace (`TALARIA_IDEMPOTENT_ORPHAN_S`) in which none
attached. Where the state lives (one JetStream stream, any gateway finds it): `IdempotentCalls`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import msgspec
from nats.errors import NoRespondersError
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from talaria.services.gateway.idempotency_rules import (
    KEY_HEADER,
    ORPHANED,
    IdempotencyRecord,
    KeyDecision,
    decide,
    fingerprint,
    key_subject,
    orphan_cancelled,
    outcome_subject,
    waiting_subject,
)
from talaria.services.gateway.validation import check_size
from talaria.shared.bus import (BUS_ERRORS, IDEMPOTENCY_DISK_SHARE, disk_cap, elected, emit_new, ensure_stream_config,
                                replicas, retried_api, stored)
from talaria.shared.events import CallSubmitted
from talaria.shared.messages import REPLY_DECODER, ErrorReply, Reply
from talaria.shared.nats_auth import ANSWERING_ROLES, sent_by
from talaria.shared.wire import encode, replace

WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream: the subject moved on since the sequence we expected
CLAIM_RACES = 4  # each lost race means another request for the key made progress
# A gateway answers a probe from its event loop at once; one silent this long is overloaded or
PROBE_TIMEOUT_S = 2.0  # cut off, and counts as waiting (the call then runs to its end, as before)


class IdempotentCalls:
    """Claims keys and runs (or attaches to) their calls through the gateway's Submitter.

    State lives in one JetStream stream, so any gateway process (a restarted one included)
    finds the original call (docs/design.md, "Idempotency keys"):
    - `<dep>.idem.key.<sha256(tenant, key)>`: the claim (which call id, the request's
      fingerprint, its deadline), written with an expected last-subject sequence, so of two
      requests racing for a key exactly one wins and a take-over replaces exactly the attempt
      it saw;
    - `<dep>.reply.gateway.idem.<tag>-<call_id>` (tag: of the tenant): the reply subject. Agents and the router
      answer there as on any reply subject, and the stream keeps that answer. Only they may publish
      there (NATS permissions: the gateway answers clients only in their own inbox space, nats_api),
      and a reader takes only an answer whose `Talaria-Sender` is the router or an agent.
    Each request waiting for a call (the owner, each attached retry, on any gateway) answers probes
    on `<dep>.idem.waiting.<tag>-<call_id>` until the grace after its client left; the last to stop probes
    once, and with no responders and no answer kept it cancels the call.
    """

    def __init__(self, submitter, window_s: float, orphan_s: float = 15.0) -> None:
        self.submitter, self.window_s, self.orphan_s = submitter, window_s, orphan_s
        self.nc, self.js, self.log = submitter.nc, submitter.js, submitter.log
        self.api = retried_api(self.nc)  # reads, each try short (bus.elected asks again)
        self.deployment = submitter.deployment
        self._watches: set[asyncio.Task] = set()  # calls whose client left here, in their grace
        self._stopping = False

    async def start(self) -> None:
        config = StreamConfig(
            name=self.deployment.idempotency_stream,
            subjects=[f"{self.deployment.idempotency_keys}.*", f"{self.deployment.idempotent_replies}.*"],
            retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, discard=DiscardPolicy.OLD,
            max_age=self.window_s,
            max_msgs_per_subject=1,  # a key's current claim; a call's answer
            num_replicas=replicas(self.js),
            max_bytes=disk_cap(self.js, IDEMPOTENCY_DISK_SHARE),  # oldest first past it (shared/bus.py)
        )
        await ensure_stream_config(self.js, config)

    async def stop(self) -> None:
        """Drop the graces in progress: a stopping gateway leaves keyed calls running (a client
        of its own it cut off retries elsewhere and attaches)."""
        self._stopping = True
        for task in list(self._watches):
            task.cancel()
        await asyncio.gather(*self._watches, return_exceptions=True)

    async def waiting(self, tenant: str | None, call_id: str):
        """Answer probes for `call_id` while this request waits for it (the subscription)."""
        async def here(msg) -> None:
            if msg.reply:
                await self.nc.publish(msg.reply, b"")

        return await self.nc.subscribe(waiting_subject(self.deployment, tenant, call_id), cb=here)

    def left(self, call: CallSubmitted, presence) -> None:
        """This request's client went away: its presence lasts the grace, then the call is
        cancelled if nobody else waits for it."""
        if self._stopping:  # the call runs to its end, as before graces
            asyncio.ensure_future(_quietly_unsubscribe(presence))
            return
        task = asyncio.ensure_future(self._orphan_after_grace(call, presence))
        self._watches.add(task)
        task.add_done_callback(self._watches.discard)

    async def _orphan_after_grace(self, call: CallSubmitted, presence) -> None:
        try:
            await asyncio.sleep(self.orphan_s)  # a retry attaching meanwhile (anywhere) sees us in a probe
        finally:
            await _quietly_unsubscribe(presence)
        try:
            if time.time() >= call.deadline_at or await self.stored(call.tenant, call.call_id) is not None:
                return  # it has its answer, or will never have one
            try:  # our unsubscribe is ahead of this on the connection: only others can answer
                await self.nc.request(waiting_subject(self.deployment, call.tenant, call.call_id), b"", timeout=PROBE_TIMEOUT_S)
                return  # someone waits: the last of them to leave decides
            except NoRespondersError:
                pass
            await self.submitter.cancel(call.call_id, ORPHANED, call.tenant)
        except BUS_ERRORS as exc:  # the bus is down: the call runs to its end, as without a grace
            self.log.warning("could not check who waits for a keyed call", call_id=call.call_id, error=str(exc))

    async def claim(self, call: CallSubmitted, key: str) -> "Claim | ErrorReply":
        """Claim `key` for `call`, or find the call it already names."""
        subject, fp = key_subject(self.deployment, call.tenant, key), fingerprint(call)
        own = self._own(call)
        try:
            if await self._write(subject, self._record(own, fp, 0), last=0):
                return Claim(self, own, owner=True, request=call, key=key)
            for _ in range(CLAIM_RACES):
                try:
                    raw = await self._last(subject)
                except NotFoundError:  # expired a moment ago
                    if await self._write(subject, self._record(own, fp, 0), last=0):
                        return Claim(self, own, owner=True, request=call, key=key)
                    continue
                record = msgspec.json.decode(raw.data, type=IdempotencyRecord)
                outcome = await self.stored(call.tenant, record.call_id)
                decision = decide(record, fp, outcome, time.time())
                if decision is KeyDecision.MISMATCH:
                    return ErrorReply(422, "idempotency_key_reused",
                                      f"this `{KEY_HEADER}` was used for a different request (call "
                                      f"{record.call_id}); send a new key with a new request",
                                      param=KEY_HEADER, call_id=record.call_id)
                if decision is KeyDecision.REPLAY:
                    return Claim(self, self._attached(call, record), owner=False, outcome=outcome)
                if decision is KeyDecision.TAKE_OVER:
                    if own.call_id == record.call_id:  # a client-chosen call id reused: the new attempt needs its own
                        own = self._own(replace(call, call_id=uuid.uuid4().hex))
                    if await self._write(subject, self._record(own, fp, record.attempt + 1), last=raw.seq):
                        self.log.info("idempotent call re-run", call_id=own.call_id, failed=record.call_id,
                                      attempt=record.attempt + 1)
                        return Claim(self, own, owner=True, request=call, key=key)
                    continue
                return Claim(self, self._attached(call, record), owner=False,
                             republish=decision is KeyDecision.ATTACH_REPUBLISH, request=call, key=key)
        except BUS_ERRORS as exc:  # the bus is down: nothing was accepted
            self.log.error("idempotency claim failed", error=str(exc))
            return ErrorReply(503, "bus_unavailable", f"could not look up the {KEY_HEADER}: {exc}",
                              retry_after_s=1.0)
        return ErrorReply(409, "idempotency_key_busy", f"requests with this `{KEY_HEADER}` keep racing; retry",
                          param=KEY_HEADER, retry_after_s=1.0)

    async def stored(self, tenant: str | None, call_id: str) -> Reply | None:
        """The answer `tenant`'s call got, if it has one."""
        try:
            raw = await self._last(outcome_subject(self.deployment, tenant, call_id))
        except NotFoundError:
            return None
        if not sent_by(raw.headers, ANSWERING_ROLES):  # kept answers come from the router or an agent
            self.log.warning("kept answer not from the router or an agent ignored", call_id=call_id)
            return None
        try:
            return REPLY_DECODER.decode(raw.data)
        except msgspec.DecodeError as exc:
            return ErrorReply(502, "bad_reply", f"undecodable stored reply: {exc}", call_id=call_id)

    async def attach(self, call: CallSubmitted, republish: bool) -> Reply:
        """Wait for the outcome of `call`, which another request (maybe a dead gateway's) owns."""
        got: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()

        async def on_reply(msg) -> None:
            if not got.done() and sent_by(msg.headers, ANSWERING_ROLES):
                try:
                    got.set_result(REPLY_DECODER.decode(msg.data))
                except msgspec.DecodeError as exc:
                    got.set_result(ErrorReply(502, "bad_reply", f"undecodable reply: {exc}", call_id=call.call_id))

        sub = await self.nc.subscribe(call.reply_to, cb=on_reply)  # before looking: nothing falls between
        try:
            too_large = check_size(call, self.nc.max_payload)
            if too_large is not None:  # its owner answered 413 without submitting it
                return too_large
            if republish:
                if await emit_new(self.js, call) is not None:
                    self.log.warning("idempotent call re-submitted: its gateway died before submitting it",
                                     call_id=call.call_id)
            stored = await self.stored(call.tenant, call.call_id)
            if stored is not None:
                return stored
            self.log.info("retry attached to its running call", call_id=call.call_id)
            try:
                return await asyncio.wait_for(got, max(0.0, call.deadline_at - time.time()))
            except TimeoutError:
                # what its own gateway would have said and recorded at the deadline
                return await self.submitter.timed_out(call, "no reply by the call's deadline")
        except BUS_ERRORS as exc:
            self.log.error("attaching to an idempotent call failed", call_id=call.call_id, error=str(exc))
            return ErrorReply(503, "bus_unavailable", f"could not wait for call {call.call_id}: {exc}",
                              retry_after_s=1.0, call_id=call.call_id)
        finally:
            await sub.unsubscribe()

    def _own(self, call: CallSubmitted) -> CallSubmitted:
        """`call` as the key's owner runs it: answered on its kept reply subject, with its deadline."""
        return replace(call, reply_to=outcome_subject(self.deployment, call.tenant, call.call_id),
                       deadline_at=call.deadline_at or call.submitted_at + self.submitter.timeout_s)

    def _attached(self, call: CallSubmitted, record: IdempotencyRecord) -> CallSubmitted:
        """This request as the call it attaches to (the original's id, reply subject, deadline)."""
        return replace(call, call_id=record.call_id, reply_to=outcome_subject(self.deployment, call.tenant, record.call_id),
                       deadline_at=record.deadline_at)

    async def _last(self, subject: str):
        """The subject's last message in the stream, asked again through a leader's failover."""
        return await elected(lambda: self.api.get_last_msg(self.deployment.idempotency_stream, subject))

    @staticmethod
    def _record(call: CallSubmitted, fp: str, attempt: int) -> IdempotencyRecord:
        return IdempotencyRecord(call.call_id, fp, call.deadline_at, time.time(), attempt)

    async def _write(self, subject: str, record: IdempotencyRecord, last: int) -> bool:
        """Publish `record` if the subject's last message is still `last` (0: none); False if not.
        Sent again through the stream leader's failover (bus.stored) under a message id of this
        write alone: a copy of an unanswered first try that was stored is a duplicate, ours."""
        headers = {"Nats-Expected-Last-Subject-Sequence": str(last), "Nats-Msg-Id": uuid.uuid4().hex,
                   "Nats-Expected-Stream": self.deployment.idempotency_stream}
        try:
            await stored(self.js, subject, encode(record), headers)
            return True
        except APIError as err:
            if err.err_code in WRONG_LAST_SEQUENCE:
                return False
            raise


@dataclass
class Claim:
    """A request's place under its key. `call` is the call it runs or attaches to: its id is
    the one to show the client (`chatcmpl-<id>`), whoever runs it."""

    calls: IdempotentCalls
    call: CallSubmitted
    owner: bool
    outcome: Reply | None = None
    republish: bool = False
    request: CallSubmitted | None = None  # the request as it came (before it became `call`)
    key: str | None = None

    @property
    def replayed(self) -> bool:
        return not self.owner

    async def run(self, on_token=None, on_reply=None) -> Reply:
        """The call's reply. Only the owner streams tokens: a retry that attaches mid-call would
        see them from the middle, so it gets the answer whole at the end. `on_reply`: as for
        `Submitter.submit` (the owner's answer, as soon as it is in hand)."""
        if self.outcome is not None:
            return self.outcome
        try:
            presence = await self.calls.waiting(self.call.tenant, self.call.call_id)  # before submitting or looking
        except BUS_ERRORS as exc:  # the bus is down: nothing was submitted
            return ErrorReply(503, "bus_unavailable", f"could not wait for call {self.call.call_id}: {exc}",
                              retry_after_s=1.0, call_id=self.call.call_id)
        streamed = False  # a re-run cannot follow tokens already sent

        async def token(chunk) -> None:
            nonlocal streamed
            streamed = True
            await on_token(chunk)

        async def answer(reply: Reply) -> None:
            if not (orphan_cancelled(reply) and self.request is not None and not streamed):
                await on_reply(reply)  # else the re-run below answers

        try:
            if self.owner:
                reply = await self.calls.submitter.submit(self.call, on_token and token, on_reply and answer)
            else:
                reply = await self.calls.attach(self.call, self.republish)
        except asyncio.CancelledError:  # the client went away: the presence stays for the grace
            self.calls.left(self.call, presence)
            presence = None
            raise
        finally:
            if presence is not None:
                await _quietly_unsubscribe(presence)
        if orphan_cancelled(reply) and self.request is not None and not streamed:
            # Given up just as this request came (or while its gateway could not answer probes,
            # e.g. reconnecting to NATS): the client is still here, so it runs the call anew.
            again = await self.calls.claim(self.request, self.key)
            if isinstance(again, ErrorReply):
                if on_reply is not None:
                    await on_reply(again)
                return again
            # The call this request answers as now (its id and `replayed` go into the response).
            self.owner, self.call = again.owner, again.call
            return await again.run(on_token, on_reply)
        return reply


async def claim_for(calls: IdempotentCalls | None, call: CallSubmitted, key: str | None) -> Claim | ErrorReply | None:
    """The claim for a request that sent `key`; None when it sent none (or the gateway has no store)."""
    if key is None or calls is None:
        return None
    refused = calls.submitter.refusal(call)  # before claiming: a refused call leaves no claim
    if refused is not None:
        return replace(refused, call_id=call.call_id)
    return await calls.claim(call, key)


def answers_as(claim: Claim | None, call: CallSubmitted) -> CallSubmitted:
    """The call a request answers as now: its claim's (a keyed retry given up at the edge
    re-runs it under a new id), else its own."""
    return claim.call if claim is not None else call


def restamp(resp, claim: Claim | None, **ids: str) -> None:
    """Right before a streamed response's headers go out: the ids of the call it answers as now
    and whether another request ran it (a keyed call given up at the edge re-runs, new id)."""
    if claim is None:
        return
    resp.headers.update(ids)
    resp.headers.popall("Idempotent-Replayed", None)
    resp.headers.update(replayed(claim))


def replayed(claim: Claim | None) -> dict[str, str]:
    """Response headers: `Idempotent-Replayed: true` (Stripe's) when another request ran the call."""
    return {"Idempotent-Replayed": "true"} if claim is not None and claim.replayed else {}


async def _quietly_unsubscribe(sub) -> None:
    try:
        await sub.unsubscribe()
    except BUS_ERRORS:  # the connection is closing: the server drops the subscription with it
        return
