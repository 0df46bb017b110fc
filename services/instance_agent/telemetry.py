"""The live agent's snapshot inputs: model residency, session KV and memory, from the view the
engine published last (engine_view.py).

`AgentCore.snapshot` assembles the `InstanceSnapshot` (queues, round, risk from the
scheduler), as it does for a simulated instance (talaria/sim/device_view.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from talaria.services.instance_agent.engine_view import EngineView
from talaria.shared.catalog import ModelSpec
from talaria.shared.settings import AgentSettings
from talaria.shared.snapshots import InstanceSnapshot, ModelResidency, SessionKv


def build_snapshot(settings: AgentSettings, served: tuple[str, ...], view: EngineView, specs: Mapping[str, ModelSpec],
                   core, version: int, now: float, unhealthy: str = "", staging: bool = True,
                   migration=None) -> InstanceSnapshot:
    """`specs`: the engine's served models (Engine.specs, fixed once it is built).
    `migration` (kv_migration.KvMigration, or None): the page server peers pull from; with
    it the models' KV bytes per token and the measured pulls are reported (the router prices
    migration only then)."""
    stats = view.stats
    active = view.active_model
    staged_target = stats.staged_model
    costs = core.sched.costs
    models = []
    for m in served:
        state = "active" if m == active else ("staged" if m == staged_target else "resident")
        models.append(ModelResidency(
            model=m, state=state,
            switch_cost_s=costs.switch_s(active, m, staging),
            open_cost_s=costs.switch_s(active, m, False),
            weight_bytes=int(stats.weight_bytes.get(m, 0)),
            context_length=int(specs[m].context_length),
            kv_bytes_per_token=migration.bytes_per_token(m) if migration is not None else 0,
        ))
    sessions = [SessionKv(s, m, st, n) for s, m, st, n in view.sessions]
    snap = core.snapshot(version, now, pool=settings.pool, active_model=active, models=models, sessions=sessions,
                         memory=stats, heartbeat_s=settings.heartbeat_s)
    if migration is not None:
        snap = msgspec.structs.replace(
            snap, page_address=migration.address, migrate_bytes_s=migration.link_bytes_s or 0.0,
            migrate_setup_s=migration.setup_s if migration.setup_s is not None else -1.0)
    if unhealthy:  # the watchdog sees a stuck engine step: the router stops choosing us
        snap = msgspec.structs.replace(snap, healthy=False, unhealthy_reason=unhealthy)
    return snap
