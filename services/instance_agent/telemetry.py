"""The instance snapshot the router consumes: residency, session KV, queues, budgets, costs."""

from __future__ import annotations

from talaria.shared.messages import InstanceSnapshot, ModelResidency, SessionKv


def build_snapshot(settings, engine, sched, version: int, now: float) -> InstanceSnapshot:
    stats = engine.stats()
    view = sched.snapshot(now)
    active = engine.active_model
    staged = getattr(getattr(engine, "staging", None), "planner", None)
    staged_target = getattr(staged, "target", None) if staged is not None else None
    costs = sched.costs
    models = []
    for m in settings.models:
        state = "active" if m == active else ("staged" if m == staged_target else "resident")
        models.append(ModelResidency(
            model=m, state=state,
            switch_cost_s=costs.switch_s(active, m, settings.staging),
            open_cost_s=costs.switch_s(active, m, False),
            weight_bytes=int(stats.weight_bytes.get(m, 0)),
            context_length=int(engine.specs[m].context_length),
        ))
    sessions = [SessionKv(s, m, st, n) for s, m, st, n in engine.session_states()]
    return InstanceSnapshot(
        instance_id=settings.instance_id, version=version, at=now, pool=settings.pool, models=models,
        active_model=active, sessions=sessions, queued=dict(view.queued), queued_tokens=view.queued_tokens,
        running=sum(view.running.values()), round_remaining_s=view.round_remaining_s,
        deadline_risk=view.deadline_risk, kv_capacity_tokens=stats.kv_capacity_tokens,
        kv_used_tokens=stats.kv_used_tokens, kv_pinned_tokens=stats.kv_pinned_tokens, staging_free_bytes=stats.staging_free_bytes,
        hbm_bytes=stats.hbm_bytes, hbm_used_bytes=stats.hbm_used_bytes, prefill_tok_s=stats.prefill_tok_s,
        decode_tok_s=stats.decode_tok_s, restore_tok_s=stats.restore_tok_s, switch_s=view.switch_s,
        heartbeat_s=settings.heartbeat_s,
    )
