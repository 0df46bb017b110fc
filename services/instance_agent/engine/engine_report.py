"""What the engine reports about itself: where each session's KV sits, and EngineStats
(the numbers the agent's snapshot and the round scheduler's cost profile are built from).

Read-only functions over the parts `TorchEngine` (torch_engine.py) hands in.
"""

from __future__ import annotations

from talaria.services.instance_agent.engine.admission import common_prefix
from talaria.services.instance_agent.engine.contract import EngineStats, SwitchRecord
from talaria.services.instance_agent.engine.device_model import DeviceModel, Rates
from talaria.services.instance_agent.engine.model_store import ModelStore
from talaria.services.instance_agent.engine.sequence import Sequence
from talaria.services.instance_agent.memory.bump import BumpBuffer
from talaria.services.instance_agent.memory.hkvr import HostKvRegistry
from talaria.services.instance_agent.memory.staging import StagingExecutor


def kv_state(dev: DeviceModel | None, hkvr: HostKvRegistry | None, models: ModelStore, session_id: str,
             model: str) -> str:
    if dev is not None and model == dev.name and dev.sessions.get(session_id):
        return "device"
    if hkvr is not None and model in models.specs:
        if hkvr.core.session_tokens(session_id, model, models.page_size) > 0:
            return "host"
    return "none"


def device_prefix(dev: DeviceModel | None, session_id: str, model: str, prompt_ids: list[int]) -> int:
    """Leading tokens of `prompt_ids` the session's device KV holds (what admission reuses
    from it), 0 when it holds none for `model`. A prompt that does not extend the session's
    last one (a re-rendered turn) reuses only the common prefix."""
    entry = dev.sessions.get(session_id) if dev is not None and model == dev.name else None
    if entry is None or entry.model != model:
        return 0
    return common_prefix(entry.tokens, prompt_ids)


def device_tokens(dev: DeviceModel | None) -> dict[tuple[str, str], list[int]]:
    return {} if dev is None else {(e.session_id, e.model): e.tokens for e in dev.sessions.entries()}


def session_states(dev: DeviceModel | None, hkvr: HostKvRegistry | None, page_size: int
                   ) -> list[tuple[str, str, str, int]]:
    out = []
    if dev is not None:
        out = [(e.session_id, e.model, "device", len(e.tokens)) for e in dev.sessions.entries()]
    on_device = {(s, m) for s, m, _, _ in out}
    if hkvr is not None:
        out += [(s, m, "host", n) for s, m, n in hkvr.core.session_prefixes(page_size)
                if (s, m) not in on_device]
    return out


def stats(dev: DeviceModel | None, running: set[Sequence], models: ModelStore, bump: BumpBuffer,
          hkvr: HostKvRegistry | None, staging: StagingExecutor | None, rates: Rates,
          switches: list[SwitchRecord]) -> EngineStats:
    ps = models.page_size
    cap = used = free_tail = pinned = 0
    active = dev.name if dev is not None else None
    if dev is not None:
        pool = dev.pool
        cap = pool.num_pages * ps
        used = (pool.num_pages - pool.num_free) * ps
        to_come = sum(s.pages_to_come() for s in list(running))
        pinned = min(cap, (pool.num_pages - pool.num_unused() + to_come) * ps)
        pb = models.page_bytes(active)
        top = bump.kv_base + (pool.highest_used() + 1) * pb
        free_tail = bump.runtime_base - top
    core = hkvr.core if hkvr is not None else None
    weights = models.layouts[active].nbytes if active else 0
    used_bytes = weights + (used // ps) * (models.page_bytes(active) if active else 0)
    return EngineStats(
        active_model=active, kv_capacity_tokens=cap, kv_used_tokens=used,
        prefill_tok_s=rates.tok_s["prefill"], decode_tok_s=rates.tok_s["decode"],
        restore_tok_s=rates.tok_s["restore"],
        last_switch_s=switches[-1].total_s if switches else 0.0,
        hbm_bytes=bump.size, hbm_used_bytes=used_bytes + (bump.size - bump.runtime_base),
        staging_free_bytes=free_tail if staging is not None else 0,
        staged_bytes=staging.planner.staged_bytes() if staging is not None else 0,
        running_calls=len(running),
        host_kv_capacity_pages=core.capacity if core else 0,
        host_kv_used_pages=core.used_pages if core else 0,
        host_hits=core.counters.hits if core else 0, host_misses=core.counters.misses if core else 0,
        host_evictions=core.counters.evictions if core else 0,
        weight_bytes={m: lay.nbytes for m, lay in models.layouts.items()},
        kv_pinned_tokens=pinned,
        staged_model=staging.planner.target if staging is not None else None,
    )
