"""Soft-reservation rules (paper §3.3, §4.1): install on completion, check on return, expire.

    CallCompleted ──► LeaseIssued(expires_at = completed_at + tau)     (only here)
    return, same session + model ──► live? model same? instance answers? KV valid?
          yes ──► record lease_outcome=consumed, route to the lease's instance
          no  ──► record lease_outcome=discarded (discard_reason), normal placement
    (RouterCore turns the record's outcome into LeaseConsumed / LeaseDiscarded: leases.settlement)
    tick(now) ──► LeaseExpired for every lease with expires_at <= now

Routing never refreshes a lease; only the next completion installs a successor.
Discard reasons, in the order they are checked: expired, model_changed, instance_gone,
instance_unhealthy (snapshot older than 2 * stale_after_s), hot_pool_pinned, kv_missing.
A lease these checks pass may still be discarded by the `talaria` policy itself, reason
rotation_elsewhere_cheaper (policy/talaria.py, `_lease_or_leave`).
"""

from __future__ import annotations

from talaria.services.router.policy.base import PolicyConfig
from talaria.shared.stats import quantile
from talaria.services.router.state import RouterState
from talaria.shared.events import CallCompleted, CallSubmitted, LeaseDiscarded, LeaseExpired, LeaseIssued

MIN_SESSION_GAPS = 3  # below this, the adaptive lease uses the model's gaps
MIN_MODEL_GAPS = 8  # below this, it uses the configured tau


def lease_problem(state: RouterState, lease: LeaseIssued, call: CallSubmitted, now: float,
                  cfg: PolicyConfig) -> str | None:
    """Why the lease cannot be consumed by `call`, or None when it can."""
    if not lease.live(now):
        return "expired"
    if lease.model != call.model:
        return "model_changed"
    view = state.instances.get(lease.instance_id)
    if view is None:
        return "instance_gone"
    if now - view.received_at > 2.0 * cfg.stale_after_s or not view.snapshot.healthy:
        return "instance_unhealthy"
    if view.pinned is not None and view.pinned != call.model:
        return "hot_pool_pinned"
    if lease.instance_id in state.draining:  # `talaria drain`: its sessions return elsewhere
        return "draining"
    kv = view.kv.get((call.session_id, call.model))
    if kv is not None and kv.state in ("device", "host"):
        return None
    if view.snapshot.at < lease.issued_at:
        return None  # the snapshot predates the completion that made the KV: nothing to judge
    return "kv_missing"


def successor(state: RouterState, done: CallCompleted, cfg: PolicyConfig) -> list:
    """Lease events for a completion: maybe discard a superseded lease, then issue one."""
    entry = state.sessions.get(done.session_id)
    if entry is None or done.call_index + 1 < entry.calls:
        return []  # a newer call of this session was already routed: no lease for this one
    if done.instance_id not in state.instances:
        return []
    old = entry.lease
    if old is not None and old.call_id == done.call_id:
        return []  # redelivered completion: its lease is already installed
    tau = lease_timeout(state, done.session_id, done.model, cfg)
    if tau <= 0.0:
        return []
    out: list = []
    if old is not None:
        out.append(LeaseDiscarded(old.session_id, old.model, old.instance_id, done.call_id,
                                  "superseded", done.completed_at))
    out.append(LeaseIssued(
        session_id=done.session_id,
        model=done.model,
        instance_id=done.instance_id,
        call_id=done.call_id,
        issued_at=done.completed_at,
        expires_at=done.completed_at + tau,
        kv_tokens=done.kv_tokens or done.prompt_tokens + done.output_tokens,
    ))
    return out


def lease_timeout(state: RouterState, session_id: str, model: str, cfg: PolicyConfig) -> float:
    """tau: fixed (paper), or adaptive: a quantile of this session's recent tool gaps (else
    of this model's), plus a margin for the return's trip, clamped to [lease_min, lease_max]."""
    if not cfg.adaptive_lease:
        return cfg.lease_timeout_s
    entry = state.sessions.get(session_id)
    gaps = entry.gaps if entry is not None and len(entry.gaps) >= MIN_SESSION_GAPS else None
    if gaps is None:
        prof = state.models.get(model)
        gaps = prof.gaps if prof is not None and len(prof.gaps) >= MIN_MODEL_GAPS else None
    if gaps is None:
        return cfg.lease_timeout_s
    tau = quantile(gaps, cfg.lease_quantile) + cfg.lease_margin_s
    return min(cfg.lease_max_s, max(cfg.lease_min_s, tau))


def expiries(state: RouterState, now: float) -> list[LeaseExpired]:
    """LeaseExpired for every lease dead at `now` (exactly at expires_at counts as dead)."""
    return [LeaseExpired(l.session_id, l.model, l.instance_id, now) for l in state.leases.due(now)]
