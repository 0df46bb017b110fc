"""The gateway's view of which models live agents serve (gateway_service.ServedModels)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec

from talaria.services.gateway import gateway_service
from talaria.services.gateway.gateway_service import FORGET_AFTER_S, STALE_AFTER_S, ServedModels
from talaria.shared.snapshots import InstanceSnapshot, ModelResidency


def beat(iid: str, model: str) -> SimpleNamespace:
    snap = InstanceSnapshot(
        instance_id=iid, version=1, at=0.0, pool="cold", models=[ModelResidency(model, "active", 0.0, 1.0, 1)],
        active_model=model, sessions=[], queued={}, queued_tokens=0, queued_prefill_s=0.0, running=0,
        round_remaining_s=0.0, deadline_risk=0, kv_capacity_tokens=0, kv_used_tokens=0, kv_pinned_tokens=-1,
        hbm_bytes=0, hbm_used_bytes=0, staging_free_bytes=0, prefill_tok_s=1.0, decode_tok_s=1.0,
        restore_tok_s=1.0, incarnation="", heartbeat_s=0.5)
    return SimpleNamespace(data=msgspec.json.encode(snap))


def test_a_silent_agent_stops_serving_and_is_then_forgotten(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(gateway_service.time, "monotonic", lambda: clock[0])
    served = ServedModels(("m1", "m2"))
    asyncio.run(served.on_snapshot(beat("agent-old", "m1")))
    assert served() == [("m1", "talaria")]
    clock[0] += STALE_AFTER_S + 0.1  # silent: it serves nothing, though still remembered
    asyncio.run(served.on_snapshot(beat("agent-new", "m2")))
    assert served() == [("m2", "talaria")] and "agent-old" in served._snapshots
    clock[0] += FORGET_AFTER_S  # gone for good (agents restart under new ids): forgotten
    asyncio.run(served.on_snapshot(beat("agent-new", "m2")))
    assert set(served._snapshots) == {"agent-new"} and served.health()["instances"] == ["agent-new"]
