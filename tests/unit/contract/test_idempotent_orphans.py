"""The grace of a keyed call whose client left (services/gateway/idempotency.py, `left`): after
it, the call is cancelled only when it has no answer, is within its deadline, and a probe finds
nobody else waiting; a stopping gateway drops its graces without cancelling anything."""

import asyncio
import time

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError

from talaria.services.gateway.idempotency import IdempotentCalls
from talaria.services.gateway.idempotency_rules import ORPHANED, outcome_subject, waiting_subject
from talaria.shared import logs
from talaria.shared import messages as m
from talaria.shared.events import CallSubmitted
from talaria.shared.nats_auth import SENDER_HEADER
from talaria.shared.wire import encode
from talaria.shared.subjects import Deployment

DEP = Deployment()


def keyed_call(deadline_in_s: float = 60.0) -> CallSubmitted:
    now = time.time()
    return CallSubmitted("c1", "tenant-a:s", "qwen3-tiny", [1, 2], [], 4, now, tenant="tenant-a",
                         reply_to=outcome_subject(DEP, "tenant-a", "c1"), deadline_at=now + deadline_in_s)


class Presence:
    def __init__(self) -> None:
        self.unsubscribed = False

    async def unsubscribe(self) -> None:
        self.unsubscribed = True


class Bus:
    """NATS as the grace sees it: a kept answer (or none), and who answers a probe."""

    def __init__(self, answered: bool = False, probe_error: Exception | None = NoRespondersError()) -> None:
        self.answered, self.probe_error, self.probes = answered, probe_error, []
        self.presence: Presence | None = None

    async def get_last_msg(self, stream, subject):
        if not self.answered:
            raise NotFoundError
        return type("Msg", (), {"data": encode(m.ErrorReply(504, "timeout", "late", call_id="c1")),
                                "headers": {SENDER_HEADER: "talaria-agent-agent-0"}})()

    def jetstream(self, timeout=None):  # the gateway's short-try context for reads: the same double
        return self

    async def request(self, subject, payload, timeout):
        self.probes.append((subject, self.presence.unsubscribed))  # ours must not answer our probe
        if self.probe_error is not None:
            raise self.probe_error
        return object()  # another waiter answered


class Gateway:
    def __init__(self, bus: Bus) -> None:
        self.nc = self.js = bus
        self.log, self.timeout_s, self.cancels = logs.get("test"), 60.0, []
        self.deployment = DEP

    async def cancel(self, call_id, reason, tenant) -> None:
        self.cancels.append((call_id, reason, tenant))


async def after_grace(bus: Bus, call: CallSubmitted | None = None) -> tuple[Gateway, Presence]:
    gateway, presence = Gateway(bus), Presence()
    bus.presence = presence
    calls = IdempotentCalls(gateway, 3600.0, orphan_s=0.0)
    calls.left(call or keyed_call(), presence)
    await asyncio.gather(*calls._watches)
    return gateway, presence


async def test_a_call_nobody_waits_for_is_cancelled_for_its_tenant_after_the_grace():
    bus = Bus()
    gateway, presence = await after_grace(bus)
    assert bus.probes == [(waiting_subject(DEP, "tenant-a", "c1"), True)]  # after our presence went: only others answer
    assert gateway.cancels == [("c1", ORPHANED, "tenant-a")]


async def test_a_call_someone_still_waits_for_runs_on():
    gateway, _ = await after_grace(Bus(probe_error=None))
    assert gateway.cancels == []


async def test_a_probe_nobody_answers_in_time_counts_as_waiting():
    gateway, _ = await after_grace(Bus(probe_error=NatsTimeout()))
    assert gateway.cancels == []


async def test_a_call_with_an_answer_or_past_its_deadline_is_left_alone():
    bus = Bus(answered=True)
    gateway, _ = await after_grace(bus)
    assert gateway.cancels == [] and bus.probes == []
    bus = Bus()
    gateway, _ = await after_grace(bus, keyed_call(deadline_in_s=-1.0))
    assert gateway.cancels == [] and bus.probes == []


async def test_a_stopping_gateway_drops_its_graces_without_cancelling():
    bus = Bus()
    gateway, presence = Gateway(bus), Presence()
    calls = IdempotentCalls(gateway, 3600.0, orphan_s=3600.0)
    calls.left(keyed_call(), presence)
    [task] = calls._watches
    await asyncio.sleep(0)  # the grace has begun
    await calls.stop()
    assert task.cancelled() and presence.unsubscribed and not calls._watches
    assert gateway.cancels == [] and bus.probes == []
    late = Presence()
    calls.left(keyed_call(), late)  # a handler cut off by the stop itself
    assert not calls._watches
    await asyncio.sleep(0)
    assert late.unsubscribed  # nothing lingers
    assert gateway.cancels == [] and bus.probes == []
