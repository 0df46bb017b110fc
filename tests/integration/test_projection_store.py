"""One contract, two stores: the Postgres projection and the in-memory one give the same rows.

Each test applies a sequence of events (some re-delivered, some out of order) to a store and
checks what an operator would read. Both stores run every test, so the SQL in projector.py and
the fold in store.py cannot drift apart.
"""

import msgspec
import pytest

from talaria.services.telemetry.store import EventRefused, MemoryStore, PoisonEvent, PostgresStore
from talaria.shared.events import (
    CallCompleted,
    CallFailed,
    CallRouted,
    CallStarted,
    CallSubmitted,
    LeaseIssued,
    RoutingDecision,
)
from talaria.shared.messages import CANCELLED_STATUS
from talaria.shared.db.connection import create_engine

pytestmark = pytest.mark.integration


class UnisolatedPostgresStore(PostgresStore):
    """The telemetry service's first try at a batch: no savepoint per event."""

    def batch(self, isolate: bool = False):
        return super().batch(isolate)


@pytest.fixture(params=["postgres", "postgres-unisolated", "memory"])
async def store(request, database_url):
    kinds = {"memory": MemoryStore, "postgres": PostgresStore, "postgres-unisolated": UnisolatedPostgresStore}
    s = MemoryStore() if request.param == "memory" else kinds[request.param](create_engine(database_url))
    yield s
    await s.close()


def submitted(i: int, session: str = "s1") -> CallSubmitted:
    return CallSubmitted(call_id=f"c{i}", session_id=session, model="qwen3-tiny", prompt_ids=[256] * 10,
                           block_hashes=[], max_tokens=4, submitted_at=1000.0 + i)


def routed(i: int) -> CallRouted:
    return CallRouted(call=submitted(i), call_index=i, instance_id="agent-0", policy="talaria",
                        routed_at=1000.1 + i)


def completed(i: int, session: str = "s1") -> CallCompleted:
    return CallCompleted(f"c{i}", session, i, "qwen3-tiny", "agent-0", 10, 4, "length", 1000.0 + i,
                           1000.2 + i, 1000.3 + i, 1000.5 + i, cached_tokens=6, kv_source="device",
                           queue_s=0.01, ttft_s=0.2)


def failed(i: int, session: str = "s1") -> CallFailed:
    return CallFailed(call_id=f"c{i}", session_id=session, model="qwen3-tiny", stage="agent", reason="boom",
                        status=500, at=1000.4 + i)


def decision(i: int) -> RoutingDecision:
    return RoutingDecision(f"c{i}", "s1", i, "qwen3-tiny", "talaria", "route", 1000.1 + i, chosen="agent-0",
                             lease_outcome="consumed")


async def apply(store, *events) -> list[bool]:
    out = []
    async with store.batch() as batch:
        for seq, event in enumerate(events, start=1 + await store.offset()):
            out.append(await batch.project(event, seq))
    return out


async def test_one_call_start_to_finish(store):
    started = CallStarted(call_id="c0", session_id="s1", instance_id="agent-0", started_at=1000.2)
    await apply(store, submitted(0), routed(0), decision(0), started, completed(0))
    call = await store.call("c0")
    assert (call["outcome"], call["instance_id"], call["call_index"], call["prompt_tokens"]) == \
        ("completed", "agent-0", 0, 10)
    assert (call["output_tokens"], call["cached_tokens"], call["kv_source"], call["ttft_s"]) == (4, 6, "device", 0.2)
    assert call["routed_at"] is not None and call["started_at"] is not None
    session = await store.session("s1")
    assert (session["calls"], session["completed"], session["failed"], session["last_instance"]) == \
        (1, 1, 0, "agent-0")
    assert (await store.decision("c0"))["outcome"] == "completed"
    assert await store.offset() == 5


async def test_every_event_applied_twice_counts_once(store):
    events = [submitted(0), routed(0), decision(0), completed(0), submitted(1), failed(1)]
    first = await apply(store, *events)
    again = await apply(store, *events)
    assert first[0] and first[3] and first[5]
    assert not again[0] and not again[3] and not again[5]
    session = await store.session("s1")
    assert (session["calls"], session["completed"], session["failed"]) == (2, 1, 1)


async def test_a_failed_call_never_becomes_completed(store):
    await apply(store, submitted(0), failed(0), completed(0))
    assert (await store.call("c0"))["outcome"] == "failed"
    session = await store.session("s1")
    assert (session["completed"], session["failed"]) == (0, 1)


async def test_a_cancelled_call_says_so_and_stays_cancelled(store):
    cancel = msgspec.structs.replace(failed(0), status=CANCELLED_STATUS, reason="client went away")
    await apply(store, submitted(0), routed(0), decision(0), cancel, completed(0))
    assert (await store.call("c0"))["outcome"] == "cancelled"
    assert (await store.decision("c0"))["outcome"] == "cancelled"


async def test_a_rejection_row_says_why(store):
    why = "overload: best predicted TTFT 10.1 s, budget 9.0 s"
    reject = msgspec.structs.replace(decision(0), action="reject", chosen=None, reason=why)
    await apply(store, submitted(0), reject)
    row = await store.decision("c0")
    assert (row["action"], row["chosen_instance"], row["reason"]) == ("reject", None, why)


async def test_out_of_order_delivery_gives_the_same_rows(store):
    """The completion and the decision before the submission and the route."""
    await apply(store, completed(0), decision(0), routed(0), submitted(0))
    call = await store.call("c0")
    assert (call["outcome"], call["api"], call["prompt_tokens"]) == ("completed", "nats", 10)
    session = await store.session("s1")
    assert (session["calls"], session["completed"]) == (1, 1)
    assert (await store.decision("c0"))["outcome"] == "completed"


async def test_rows_keyed_by_sequence_are_written_once(store):
    lease = LeaseIssued(session_id="s1", model="qwen3-tiny", instance_id="agent-0", call_id="c0",
                          issued_at=1000.0, expires_at=1001.0)
    async with store.batch() as batch:
        await batch.project(lease, 7)
        await batch.project(lease, 7)  # the same stream message delivered again
        await batch.project(lease, 8)
    assert await store.rows("lease_events") == 2


async def test_a_failing_batch_leaves_nothing_behind(store):
    with pytest.raises(RuntimeError):
        async with store.batch() as batch:
            await batch.project(submitted(0), 1)
            raise RuntimeError("the consumer died mid-batch")
    assert await store.call("c0") is None
    assert await store.rows("sessions") == 0
    assert await store.offset() == 0


async def test_a_poison_event_is_quarantined_and_the_batch_commits(store):
    async with store.batch() as batch:
        await batch.project(submitted(0), 1)
        await batch.quarantine(2, "talaria.evt.call.completed", "undecodable", b"\x00garbage")
    assert (await store.call("c0"))["outcome"] == "submitted"
    assert await store.rows("quarantined_events") == 1
    assert await store.offset() == 2


async def test_postgres_refusing_an_event_makes_it_poison(database_url):
    """A value Postgres refuses (an infinite timestamp, standing in for any data error) is the
    event's fault: PoisonEvent, and the batch's other events commit."""
    store = PostgresStore(create_engine(database_url))
    try:
        bad = msgspec.structs.replace(submitted(1), submitted_at=float("inf"))  # no timestamp for inf
        async with store.batch() as batch:
            await batch.project(submitted(0), 1)
            with pytest.raises(PoisonEvent):
                await batch.project(bad, 2)
        assert (await store.call("c0"))["outcome"] == "submitted"
        assert await store.call("c1") is None
    finally:
        await store.close()


async def test_a_batch_without_isolation_uses_no_savepoint_and_fails_whole(database_url):
    """The cheap path: no SAVEPOINT per event; an event Postgres refuses undoes the whole
    batch (EventRefused), so the caller can apply it again event by event."""
    from sqlalchemy import event as sa_event

    engine = create_engine(database_url)
    statements: list[str] = []
    sa_event.listen(engine.sync_engine, "before_cursor_execute",
                    lambda conn, cursor, stmt, *args: statements.append(stmt))
    store = PostgresStore(engine)
    try:
        async with store.batch(isolate=False) as batch:
            for i in range(3):
                await batch.project(submitted(i), i + 1)
        assert not [s for s in statements if "SAVEPOINT" in s.upper()]
        assert (await store.call("c2"))["outcome"] == "submitted"

        bad = msgspec.structs.replace(submitted(4), submitted_at=float("inf"))
        with pytest.raises(EventRefused):
            async with store.batch(isolate=False) as batch:
                await batch.project(submitted(3), 4)
                await batch.project(bad, 5)
        assert await store.call("c3") is None  # undone with the batch
        assert await store.offset() == 3
    finally:
        await store.close()


async def test_a_session_names_its_latest_submitted_model_and_serving_instance(store):
    """`last_model` moves with submissions only, `last_instance` with completions only."""
    second = msgspec.structs.replace(submitted(1), model="gpt2-tiny")
    await apply(store, submitted(0), completed(0), second)
    session = await store.session("s1")
    assert (session["last_model"], session["last_instance"]) == ("gpt2-tiny", "agent-0")
    late = msgspec.structs.replace(completed(2), model="qwen3-moe-tiny", instance_id="agent-1")
    await apply(store, late)  # a completion whose submission was never seen
    session = await store.session("s1")
    assert (session["last_model"], session["last_instance"]) == ("gpt2-tiny", "agent-1")
