"""Metrics exactly as the paper defines them (§5.1, App. A).

- Percentiles: nearest rank (`shared/stats.quantile`). For N observations sorted ascending,
  p_q is the observation at rank ceil(q * N / 100) (1-based).
- SCT: per model-session, from the first call's release (its intended enqueue) to the
  final call's completion. A session that gave up a call (talaria/sim/agents.py) never
  completes: its SCT is inf, and so is the TTFT of the call it gave up, so no metric can
  improve by dropping work.
- Goodput: calls whose first token came within the router's TTFT target, per second of
  the run (first release to last completion).
- TTFT: schedule-aware, from a call's intended enqueue (release) to its first token, so
  it includes routing, queueing, slot waits and switches.
- Oracle: a session's SCT if every call found its reusable KV on device, never queued and
  never waited for a switch: the sum of its gaps plus, per call, the prefill of its new
  tokens on top of the reusable prefix and its decode at batch 1.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

from talaria.shared.stats import quantile
from talaria.sim.cluster import RunResult
from talaria.sim.profiles import ServerProfile
from talaria.traces.format import Session
from talaria.traces.gaps import GapModel

GiB = 1024**3


def call_alone_s(mp, call) -> tuple[float, float]:
    """(prefill, decode) seconds of one call alone on `mp` (a SimModelProfile): its new tokens
    on top of its reusable prefix, then batch-1 decode with growing context (the sum of step
    times in closed form; the first token comes with the prefill)."""
    n = call.output_tokens - 1
    decode = n * (mp.decode_d0_s + mp.decode_d1_s) + mp.decode_d2_s * (n * (call.prompt_tokens + 1) + n * (n - 1) / 2)
    return mp.prefill_s(max(1, call.new_tokens), call.reusable_prefix_tokens), decode


def oracle_sct(session: Session, server: ServerProfile, gaps: GapModel) -> float:
    """SCT lower bound: all KV on device, no queueing, no switch waits (see module doc)."""
    mp = server.model(session.model)
    total = 0.0
    for call in session.calls:
        if call.call_index > 0:
            total += gaps.gap(call)
        prefill, decode = call_alone_s(mp, call)
        total += prefill
        total += decode
    return total


def _pcts(values: Sequence[float]) -> dict[str, float]:
    return {"p50": quantile(values, 0.50), "p95": quantile(values, 0.95), "n": len(values)}


def session_scts(result: RunResult) -> dict[str, float]:
    """SCT of every session whose every call completed."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    done: Counter = Counter()
    for job in result.jobs:
        if job.call_index == 0:
            first[job.session] = job.release_t
        last[job.session] = max(last.get(job.session, 0.0), job.done_t)
        done[job.session] += 1
    depth = {s.id: len(s.calls) for s in result.sessions}
    return {s: last[s] - first[s] for s in first if s in last and done[s] == depth.get(s)}


def goodput(result: RunResult, ttft_target_s: float) -> float:
    """Calls with TTFT <= target per second from the first release to the last completion."""
    if not result.jobs:
        return 0.0
    start = min(j.release_t for j in result.jobs)
    end = max(j.done_t for j in result.jobs)
    good = sum(1 for j in result.jobs if j.first_token_t - j.release_t <= ttft_target_s)
    return good / (end - start) if end > start else math.nan


def summarise(result: RunResult) -> dict:
    """Everything a report needs from one run, as plain JSON-able data (seconds)."""
    cfg = result.config
    scts = session_scts(result)
    oracle = {s.id: oracle_sct(s, cfg.server, cfg.gaps) for s in result.sessions}
    rc = result.router
    ttft = [j.first_token_t - j.release_t for j in result.jobs] + [math.inf] * rc.gave_up
    ttft_ret = [j.first_token_t - j.release_t for j in result.jobs if j.call_index > 0]
    switches = [sw for inst in result.instances for sw in inst.switches]
    by_path: dict[str, list[float]] = defaultdict(list)
    for sw in switches:
        by_path[sw.path].append(sw.total_s)
    rounds = [r for inst in result.instances for r in inst.rounds]
    wall = sum(r.wall_s for r in rounds)
    switch_s = sum(r.switch_s for r in rounds)
    sp_admitted = sum(i.sched.sp_admitted for i in result.instances)
    sp_parked = sum(i.sched.sp_parked for i in result.instances)
    complete = len(scts) == len(result.sessions)
    sct_vals = list(scts.values()) + [math.inf] * (len(result.sessions) - len(scts))
    oracle_vals = [oracle[s] for s in scts]
    per_session = [
        {"session": s, "model": sess.model, "sct": scts.get(s), "oracle": oracle[s]}
        for s, sess in ((x.id, x) for x in result.sessions)
    ]
    return {
        "label": cfg.label,
        "policy": cfg.policy,
        "profile": cfg.server.name,
        "instances": cfg.instances,
        "flags": {"sp": cfg.scheduler.sp, "hkvr": cfg.scheduler.hkvr, "staging": cfg.scheduler.staging},
        "lease_timeout_s": cfg.policy_config.lease_timeout_s,
        "adaptive_lease": cfg.policy_config.adaptive_lease,
        "gap_model": cfg.gaps.describe(),
        "sessions": len(result.sessions),
        "calls": len(result.jobs),
        "complete": complete,
        "sct_p50": quantile(sct_vals, 0.50),
        "sct_p95": quantile(sct_vals, 0.95),
        "ttft_p50": quantile(ttft, 0.50),
        "ttft_p95": quantile(ttft, 0.95),
        "returning_ttft_p50": quantile(ttft_ret, 0.50),
        "returning_ttft_p95": quantile(ttft_ret, 0.95),
        "oracle": {
            "sct_p50": quantile(oracle_vals, 0.50),
            "sct_p95": quantile(oracle_vals, 0.95),
            "violations": sum(1 for s in scts if scts[s] < oracle[s] - 1e-6),
        },
        "per_session": per_session,
        "ttft_samples": sorted(ttft),
        "kv_sources": dict(Counter(j.kv_source for j in result.jobs)),
        "admitted_via": dict(Counter(j.via for j in result.jobs)),
        "switch": {
            "count": len(switches),
            "p50": quantile([s.total_s for s in switches], 0.50),
            "p95": quantile([s.total_s for s in switches], 0.95),
            "mean": sum(s.total_s for s in switches) / len(switches) if switches else math.nan,
            "by_path": {p: {**_pcts(v), "share": len(v) / len(switches)} for p, v in sorted(by_path.items())},
            "samples": sorted(s.total_s for s in switches),
            "total_s": sum(s.total_s for s in switches),
        },
        "rounds": {
            "count": len(rounds),
            "wall_s": wall,
            "active_s": wall - switch_s,
            "switch_s": switch_s,
            "switch_share": switch_s / wall if wall else math.nan,
        },
        "sp": {
            "admitted": sp_admitted,
            "parked": sp_parked,
            "admission_rate": sp_admitted / (sp_admitted + sp_parked) if sp_admitted + sp_parked else math.nan,
        },
        "router": {
            "routed": rc.routed,
            "rejected": rc.rejected,
            "retries": rc.retries,
            "gave_up": rc.gave_up,
            "same_instance_returns": rc.same_instance_returns / rc.returns if rc.returns else math.nan,
            "model_residency_hits": rc.model_residency_hits / rc.routed if rc.routed else math.nan,
            "model_opens_needed": rc.model_opens_needed,
            "model_opens": sum(len(i.switches) for i in result.instances),
            "policy_avoidable_cold_opens": rc.policy_avoidable_cold_opens,
            "leases_issued": rc.leases_issued,
            "leases_consumed": rc.leases_consumed,
            "leases_discarded": rc.leases_discarded,
            "leases_expired": rc.leases_expired,
            "unused_leases": rc.leases_discarded + rc.leases_expired,
            "mean_decision_us": rc.decision_us / rc.routed if rc.routed else math.nan,
            "repins": rc.repins,  # hot-pool moves (RunConfig.hot_pools)
        },
        "avoidable_cold_opens": rc.avoidable_cold_opens,
        "rejected": rc.rejected,
        "retries": rc.retries,
        "gave_up": rc.gave_up,
        "sessions_incomplete": len(result.sessions) - len(scts),
        "goodput_calls_s": goodput(result, cfg.policy_config.ttft_target_s),
        "hbm_peak_gib_per_gpu": max((i.hbm_peak_bytes for i in result.instances), default=0)
        / cfg.server.gpus
        / GiB,
        "hbm_cap_gib_per_gpu": cfg.server.hbm_per_gpu_bytes / GiB,
        "deadline_risk": sum(i.sched.deadline_risk for i in result.instances),
        "host_kv_evictions": sum(i.kv.host_evictions for i in result.instances),
        "virtual_s": result.virtual_s,
        "sim_wall_s": result.wall_s,
        "events": result.events,
    }
