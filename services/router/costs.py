"""Eq. 1 cost terms, the two admission checks, and the Eq. 2 replica-opening rule. Pure.

    Cost(r, i) = dR_req(r, i) + C_KV(r, i) + C_act(m_r, i)          (paper Eq. 1, seconds)

    dR_req  queue_s   = (snapshot backlog + overlay tokens) * prefill rate
                        + live leases on i * lease_charge_s          (lease admission units)
                        + deadline_risk * penalty                    (underestimated instances)
                        + round_remaining_s if m_r is not the active model (wait for the slot)
            prefill_s = (prompt - reusable prefix K) * prefill rate  (the new suffix only)
            decode_s  = max_tokens * decode rate
    C_KV    0 if the prefix is on device, K * restore rate if host-restorable,
            K * prefill rate (profiled recompute) otherwise
    C_act   0 if m_r is active, advertised switch cost if resident/staged, open cost otherwise

Each term is charged once: the reusable prefix K is in C_KV only and the suffix in
prefill_s only, so recompute is never counted twice; activation is never in dR_req.

Admission (both must pass, else the candidate is kept in the audit with feasible=False):
    round:  queue_s + prefill_s + kv_recovery_s + activation_s <= gamma * ttft_target
            (the simulated load ahead of and including r's prefill in its slot)
    HBM:    r's KV (prompt + max_tokens) fits the KV pool; an absent model's weights fit HBM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.router.instances import ON_DEVICE, InstanceView
from services.router.policy.base import PolicyConfig
from services.router.state import RouterState, SessionEntry
from shared.messages import CallSubmitted, CandidateCost

GIB = float(1 << 30)
HARD_REASONS = frozenset({"stale", "model_not_served", "hot_pool_pinned", "hbm"})


@dataclass(frozen=True, slots=True)
class Priced:
    cost: CandidateCost
    fresh: bool  # serving r here means opening a new replica of m_r (Eq. 2 applies)
    view: InstanceView | None


class CostModel:
    def __init__(self, config: PolicyConfig) -> None:
        self.cfg = config
        self.budget = config.gamma * config.ttft_target_s

    def price(
        self,
        state: RouterState,
        view: InstanceView,
        call: CallSubmitted,
        entry: SessionEntry | None,
        now: float,
        own_lease_on: str | None = None,
        prefix_hit: dict[str, tuple[int, str]] | None = None,
    ) -> Priced:
        cfg, snap, iid, model = self.cfg, view.snapshot, view.snapshot.instance_id, call.model
        if now - view.received_at > cfg.stale_after_s:
            return _infeasible(iid, "stale", view)
        res = view.models.get(model)
        if res is None:
            return _infeasible(iid, "model_not_served", view)
        if view.pinned is not None and view.pinned != model:
            return _infeasible(iid, "hot_pool_pinned", view)

        prof = state.models.get(model)
        pf = (prof.prefill_s_per_tok if prof and prof.prefill_s_per_tok > 0 else 0.0) or (
            1.0 / snap.prefill_tok_s if snap.prefill_tok_s > 0 else cfg.default_prefill_s_per_tok)
        dec = (prof.decode_s_per_tok if prof and prof.decode_s_per_tok > 0 else 0.0) or (
            1.0 / snap.decode_tok_s if snap.decode_tok_s > 0 else cfg.default_decode_s_per_tok)
        restore = 1.0 / snap.restore_tok_s if snap.restore_tok_s > 0 else cfg.default_restore_s_per_tok

        # ---- KV recovery: how much of the prompt is reusable, and from where
        prompt = call.prompt_tokens
        k_have, kv_state = _kv_here(view, call, entry, prefix_hit)
        k_total = min(prompt, max(k_have, entry.kv_tokens if entry is not None else 0))
        if kv_state == "device":
            kv_s = (k_total - k_have) * pf
        elif kv_state == "host":
            kv_s = k_have * restore + (k_total - k_have) * pf
        else:
            kv_s = k_total * pf
            kv_state = "recompute" if k_total > 0 else "none"

        # ---- model activation
        mstate = view.model_state(model)
        if mstate == "active":
            act = 0.0
        elif mstate in ("resident", "staged"):
            act = res.switch_cost_s or snap.switch_s or cfg.default_open_s
        else:
            measured = state.instance_profiles.get(iid)
            act = res.open_cost_s or res.switch_cost_s or snap.switch_s or (
                measured.switch_s if measured and measured.switch_s > 0 else cfg.default_open_s)

        # ---- incremental queue / prefill / decode work
        leases = state.leases.live_on(iid, now) - (1 if own_lease_on == iid else 0)
        queue = (snap.queued_tokens + view.overlay_tokens) * pf + leases * cfg.lease_charge_s
        queue += snap.deadline_risk * cfg.deadline_risk_penalty_s
        if mstate != "active" and snap.active_model is not None:
            queue += snap.round_remaining_s
        prefill = (prompt - k_total) * pf
        decode = call.max_tokens * dec
        total = queue + prefill + decode + kv_s + act

        reason = ""
        if queue + prefill + kv_s + act > self.budget:
            reason = "round_admission"
        elif not _hbm_fits(view, res, mstate, prompt + call.max_tokens):
            reason = "hbm"
        fresh = mstate not in ON_DEVICE and mstate != "staged" and not snap.queued.get(model) \
            and not view.overlay_models.get(model)
        cost = CandidateCost(iid, total, queue, prefill, decode, kv_s, act, kv_state, mstate,
                             not reason, reason)
        return Priced(cost, fresh, view)

    # ---- Eq. 2 --------------------------------------------------------------------------

    def replica_gain(self, state: RouterState, model: str, candidate: Priced,
                     best_existing: float | None, now: float) -> tuple[float, float]:
        """(gain, threshold) of opening `model` on the candidate; open only if gain > threshold.

        gain(m, j) = per-call saving vs the best instance already serving m, times the calls
        of m expected over the control window (observed arrival rate * window + reserved
        returns, i.e. live leases for m, + this call). No feasible existing replica makes the
        whole demand spillover: gain is infinite.
        threshold  = T_swap(m, j) + mu_j * dW_m + nu_m, with mu_j = price * HBM pressure of j,
        halved when j's free staging bytes already cover the weights (staging slack).
        """
        c, view = candidate.cost, candidate.view
        assert view is not None
        snap = view.snapshot
        res = view.models[model]
        pressure = snap.hbm_used_bytes / snap.hbm_bytes if snap.hbm_bytes > 0 else 0.0
        mu = self.cfg.hbm_price_s_per_gib * pressure
        if res.weight_bytes and snap.staging_free_bytes >= res.weight_bytes:
            mu *= 0.5
        threshold = c.activation_s + mu * (res.weight_bytes / GIB) + self.cfg.replica_penalty(model)
        if best_existing is None:
            return math.inf, threshold
        saving = best_existing - (c.total_s - c.activation_s)
        prof = state.models.get(model)
        rate = prof.arrival_rate(now) if prof is not None else 0.0
        demand = 1.0 + rate * self.cfg.control_window_s + state.leases.live_for(model, now)
        return max(0.0, saving) * demand, threshold


def _kv_here(view: InstanceView, call: CallSubmitted, entry: SessionEntry | None,
             prefix_hit: dict[str, tuple[int, str]] | None) -> tuple[int, str]:
    """(tokens reusable on this instance, their state) for the call's session."""
    kv = view.kv.get((call.session_id, call.model))
    if kv is not None and kv.state in ("device", "host"):
        return min(kv.kv_tokens, call.prompt_tokens), kv.state
    if (entry is not None and entry.last_instance == view.snapshot.instance_id
            and entry.model == call.model and view.snapshot.at < entry.last_used):
        # The snapshot predates the completion that left this KV: trust the completion.
        return min(entry.kv_tokens, call.prompt_tokens), "device"
    if prefix_hit:
        hit = prefix_hit.get(view.snapshot.instance_id)
        if hit is not None:
            owner = view.kv.get((hit[1], call.model))
            if owner is not None and owner.state in ("device", "host"):
                return min(hit[0], owner.kv_tokens, call.prompt_tokens), owner.state
    return 0, "none"


def _hbm_fits(view: InstanceView, res, mstate: str, need_tokens: int) -> bool:
    snap = view.snapshot
    if mstate not in ON_DEVICE and snap.hbm_bytes and res.weight_bytes > snap.hbm_bytes:
        return False
    cap = snap.kv_capacity_tokens
    if cap <= 0:
        return True  # not reported: no check
    # A cold instance switching to m frees the previous model's KV pool (it moves to host).
    used = snap.kv_used_tokens + view.overlay_tokens if mstate == "active" else 0
    return used + need_tokens <= cap


def _infeasible(iid: str, reason: str, view: InstanceView) -> Priced:
    # total_s 0 (not inf): the audit row must stay JSON-encodable; feasible=False rules it out.
    return Priced(CandidateCost(iid, 0.0, feasible=False, reason=reason), False, view)
