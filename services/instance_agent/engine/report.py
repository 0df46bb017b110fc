"""What the engine reports about itself: where each session's KV sits, and EngineStats
(the numbers the agent's snapshot and the round scheduler's cost profile are built from).

Functions of the engine (`eng`); split out of engine.py, which keeps the public methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from talaria.services.instance_agent.engine.admission import common_prefix
from talaria.services.instance_agent.engine.contract import EngineStats

if TYPE_CHECKING:
    from talaria.services.instance_agent.engine.torch_engine import TorchEngine


def kv_state(eng: TorchEngine, session_id: str, model: str) -> str:
    if model == eng.active_model and eng.sessions is not None and eng.sessions.get(session_id):
        return "device"
    if eng.hkvr is not None and model in eng.specs:
        if eng.hkvr.core.session_tokens(session_id, model, eng.page_size) > 0:
            return "host"
    return "none"


def device_prefix(eng: TorchEngine, session_id: str, model: str, prompt_ids: list[int]) -> int:
    """Leading tokens of `prompt_ids` the session's device KV holds (what admission reuses
    from it), 0 when it holds none for `model`. A prompt that does not extend the session's
    last one (a re-rendered turn) reuses only the common prefix."""
    entry = eng.sessions.get(session_id) if model == eng.active_model and eng.sessions is not None else None
    if entry is None or entry.model != model:
        return 0
    return common_prefix(entry.tokens, prompt_ids)


def session_states(eng: TorchEngine) -> list[tuple[str, str, str, int]]:
    out = []
    if eng.sessions is not None:
        out = [(e.session_id, e.model, "device", len(e.tokens)) for e in eng.sessions.entries()]
    on_device = {(s, m) for s, m, _, _ in out}
    if eng.hkvr is not None:
        out += [(s, m, "host", n) for s, m, n in eng.hkvr.core.session_prefixes(eng.page_size)
                if (s, m) not in on_device]
    return out


def stats(eng: TorchEngine) -> EngineStats:
    ps = eng.page_size
    cap = used = free_tail = pinned = 0
    if eng.pool is not None:
        cap = eng.pool.num_pages * ps
        used = (eng.pool.num_pages - eng.pool.num_free) * ps
        to_come = sum(s.pages_to_come() for s in list(eng.running.values()))
        pinned = min(cap, (eng.pool.num_pages - eng.pool.num_unused() + to_come) * ps)
        pb = eng.page_bytes(eng.active_model)
        top = eng.bump.kv_base + (eng.pool.highest_used() + 1) * pb
        free_tail = eng.bump.runtime_base - top
    core = eng.hkvr.core if eng.hkvr is not None else None
    weights = eng.layouts[eng.active_model].nbytes if eng.active_model else 0
    used_bytes = weights + (used // ps) * (eng.page_bytes(eng.active_model) if eng.active_model else 0)
    return EngineStats(
        active_model=eng.active_model, kv_capacity_tokens=cap, kv_used_tokens=used,
        prefill_tok_s=eng._rates["prefill"], decode_tok_s=eng._rates["decode"],
        restore_tok_s=eng._rates["restore"],
        last_switch_s=eng.switches[-1].total_s if eng.switches else 0.0,
        hbm_bytes=eng.bump.size, hbm_used_bytes=used_bytes + (eng.bump.size - eng.bump.runtime_base),
        staging_free_bytes=free_tail if eng.staging is not None else 0,
        staged_bytes=eng.staging.planner.staged_bytes() if eng.staging is not None else 0,
        running_calls=len(eng.running),
        host_kv_capacity_pages=core.capacity if core else 0,
        host_kv_used_pages=core.used_pages if core else 0,
        host_hits=core.counters.hits if core else 0, host_misses=core.counters.misses if core else 0,
        host_evictions=core.counters.evictions if core else 0,
        weight_bytes={m: lay.nbytes for m, lay in eng.layouts.items()},
        kv_pinned_tokens=pinned,
        staged_model=eng.staging.planner.target if eng.staging is not None else None,
    )
