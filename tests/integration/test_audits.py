"""Every operator audit in ops/audit/ runs against a real projected database and answers."""

import asyncio

import pytest

from talaria.services.telemetry.projector import project
from talaria.shared.events import (
    CallCompleted,
    CallSubmitted,
    CandidateCost,
    LeaseConsumed,
    LeaseDiscarded,
    LeaseIssued,
    RoutingDecision,
)
from talaria.shared.db.connection import create_engine
from talaria.audit import audits, params_of, query

pytestmark = pytest.mark.integration


def events():
    def sub(i):
        return CallSubmitted(call_id=f"c{i}", session_id="s1", model="qwen3-tiny", prompt_ids=[256] * 10,
                               block_hashes=[], max_tokens=4, submitted_at=1000.0 + 2 * i)

    out = []
    for i in range(3):
        lease = "consumed" if i == 1 else ("discarded" if i == 2 else "none")
        out += [
            sub(i),
            RoutingDecision(f"c{i}", "s1", i, "qwen3-tiny", "talaria", "route", 1000.0 + 2 * i,
                              chosen="agent-0" if i < 2 else "agent-1", lease_outcome=lease,
                              lease_instance="agent-0" if i else None,
                              discard_reason="expired" if i == 2 else None,
                              candidates=[CandidateCost("agent-0", 0.1), CandidateCost("agent-1", 0.7)],
                              model_opened=i == 2, avoidable_cold_open=i == 2),
            CallCompleted(f"c{i}", "s1", i, "qwen3-tiny", "agent-0" if i < 2 else "agent-1", 10, 4, "length",
                            1000.0 + 2 * i, 1000.1 + 2 * i, 1000.2 + 2 * i, 1000.5 + 2 * i,
                            kv_source="device" if i == 1 else "recompute", ttft_s=0.2),
            LeaseIssued("s1", "qwen3-tiny", "agent-0", f"c{i}", 1000.5 + 2 * i, 1001.5 + 2 * i),
        ]
    out.append(LeaseConsumed("s1", "qwen3-tiny", "agent-0", "c1", 1002.0))
    out.append(LeaseDiscarded("s1", "qwen3-tiny", "agent-0", "c2", "expired", 1004.0))
    return out


async def test_every_audit_query_runs_and_explains_the_session(database_url):
    db = create_engine(database_url)
    async with db.begin() as conn:
        for seq, event in enumerate(events(), start=1):
            await project(conn, event, seq)
    await db.dispose()
    results = {}
    for name, path in audits().items():
        params = {p: "s1" for p in params_of(path.read_text())}
        results[name] = await query(database_url, name, params)
    assert set(results) >= {"why_return_missed", "avoidable_cold_opens_per_hour", "lease_hit_rate_by_model",
                            "tau_effectiveness", "discard_reasons", "session_calls", "quarantined_events"}
    why = results["why_return_missed"]
    assert [r["lease_outcome"] for r in why] == ["none", "consumed", "discarded"]
    assert why[2]["discard_reason"] == "expired" and why[2]["moved"] is True and why[2]["avoidable_cold_open"]
    hit = results["lease_hit_rate_by_model"][0]
    assert (hit["issued"], hit["consumed"], hit["discarded"]) == (3, 1, 1)
    assert results["avoidable_cold_opens_per_hour"][0]["avoidable_cold_opens"] == 1
    assert sum(r["returns"] for r in results["tau_effectiveness"]) == 2
    assert [r["call_index"] for r in results["session_calls"]] == [0, 1, 2]
    assert results["quarantined_events"] == []


async def test_a_session_is_found_by_the_id_its_client_sent(database_url, capsys):
    """Two tenants sent `demo`, one `solo`: the stored ids are `<tenant>:<id>` (the gateway scopes them)."""
    from talaria.audit import run_audit, stored_sessions
    from talaria.running import AmbiguousSession

    db = create_engine(database_url)
    seq = 0
    async with db.begin() as conn:
        for sid in ("acme:demo", "default:demo", "default:solo"):
            for i, event in enumerate(events()[:3]):  # submitted, decided, completed
                seq += 1
                await project(conn, event.__class__(**{**{f: getattr(event, f) for f in event.__struct_fields__},
                                                       "call_id": f"{sid}-{i}", "session_id": sid}), seq)
    await db.dispose()
    assert sorted(await stored_sessions(database_url, "demo")) == ["acme:demo", "default:demo"]
    assert await stored_sessions(database_url, "emo") == []  # a suffix of an id is not the id

    async def audit(session: str, tenant: str | None = None) -> int:  # run_audit runs its own event loop
        return await asyncio.to_thread(run_audit, lambda: database_url, "session_calls", [f"session_id={session}"],
                                       "json", tenant)

    assert await audit("solo") == 0 and '"call_index": 0' in capsys.readouterr().out
    assert await audit("demo", tenant="acme") == 0 and '"call_index": 0' in capsys.readouterr().out
    with pytest.raises(AmbiguousSession, match="acme, default"):
        await audit("demo")
    assert await audit("demo", tenant="nobody") == 1
    assert "no session 'demo' of tenant 'nobody'" in capsys.readouterr().err
