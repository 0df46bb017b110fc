"""The orphan grace of a keyed call with a non-zero grace (services/gateway/idempotency.py,
`left`): the leaving request's presence lasts the whole grace, and only after it is the call
probed and, with nobody waiting, cancelled. The other tests use a grace of 0 (or a stopping
gateway), where a skipped wait goes unnoticed. Times are the event loop's clock: asyncio's
sleep never returns early, so the bounds below are exact, not tuned."""

import asyncio
import time

from nats.errors import NoRespondersError
from nats.js.errors import NotFoundError

from talaria.services.gateway.idempotency import IdempotentCalls
from talaria.services.gateway.idempotency_rules import ORPHANED, outcome_subject, waiting_subject
from talaria.shared import logs
from talaria.shared.events import CallSubmitted
from talaria.shared.subjects import Deployment

DEP = Deployment()

GRACE_S = 0.2


def keyed_call(deadline_in_s: float = 60.0) -> CallSubmitted:
    now = time.time()
    return CallSubmitted("c1", "tenant-a:s", "qwen3-tiny", [1, 2], [], 4, now, tenant="tenant-a",
                         reply_to=outcome_subject(DEP, "tenant-a", "c1"), deadline_at=now + deadline_in_s)


class Recorder:
    """The bus, the presence and the gateway as the grace sees them; each records when
    (loop time) it was used, relative to when the client left."""

    def __init__(self, answered: bool = False, waiter: bool = False) -> None:
        self.answered, self.waiter = answered, waiter
        self.loop = asyncio.get_running_loop()
        self.left_at = self.loop.time()
        self.log_ = []  # (what, seconds after leaving)
        self.nc = self.js = self
        self.log, self.timeout_s = logs.get("test"), 60.0
        self.deployment = DEP

    def _note(self, what: str) -> None:
        self.log_.append((what, self.loop.time() - self.left_at))

    async def unsubscribe(self) -> None:  # the presence
        self._note("unsubscribe")

    def jetstream(self, timeout=None):  # the gateway's short-try context for reads: the same double
        return self

    async def get_last_msg(self, stream, subject):
        self._note("stored?")
        raise NotFoundError

    async def request(self, subject, payload, timeout):
        assert subject == waiting_subject(DEP, "tenant-a", "c1")
        self._note("probe")
        if not self.waiter:
            raise NoRespondersError
        return object()

    async def cancel(self, call_id, reason, tenant) -> None:
        self._note("cancel")
        assert (call_id, reason, tenant) == ("c1", ORPHANED, "tenant-a")


async def leave(rec: Recorder, call: CallSubmitted | None = None, grace_s: float = GRACE_S) -> list:
    calls = IdempotentCalls(rec, 3600.0, orphan_s=grace_s)
    rec.left_at = rec.loop.time()
    calls.left(call or keyed_call(), rec)
    await asyncio.gather(*calls._watches)
    return [what for what, _ in rec.log_]


async def test_the_presence_lasts_the_grace_then_the_call_is_probed_and_cancelled():
    rec = Recorder()
    assert await leave(rec) == ["unsubscribe", "stored?", "probe", "cancel"]
    assert all(at >= GRACE_S for _, at in rec.log_), rec.log_  # nothing happened inside the grace


async def test_someone_waiting_after_the_grace_keeps_the_call():
    rec = Recorder(waiter=True)
    assert await leave(rec) == ["unsubscribe", "stored?", "probe"]
    assert all(at >= GRACE_S for _, at in rec.log_)


async def test_a_call_past_its_deadline_is_not_probed_after_the_grace():
    rec = Recorder()
    assert await leave(rec, keyed_call(deadline_in_s=GRACE_S / 2)) == ["unsubscribe"]
    assert rec.log_[0][1] >= GRACE_S


async def test_a_call_whose_deadline_is_exactly_now_after_the_grace_is_left_alone(monkeypatch):
    import types

    from talaria.services.gateway import idempotency

    call = keyed_call()
    monkeypatch.setattr(idempotency, "time", types.SimpleNamespace(time=lambda: call.deadline_at))
    rec = Recorder()
    assert await leave(rec, call, grace_s=0.0) == ["unsubscribe"]  # it can no longer complete
