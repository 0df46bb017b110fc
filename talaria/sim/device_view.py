"""What a simulated instance's device reports: model residency, session KV and memory.

`AgentCore.snapshot` assembles the `InstanceSnapshot` (queues, round and risk from the
scheduler) as it does live; this supplies the parts a live agent reads from its engine,
computed from the profile and the executor's memory state. Per-model constants are computed
once, and the session list is rebuilt only when the KV changed (snapshots are frequent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from talaria.shared.snapshots import InstanceSnapshot, ModelResidency, SessionKv
from talaria.sim.profiles import ServerProfile


class SimDevice(Protocol):
    """What the view reads of a simulated instance (the executor, executor.py)."""

    id: str
    active: str | None
    switching_to: str | None
    core: Any  # its AgentCore (the one snapshot builder)
    kv: Any  # its KV state: device tokens by session, the host registry, a version
    staging: Any  # its staging state: the model being staged, if any

    def staged_bytes(self, now: float, model: str) -> int: ...


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The memory and rate fields of a snapshot (named as in `engine.contract.EngineStats`)."""

    kv_capacity_tokens: int
    kv_used_tokens: int
    staging_free_bytes: int
    hbm_bytes: int
    hbm_used_bytes: int
    prefill_tok_s: float
    decode_tok_s: float
    restore_tok_s: float
    migrate_bytes_s: float = 0.0  # the profile's link, as an agent's pulls would measure it
    migrate_setup_s: float = -1.0


class DeviceView:
    """Shared by a cluster's instances (one profile): caches that depend on the profile only."""

    def __init__(self, server: ServerProfile) -> None:
        self.server = server
        self._consts: dict[str, tuple] = {}
        self._models_cache: dict[tuple, list[ModelResidency]] = {}
        self._sessions: dict[str, tuple[int, list[SessionKv]]] = {}
        self._absent = {
            name: ModelResidency(model=name, state="absent", switch_cost_s=server.switch(name, 0)[1],
                                 open_cost_s=server.switch(name, 0)[1], weight_bytes=mp.weight_bytes,
                                 context_length=mp.max_context, kv_bytes_per_token=mp.kv_bytes_per_token)
            for name, mp in server.models.items()
        }

    def snapshot(self, inst: SimDevice, version: int, now: float, heartbeat_s: float) -> InstanceSnapshot:
        active = inst.active or inst.switching_to
        mp, pool, kv_cap, prefill_tok_s, decode_tok_s, restore_tok_s, _, _ = self.consts(
            active if active else next(iter(self.server.models)))
        dev = inst.kv.device_tokens
        memory = DeviceMemory(
            kv_capacity_tokens=kv_cap, kv_used_tokens=dev,
            staging_free_bytes=max(0, pool - dev * mp.kv_bytes_per_token), hbm_bytes=self.server.hbm_bytes,
            hbm_used_bytes=mp.weight_bytes + dev * mp.kv_bytes_per_token, prefill_tok_s=prefill_tok_s,
            decode_tok_s=decode_tok_s, restore_tok_s=restore_tok_s,
            migrate_bytes_s=self.server.link_bytes_s, migrate_setup_s=self.server.link_setup_s,
        )
        return inst.core.snapshot(version, now, pool=inst.config.pool, active_model=active, models=self.models(inst, now),
                                  sessions=self.sessions(inst), memory=memory, heartbeat_s=heartbeat_s)

    def consts(self, name: str) -> tuple:
        """Per-model snapshot fields that depend on the profile only (computed once)."""
        c = self._consts.get(name)
        if c is None:
            server = self.server
            mp = server.model(name)
            pool = server.kv_pool_bytes(mp.name)
            open_s = server.switch(name, 0)[1]
            c = self._consts[name] = (
                mp,
                pool,
                pool // mp.kv_bytes_per_token,
                25_000 / mp.prefill_s(25_000, 0),
                1.0 / mp.decode_step_s(1, 0),
                server.kv_restore_bytes_s / mp.kv_bytes_per_token,
                open_s,
                ModelResidency(model=name, state="active", switch_cost_s=0.0, open_cost_s=open_s,
                               weight_bytes=mp.weight_bytes, context_length=mp.max_context,
                               kv_bytes_per_token=mp.kv_bytes_per_token),
            )
        return c

    def sessions(self, inst: SimDevice) -> list[SessionKv]:
        """Device KV of the active model, then every host-restorable prefix not on device."""
        kv = inst.kv
        cached = self._sessions.get(inst.id)
        if cached is not None and cached[0] == kv.version:
            return cached[1]
        active = inst.active
        # host entries are mirrored from the registry's change feed; only the device filter is redone
        host = kv.host.entries()
        if active:
            device = kv.device
            sessions = [SessionKv(s, active, "device", t) for s, t in device.items()]
            sessions += [e for e in host if not (e.model == active and e.session_id in device)]
        else:
            sessions = list(host)
        self._sessions[inst.id] = (kv.version, sessions)
        return sessions

    def models(self, inst: SimDevice, now: float) -> list[ModelResidency]:
        """The residency list. Without a staging target it depends only on the active /
        switching-to model, so the same list object is reused (the router then reuses its
        per-snapshot lookup table too); a staged model's bytes grow with time."""
        target = inst.staging.target
        resident = (inst.active, inst.switching_to, target)
        if target is None:
            models = self._models_cache.get(resident)
            if models is None:
                models = self._models_cache[resident] = self._list(inst, resident, now)
            return models
        return self._list(inst, resident, now)

    def _list(self, inst: SimDevice, resident: tuple, now: float) -> list[ModelResidency]:
        return [self._absent[name] if name not in resident else self._residency(inst, name, now)
                for name in self.server.models]

    def _residency(self, inst: SimDevice, name: str, now: float) -> ModelResidency:
        if name == inst.active or name == inst.switching_to:
            return self.consts(name)[7]
        server = self.server
        staged = inst.staged_bytes(now, name)
        mp = server.model(name)
        return ModelResidency(
            model=name, state="staged" if staged else "absent", switch_cost_s=server.switch(name, staged)[1],
            open_cost_s=server.switch(name, 0)[1], weight_bytes=mp.weight_bytes, context_length=mp.max_context,
            kv_bytes_per_token=mp.kv_bytes_per_token,
        )
