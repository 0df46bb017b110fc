"""A key's claim (services/gateway/idempotency.py) through the idempotency stream leader's
failover: an unanswered claim is sent again under the same message id, so a first try that
was stored comes back as a duplicate and is still this request's claim; each new claim has a
message id of its own (a client's retry must never pass for the first request's write). The
JetStream context is a test double: an unanswered-but-stored publish cannot be staged on a
real server (tests/unit/ops/test_bus_failover.py says the same of bus.stored)."""

import asyncio
import time

from nats.js.api import PubAck

from talaria.services.gateway.idempotency import IdempotentCalls
from talaria.services.gateway.idempotency_rules import outcome_subject
from talaria.shared import logs
from talaria.shared.events import CallSubmitted
from talaria.shared.subjects import Deployment

DEP = Deployment()


class Stream:
    """nc and js at once: answers each publish with the next of `script`, records the headers."""

    def __init__(self, script) -> None:
        self.script, self.sent = list(script), []
        self.nc = self.js = self
        self.log, self.timeout_s, self.deployment = logs.get("test"), 60.0, DEP

    def jetstream(self, timeout=None):
        return self

    async def publish(self, subject, data, timeout=None, headers=None):
        self.sent.append(dict(headers))
        outcome = self.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def call(call_id: str = "c1") -> CallSubmitted:
    now = time.time()
    return CallSubmitted(call_id, "tenant-a:s", "qwen3-tiny", [1, 2], [], 4, now, tenant="tenant-a",
                         reply_to=outcome_subject(DEP, "tenant-a", call_id), deadline_at=now + 60)


async def test_an_unanswered_claim_that_was_stored_is_still_ours():
    bus = Stream([asyncio.TimeoutError(), PubAck(stream=DEP.idempotency_stream, seq=5, duplicate=True)])
    claim = await IdempotentCalls(bus, window_s=3600).claim(call(), "k")
    assert claim.owner and claim.call.call_id == "c1"
    first, again = bus.sent
    assert first["Nats-Msg-Id"] == again["Nats-Msg-Id"]
    assert first["Nats-Expected-Last-Subject-Sequence"] == again["Nats-Expected-Last-Subject-Sequence"] == "0"


async def test_each_claim_has_a_message_id_of_its_own():
    bus = Stream([PubAck(stream=DEP.idempotency_stream, seq=1), PubAck(stream=DEP.idempotency_stream, seq=2)])
    calls = IdempotentCalls(bus, window_s=3600)
    await calls.claim(call("c1"), "k1")
    await calls.claim(call("c1"), "k2")  # a client-chosen call id used twice
    assert bus.sent[0]["Nats-Msg-Id"] != bus.sent[1]["Nats-Msg-Id"]
