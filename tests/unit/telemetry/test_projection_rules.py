"""The projection's rules, one per test, against the in-memory store (services/telemetry/
store.py `MemoryStore`, the same rules as the SQL in projector.py; the contract suite
tests/integration/test_projection_store.py checks that both stores agree). Each test breaks
when its rule alone is broken."""

from __future__ import annotations

import datetime as dt

import msgspec
import pytest

from talaria.services.telemetry.projector import completed_values, failed_values, text_, ts
from talaria.services.telemetry.store import MemoryStore
from talaria.shared.events import (
    CallCompleted,
    CallFailed,
    CallRouted,
    CallStarted,
    CallSubmitted,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseExpired,
    LeaseIssued,
    RoundSummary,
    RoutingDecision,
    SwitchDone,
)
from talaria.shared.messages import CANCELLED_STATUS

T0 = 1000.0


def submitted(i: int = 0, session: str = "s1", model: str = "qwen3-tiny", at: float | None = None) -> CallSubmitted:
    return CallSubmitted(call_id=f"c{i}", session_id=session, model=model, prompt_ids=[256] * 10,
                         block_hashes=[], max_tokens=4, submitted_at=T0 + i if at is None else at, api="openai")


def routed(i: int = 0, instance: str = "agent-0") -> CallRouted:
    return CallRouted(call=submitted(i), call_index=i, instance_id=instance, policy="talaria", routed_at=T0 + i + 0.1)


def started(i: int = 0, instance: str = "agent-0") -> CallStarted:
    return CallStarted(call_id=f"c{i}", session_id="s1", instance_id=instance, started_at=T0 + i + 0.2)


def completed(i: int = 0, session: str = "s1", instance: str = "agent-0", model: str = "qwen3-tiny") -> CallCompleted:
    return CallCompleted(f"c{i}", session, i, model, instance, 10, 4, "length", T0 + i, T0 + i + 0.2, T0 + i + 0.3,
                         T0 + i + 0.5, cached_tokens=6, kv_source="device", queue_s=0.01, ttft_s=0.2)


def failed(i: int = 0, session: str = "s1", **kw) -> CallFailed:
    return CallFailed(**{**dict(call_id=f"c{i}", session_id=session, model="qwen3-tiny", stage="agent",
                                reason="boom", status=500, at=T0 + i + 0.4), **kw})


def decision(i: int = 0, **kw) -> RoutingDecision:
    return RoutingDecision(f"c{i}", "s1", i, "qwen3-tiny", "talaria", "route", T0 + i + 0.1, chosen="agent-0",
                           lease_outcome="consumed", **kw)


async def apply(store: MemoryStore, *events, start: int | None = None) -> list[bool]:
    out = []
    async with store.batch() as batch:
        first = 1 + await store.offset() if start is None else start
        for seq, event in enumerate(events, start=first):
            out.append(await batch.project(event, seq))
    return out


# ---- calls ----------------------------------------------------------------------------------


async def test_a_submission_creates_the_row_once_and_counts_the_call_once():
    store = MemoryStore()
    assert await apply(store, submitted(0)) == [True]
    assert await apply(store, submitted(0)) == [False]
    row = await store.call("c0")
    assert (row["outcome"], row["api"], row["prompt_tokens"], row["submitted_at"]) == \
        ("submitted", "openai", 10, ts(T0))
    assert (await store.session("s1"))["calls"] == 1


async def test_a_submission_after_the_completion_fills_the_row_and_keeps_the_outcome():
    store = MemoryStore()
    await apply(store, completed(0))
    assert (await store.call("c0"))["api"] is None
    assert (await store.session("s1"))["calls"] == 0  # a completion does not count a call
    assert await apply(store, submitted(0)) == [True]  # the row existed, but not its submission
    row = await store.call("c0")
    assert (row["outcome"], row["api"]) == ("completed", "openai")
    assert (await store.session("s1"))["calls"] == 1


async def test_routing_sets_where_and_when_and_a_routed_call_without_a_row_gets_one():
    store = MemoryStore()
    await apply(store, routed(0))  # the submission never arrived on its own
    row = await store.call("c0")
    assert (row["outcome"], row["instance_id"], row["call_index"], row["routed_at"]) == \
        ("routed", "agent-0", 0, ts(T0 + 0.1))
    assert (await store.session("s1"))["calls"] == 1
    await apply(store, started(0, instance="agent-1"))
    row = await store.call("c0")
    assert (row["outcome"], row["instance_id"], row["started_at"]) == ("running", "agent-1", ts(T0 + 0.2))


async def test_a_late_routing_or_start_never_downgrades_a_final_outcome_but_fills_its_columns():
    store = MemoryStore()
    await apply(store, submitted(0), completed(0), routed(0), started(0))
    row = await store.call("c0")
    assert row["outcome"] == "completed" and row["routed_at"] == ts(T0 + 0.1)
    await apply(store, submitted(1), failed(1), routed(1))
    assert (await store.call("c1"))["outcome"] == "failed"


async def test_a_start_for_an_unknown_call_writes_nothing():
    store = MemoryStore()
    await apply(store, started(5))
    assert await store.call("c5") is None and await store.rows("calls") == 0


async def test_a_completion_writes_its_columns_and_counts_once():
    store = MemoryStore()
    await apply(store, submitted(0))
    assert await apply(store, completed(0), completed(0)) == [True, False]
    row = await store.call("c0")
    assert (row["outcome"], row["instance_id"], row["output_tokens"], row["cached_tokens"], row["kv_source"],
            row["ttft_s"], row["queue_s"], row["completed_at"]) == \
        ("completed", "agent-0", 4, 6, "device", 0.2, 0.01, ts(T0 + 0.5))
    session = await store.session("s1")
    assert (session["completed"], session["failed"], session["last_instance"]) == (1, 0, "agent-0")


async def test_the_first_final_outcome_wins_either_way():
    store = MemoryStore()
    assert await apply(store, submitted(0), completed(0), failed(0)) == [True, True, False]
    assert (await store.call("c0"))["outcome"] == "completed"
    assert await apply(store, submitted(1), failed(1), completed(1)) == [True, True, False]
    assert (await store.call("c1"))["outcome"] == "failed" and (await store.call("c1"))["error"] == "boom"
    session = await store.session("s1")
    assert (session["calls"], session["completed"], session["failed"]) == (2, 1, 1)


async def test_a_failure_first_creates_the_row_from_the_failure():
    store = MemoryStore()
    await apply(store, failed(3, stage="gateway", status=503, instance_id="agent-2", call_index=3))
    row = await store.call("c3")
    assert (row["session_id"], row["model"], row["outcome"], row["failed_stage"], row["status"],
            row["instance_id"], row["call_index"], row["submitted_at"], row["completed_at"]) == \
        ("s1", "qwen3-tiny", "failed", "gateway", 503, "agent-2", 3, ts(T0 + 3.4), ts(T0 + 3.4))
    assert (await store.session("s1"))["failed"] == 1


async def test_a_cancel_is_outcome_cancelled_and_final():
    store = MemoryStore()
    cancel = failed(0, status=CANCELLED_STATUS, reason="client went away")
    await apply(store, submitted(0), cancel, completed(0))
    row = await store.call("c0")
    assert (row["outcome"], row["status"]) == ("cancelled", CANCELLED_STATUS)
    assert (await store.session("s1"))["failed"] == 1 and (await store.session("s1"))["completed"] == 0


# ---- failed_values / completed_values / text_ / ts ---------------------------------------


def test_failed_values_name_instance_and_index_only_when_known():
    values, _ = failed_values(failed(0))
    assert "instance_id" not in values and "call_index" not in values
    values, row = failed_values(failed(0, instance_id="agent-1", call_index=0))
    assert (values["instance_id"], values["call_index"]) == ("agent-1", 0)  # index 0 is known
    assert row == dict(session_id="s1", model="qwen3-tiny", submitted_at=ts(T0 + 0.4))
    assert failed_values(failed(0, status=CANCELLED_STATUS))[0]["outcome"] == "cancelled"
    assert failed_values(failed(0, status=500))[0]["outcome"] == "failed"
    assert failed_values(failed(0, reason="a\x00b"))[0]["error"] == "a\\x00b"


def test_completed_values_carry_the_timings_and_the_row_identity():
    values, row = completed_values(completed(2))
    assert (values["call_index"], values["prompt_tokens"], values["finish_reason"], values["started_at"],
            values["first_token_at"]) == (2, 10, "length", ts(T0 + 2.2), ts(T0 + 2.3))
    assert row == dict(session_id="s1", model="qwen3-tiny", submitted_at=ts(T0 + 2))


def test_text_and_timestamps():
    assert text_(None) is None and text_("x\x00") == "x\\x00"
    assert ts(None) is None and ts(0.0) == dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


# ---- sessions -------------------------------------------------------------------------------


async def test_a_session_spans_its_earliest_and_latest_events_in_any_order():
    store = MemoryStore()
    await apply(store, submitted(1, at=T0 + 50), submitted(0, at=T0), completed(1))
    session = await store.session("s1")
    assert (session["first_seen_at"], session["last_seen_at"]) == (ts(T0), ts(T0 + 50))


async def test_last_model_moves_with_submissions_and_last_instance_with_completions():
    store = MemoryStore()
    await apply(store, submitted(0), completed(0, instance="agent-3"))
    await apply(store, submitted(1, model="gpt2-tiny"), failed(1, instance_id="agent-9"))
    session = await store.session("s1")
    assert (session["last_model"], session["last_instance"]) == ("gpt2-tiny", "agent-3")
    await apply(store, completed(2, model="other", instance="agent-4"))
    session = await store.session("s1")
    assert (session["last_model"], session["last_instance"]) == ("gpt2-tiny", "agent-4")


async def test_a_session_first_seen_through_a_completion_names_its_model():
    store = MemoryStore()
    await apply(store, completed(0, session="s2", model="gpt2-tiny"))
    session = await store.session("s2")
    assert (session["calls"], session["completed"], session["last_model"]) == (0, 1, "gpt2-tiny")


# ---- decisions ------------------------------------------------------------------------------


async def test_a_decision_row_takes_its_call_outcome_whichever_comes_first():
    store = MemoryStore()
    await apply(store, submitted(0), decision(0))
    row = await store.decision("c0")
    assert (row["chosen_instance"], row["lease_outcome"], row["action"], row["outcome"]) == \
        ("agent-0", "consumed", "route", None)
    await apply(store, completed(0))
    row = await store.decision("c0")
    assert (row["outcome"], row["ttft_s"], row["kv_source"]) == ("completed", 0.2, "device")
    # the call finished before its decision arrived
    await apply(store, submitted(1), failed(1), decision(1))
    assert (await store.decision("c1"))["outcome"] == "failed"
    # the decision first, then the failure
    await apply(store, submitted(2), decision(2), failed(2))
    assert (await store.decision("c2"))["outcome"] == "failed"


async def test_a_decision_for_an_unfinished_call_stays_open_and_the_first_decision_is_kept():
    store = MemoryStore()
    await apply(store, submitted(0), routed(0), decision(0))
    assert (await store.decision("c0"))["outcome"] is None
    again = msgspec.structs.replace(decision(0), chosen="agent-7", reason="x\x00")
    await apply(store, again)
    assert (await store.decision("c0"))["chosen_instance"] == "agent-0"
    await apply(store, decision(5, reason="why\x00"))  # no call row at all
    row = await store.decision("c5")
    assert (row["outcome"], row["reason"]) == (None, "why\\x00")
    assert (await store.decision("c0"))["reason"] is None  # an empty reason is no reason


async def test_a_later_decision_copy_joins_an_outcome_the_first_one_missed():
    store = MemoryStore()
    await apply(store, decision(0))  # before any call row
    await apply(store, submitted(0))
    store.tables["calls"]["c0"]["outcome"] = "completed"  # finished, its join not yet made
    await apply(store, decision(0))
    assert (await store.decision("c0"))["outcome"] == "completed"


# ---- rows keyed by stream sequence, offsets, batches ---------------------------------------


@pytest.mark.parametrize("event", [
    LeaseIssued("s1", "m", "agent-0", "c0", T0, T0 + 1),
    LeaseConsumed("s1", "m", "agent-0", "c1", T0),
    LeaseDiscarded("s1", "m", "agent-0", "c1", "expired", T0),
    LeaseExpired("s1", "m", "agent-0", T0),
], ids=lambda e: type(e).__name__)
async def test_lease_events_are_rows_once_per_sequence(event):
    store = MemoryStore()
    async with store.batch() as batch:
        assert await batch.project(event, 7)
        await batch.project(event, 7)
        await batch.project(event, 8)
    assert await store.rows("lease_events") == 2 and await store.rows("switches") == 0


async def test_switches_and_rounds_are_rows_once_per_sequence():
    store = MemoryStore()
    switch = SwitchDone("agent-0", None, "m", "h2d", 1.0, T0)
    round_ = RoundSummary("agent-0", 1, 2.0, 1.5, 0.5, T0)
    async with store.batch() as batch:
        for seq, event in ((1, switch), (1, switch), (2, switch), (3, round_), (3, round_)):
            assert await batch.project(event, seq)
    assert (await store.rows("switches"), await store.rows("rounds"), await store.rows("lease_events")) == (2, 1, 0)


async def test_the_offset_is_the_highest_sequence_covered_and_never_moves_back():
    store = MemoryStore()
    await apply(store, submitted(0), submitted(1), start=5)
    assert await store.offset() == 6
    await apply(store, submitted(2), start=3)  # an older batch delivered late
    assert await store.offset() == 6
    async with store.batch() as batch:
        await batch.quarantine(9, "subject", "undecodable", b"x")
        await batch.quarantine(9, "subject", "again", b"y")
    assert await store.offset() == 9 and await store.rows("quarantined_events") == 1
    assert store.tables["quarantined_events"][9]["error"] == "undecodable"


async def test_a_failing_batch_leaves_no_row_and_no_offset():
    store = MemoryStore()
    await apply(store, submitted(0))
    with pytest.raises(RuntimeError):
        async with store.batch() as batch:
            await batch.project(completed(0), 2)
            raise RuntimeError("the consumer died mid-batch")
    assert (await store.call("c0"))["outcome"] == "submitted"
    assert (await store.session("s1"))["completed"] == 0 and await store.offset() == 1


async def test_reads_of_missing_rows_are_none_and_close_is_harmless():
    store = MemoryStore()
    assert await store.call("x") is None and await store.session("x") is None and await store.decision("x") is None
    await store.close()
