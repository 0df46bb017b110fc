"""Eq. 1 cost terms, the two admission checks, and the Eq. 2 replica-opening rule. Pure.

    Cost(r, i) = dR_req(r, i) + C_KV(r, i) + C_act(m_r, i)          (paper Eq. 1, seconds)

dR_req: the work queued on i, the new suffix's prefill, the expected output's decode (an
online estimate, never max_tokens), stretched by the other models in i's rounds; C_KV: 0 on
device, restore from host, migrate from another instance's pages (issue 40) or recompute,
whichever is cheapest; C_act: the model's activation on i. Each term, the admission checks
and the replica rule, with the measurements behind their choices, are `CostModel`'s
docstring.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import NamedTuple

from talaria.services.router.instances import ON_DEVICE, InstanceView, unavailable
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.state import RouterState, SessionEntry
from talaria.shared.events import CallSubmitted, CandidateCost, LeaseIssued
from talaria.shared.prefill_cost import prefill_s

GIB = float(1 << 30)
HARD_REASONS = frozenset({"stale", "unhealthy", "draining", "model_not_served", "hot_pool_pinned", "hbm"})


class Priced(NamedTuple):
    cost: CandidateCost
    fresh: bool  # serving r here means opening a new replica of m_r (Eq. 2 applies)
    view: InstanceView | None


@dataclass(frozen=True, slots=True)
class _Static:
    key: int
    hard: str  # "" or a HARD_REASONS member
    pf: float = 0.0  # seconds per prefilled token as this instance measures it (0: not active here)
    dec: float = 0.0  # seconds per decoded token
    restore: float = 0.0  # seconds per host-restored token, likewise
    mstate: str = "absent"
    act: float = 0.0  # C_act
    queue: float = 0.0  # snapshot backlog + deadline risk + wait for the active slot
    fresh: bool = False  # before the overlay: serving here opens a new replica
    weights_fit: bool = True
    kv_cap: int = 0
    kv_used: int = 0  # KV that running calls hold: idle sessions' KV is a cache, never a lock
    rotating: frozenset = frozenset()  # models with work in i's rounds (active or queued), other than m
    idle_active: str | None = None  # the active model, when it has no work here (not in rotating)


def _static_terms(cfg: PolicyConfig, view: InstanceView, model: str, prof, state: RouterState,
                  key: int) -> _Static:
    """The call-independent part of pricing `model` on `view`, memoised in `view.memo`.

    Valid while the snapshot (the view itself), the model's profile (`key` is its version)
    and the instance's round profile are unchanged; `RouterState.apply(RoundSummary)`
    clears the memo. A cache, not state: derived from the snapshot and folded profiles.
    """
    snap = view.snapshot
    iprof = state.instance_profiles.get(snap.instance_id)
    res = view.models.get(model)
    if res is None:
        return _Static(key, "model_not_served")
    if view.pinned is not None and view.pinned != model:
        return _Static(key, "hot_pool_pinned")
    # A snapshot's rates are its active model's: they price `model` only where it is active
    # (0 here: price_all uses the model's rate as engines measured it, _model_rates).
    here = snap.active_model == model
    pf = 1.0 / snap.prefill_tok_s if here and snap.prefill_tok_s > 0 else 0.0
    restore = 1.0 / snap.restore_tok_s if here and snap.restore_tok_s > 0 else 0.0
    # Decode: what completions measured (a call's time per token, its batch included); before
    # any, the engine's own rate where the model is active, else the configured fallback.
    dec = (prof.decode_s_per_tok if prof is not None else 0.0) or (
        1.0 / snap.decode_tok_s if here and snap.decode_tok_s > 0 else cfg.default_decode_s_per_tok)
    mstate = view.model_state(model)
    if mstate == "active":
        act = 0.0
    elif mstate in ("resident", "staged"):
        act = res.switch_cost_s or snap.switch_s or cfg.default_open_s
    else:
        measured = iprof.switch_s if iprof is not None else 0.0
        act = res.open_cost_s or res.switch_cost_s or snap.switch_s or measured or cfg.default_open_s
    # The agent's own prediction of the prefill ahead when it reports one (it knows which
    # queued prompts find their prefix on device); else every queued prompt token.
    ahead = snap.queued_prefill_s if snap.queued_prefill_s >= 0 else snap.queued_tokens * (
        pf or _model_rates(cfg, prof)[0])
    # (Not the snapshot's deadline_risk: that is the agent's lifetime count of risk events,
    # so charging it as a level penalised an instance for its whole history.)
    # A long prefill under way: each of r's steps alternates with its chunks until it is done.
    queue = ahead + max(0.0, snap.prefill_left_s)
    if mstate != "active" and snap.active_model is not None:
        queue += snap.round_remaining_s
    # HBM: an absent model's weights must fit at all; r's KV must fit the KV pool, where a
    # cold instance switching to m frees the previous model's pool (its KV moves to host).
    weights_fit = not (mstate not in ON_DEVICE and snap.hbm_bytes and res.weight_bytes > snap.hbm_bytes)
    fresh = mstate not in ON_DEVICE and mstate != "staged" and not snap.queued.get(model)
    # The active model rotates with r only while it has work here (calls running or queued):
    # an idle instance's last model is swapped out once (C_act) and never comes back on its
    # own. Its sessions that may bring it back are counted from the router's homes in
    # price_all: live ones fully, ones idle past every measured gap by _comeback.
    idle = snap.running == 0 and not snap.queued.get(snap.active_model or "")
    rotating = frozenset(k for k, n in snap.queued.items() if n) | (
        {snap.active_model} if snap.active_model and not idle else set())
    # Only KV held by running calls can refuse a call: idle sessions' KV is evicted (to the
    # host registry when it is on) as the new call's pages are allocated, oldest first.
    held = snap.kv_pinned_tokens if snap.kv_pinned_tokens >= 0 else snap.kv_used_tokens
    return _Static(key, "", pf, dec, restore, mstate, act, queue, fresh, weights_fit,
                   snap.kv_capacity_tokens, held, rotating - {model},
                   snap.active_model if idle and snap.active_model != model else None)


class CostModel:
    """dR_req  queue_s   = the agent's predicted prefill ahead (its calibrated costs: a queued
                            prompt whose prefix is on device costs its new tokens only)
                            + the rest of the prefill under way there (prefill_left_s: a long
                            prompt's later chunks, which r's every step alternates with)
                            + overlay tokens still to compute * prefill rate
                            + round_remaining_s if m_r is not the active model (wait for the slot)
                            (audited as queue_s: the work queued there)
                reserved_s = live leases on i * lease_charge_s   (lease admission units)
                prefill_s = (prompt - reusable prefix K) * prefill rate  (the new suffix only)
                decode_s  = expected output * decode rate (the model's measured rate); the
                            expected output is estimated online, never max_tokens (a cap)
                            (output_estimate.py)
                            + stretch, with price_round_sharing (ours):
                            stretch = decode * k + k * switch_s, k = other models in i's rounds
                            (queued, active with calls running or queued, routed since the
                            snapshot, or with sessions that live on i between calls, homes.py;
                            an idle instance's last model whose sessions there have been idle
                            past every measured gap counts 1 / (gaps + 1), _comeback): every
                            such model takes a slot of each round and a switch before it, so
                            r's decode stretches; it steers sessions to instances that rotate
                            fewer models, and prices a move that would add a model to a rotation
        C_KV    0 if the prefix is on device, K * restore rate if host-restorable,
                K * prefill rate (profiled recompute) otherwise; or, where another instance
                holds r's session pages (its host registry or device: "remote", issue 40),
                migrate: setup + K_r * bytes/token / link bytes/s + K_r * restore rate
                + (K - K_r) * prefill rate, chosen only where cheaper than recompute
                (kv_state "migrated", kv_from the holder). Link rate and setup are what i's
                own pulls measured (its snapshot), else PolicyConfig's measured defaults.
        C_act   0 if m_r is active, advertised switch cost if resident/staged, open cost otherwise

        placement_s (ours) = the session's later calls x stretch: where r goes, the session
                stays (leases, KV), so each later call pays that rotation again. Later calls are
                measured, not tuned: a return expects about as many more as it made, a first call
                the calls per session its model has shown so far. So a long session leaves a
                crowded rotation once the recompute pays for itself, and a new one joins the
                instance whose rotation its whole session would stretch least.
                A first call also pays the calls running on i * new_session_running_s (a tuned
                constant, flat in the matrix's sensitivity table): the occupancy its later calls
                will share.
                join (ours, price_rotation_join): where r's model is new to i's rotation (nothing
                of it runs, is queued, was routed there or lives there between calls), the
                sessions of other models living on i (homes.py) x (r's decode + switch_s) x
                (1 + later): each of them waits through r's slot and one more switch per round,
                for every call r's session makes. The stretch above is what r suffers in a
                rotation; this is what r's session does to the sessions already there. Not on hot
                instances (their other models' sessions are leaving).
                move (ours): a return whose KV is not here (its session's context lives on another
                instance, or was lost) recomputes it here, kv_s of work its home would not need,
                and every other session living here (homes.py; a call running, or between calls
                and coming back) waits behind it: chunked prefill shares each step with their
                calls. So a move also pays kv_s x those sessions. The terms above are what r
                suffers; this, like join, is what r does to the others. Measured (issue 21, real
                WEKA sessions, gaps capped at 10 s, 6 seeds): returns moved 19-55 / 6-12 of
                ~9,700 at 60 / 100 % load instead of 65-160 / 78-138 (before it and the hot pools'
                forecast), SCT p50 over the best peer 1.053x -> 1.046x and 1.081x -> 1.014x; with
                the users' gaps kept moves 40-83 -> 3-30 at the same SCT (results/matrix_notes.md).
                placement_s ranks candidates; admission and Eq. 2 use the Eq. 1 terms only
                (Eq. 2's demand already counts the later calls).

    Rates (seconds per token) are the model's own, never another's: where m_r is active, what
    i's engine reports (step tokens / step time); elsewhere, what the engines running m_r
    report (ModelProfile.engine_*, folded from snapshots). A snapshot's rates belong to its
    active model, and a completion's prefill_s is the time of every step it shared (batch
    mates, a host restore), so prefill_s / its own new tokens overstated the rate up to ~18x
    for short suffixes (measured in the matrix) and priced recompute and admission from noise.
    Completion-derived rates remain the fallback for prefill (agents that report none), and
    the first choice for decode (a call's time per token, its batch included; before any
    completion: i's engine rate where m_r is active there, else the configured default).

    Each term is charged once: the reusable prefix K is in C_KV only and the suffix in
    prefill_s only, so recompute is never counted twice; activation is never in dR_req.

    Admission (both must pass, else the candidate is kept in the audit with feasible=False):
        round:  queue_s + reserved_s + prefill_s + kv_recovery_s + activation_s <= gamma * ttft_target
                (the simulated load ahead of and including r's prefill in its slot; an instance
                with nothing ahead of r always passes, so an oversized call is never starved;
                with kv_home_admits, an instance holding r's own KV on device or host passes
                too; a prefix another session left there does not count)
        HBM:    an absent model's weights fit HBM and r's prompt fits the KV pool; else "hbm",
                hard: r can never start there. r's expected KV (prompt + the KV quantile of its
                output, output_estimate.py; not prompt + max_tokens, a cap it seldom uses) beside
                the KV running calls hold: where it does not fit, "kv_full", soft. An instance
                with room is preferred, unless r's own KV is here (with kv_home_admits r waits
                at home, as it passes round admission there, rather than recompute elsewhere);
                where none has any, the call queues (overload "queue") and the engine admits it
                as KV frees, or preempts it if its output outgrows the pool, as every peer's
                engine does. Refusing it (before any completion the estimate is the client's
                cap: 32,000 from Claude Code) made talaria reject calls at 60 % load on a
                KV-tight server that every peer served.
    """

    def __init__(self, config: PolicyConfig) -> None:
        self.cfg = config
        self.budget = config.gamma * config.ttft_target_s

    def price(self, state: RouterState, view: InstanceView, call: CallSubmitted,
              entry: SessionEntry | None, now: float, own_lease: LeaseIssued | None = None,
              prefix_hit: dict[str, tuple[int, str]] | None = None) -> Priced:
        return self.price_all(state, [view], call, entry, now, own_lease, prefix_hit)[0]

    def price_all(
        self,
        state: RouterState,
        views,
        call: CallSubmitted,
        entry: SessionEntry | None,
        now: float,
        own_lease: LeaseIssued | None = None,
        prefix_hit: dict[str, tuple[int, str]] | None = None,
    ) -> list[Priced]:
        """Price `call` on every view. The hot loop of a decision: call-level values are
        hoisted out of it and per-(snapshot, model) terms come from `_static`.

        `own_lease`, the session's own lease, is not charged against the session itself. It
        is left out only while live: past its expiry (its LeaseExpired not folded yet) the
        index no longer counts it, and leaving it out again made reserved_s negative."""
        cfg, model, budget = self.cfg, call.model, self.budget
        stale_after, charge = cfg.stale_after_s, cfg.lease_charge_s
        prompt = call.prompt_tokens
        # max_tokens is the client's cap, not the call's length: decode is priced by the
        # expected output and KV fit by a high quantile of it (output_estimate.py)
        out_tokens = state.outputs.expected(call.session_id, model, call.max_tokens)
        kv_out = state.outputs.kv_tokens(call.session_id, model, call.max_tokens)
        own_key = (call.session_id, model)
        known = min(prompt, entry.kv_tokens) if entry is not None else 0
        first_call = entry is None or entry.calls == 0
        running_s = cfg.new_session_running_s
        sharing = cfg.price_round_sharing
        last_here = entry.last_instance if entry is not None and entry.model == model else None
        lease_index = state.leases.by_instance
        own_on = own_lease.instance_id if own_lease is not None and own_lease.live(now) else None
        prof = state.models.get(model)
        version = prof.version if prof is not None else -1
        # Calls the session is expected to make after this one, each paying the rotation it
        # joins here: a return expects about as many more as it made (entry.calls); a first
        # call, the calls per session measured for its model so far.
        live_models = state.live_models
        later = entry.calls if not first_call else (prof.calls_per_session() - 1.0 if prof is not None else 0.0)
        model_pf, model_restore = _model_rates(cfg, prof)
        # Attention: each prompt token also costs b per token before it (prefill_curve.py).
        ctx2 = prof.prefill_ctx_rate() if prof is not None else 0.0
        # Remote tier: the instance other than r's destination that holds most of r's pages
        remote = _holder(state, own_key, entry, now, stale_after) if cfg.migrate and known > 0 else None
        out: list[Priced] = []
        for view in views:
            snap = view.snapshot
            iid = snap.instance_id
            away = unavailable(view, state.draining, now, stale_after)
            if away:
                out.append(_infeasible(iid, away, view))
                continue
            st = view.memo.get(model)
            if st is None or st.key != version:
                st = view.memo[model] = _static_terms(cfg, view, model, prof, state, version)
            if st.hard:
                out.append(_infeasible(iid, st.hard, view))
                continue
            pf = st.pf or model_pf
            # ---- KV recovery: how much of the prompt is reusable here, and from where
            kvmap = view._kv if view._kv is not None else view.kv
            kv = kvmap.get(own_key)
            kv_from = ""
            own = True  # the KV found is this session's own (not a prefix another session left)
            if kv is not None and kv.state != "none" and kv.state != "recompute":
                k_have, kv_state = min(kv.kv_tokens, prompt), kv.state
            elif last_here == iid and snap.at < entry.last_used:  # type: ignore[union-attr]
                # The snapshot predates the completion that left this KV: trust the completion.
                k_have, kv_state = known, "device"
            elif prefix_hit and iid in prefix_hit:
                k_have, kv_state = _shared_prefix(kvmap, prefix_hit[iid], model, prompt)
                own = False
            else:
                k_have, kv_state = 0, "none"
            k_total = k_have if k_have > known else known
            if kv_state == "device":
                kv_s = (k_total - k_have) * pf
            elif kv_state == "host":
                kv_s = k_have * (st.restore or model_restore) + (k_total - k_have) * pf
            else:
                kv_s = prefill_s(pf, ctx2, k_total, 0)
                kv_state = "recompute" if k_total > 0 else "none"
                if remote is not None and remote[0] != iid and k_total > 0:
                    mig_s = _migrate_s(cfg, snap, remote, k_total, pf, st.restore or model_restore)
                    if mig_s < kv_s:
                        kv_s, kv_state, kv_from = mig_s, "migrated", remote[0]
            # ---- incremental queue / prefill / decode work; activation is static
            expiries = lease_index.get(iid)
            leases = len(expiries) - bisect_right(expiries, now) if expiries else 0
            if own_on == iid:
                leases -= 1
            overlay = view.overlay_tokens
            queued = st.queue + view.overlay_new_tokens * pf  # work queued there now (snapshot + routed since)
            reserved = leases * charge  # returns other sessions' leases may bring
            queue = queued + reserved
            prefill = prefill_s(pf, ctx2, prompt - k_total, k_total)
            decode = out_tokens * st.dec
            stretch = join = 0.0
            if sharing:
                # round sharing: each other model with work here takes a slot of every round,
                # so r's decode is stretched by the number of models it rotates with: those
                # with work queued or running, routed since the snapshot, or whose sessions
                # live here between calls (they bring the model back within a tool gap)
                others = len(st.rotating)
                for om in view.overlay_models:
                    if om != model and om not in st.rotating:
                        others += 1
                for om in live_models(iid, now):
                    if om != model and om not in st.rotating and om not in view.overlay_models:
                        others += 1
                if st.idle_active is not None and st.idle_active not in view.overlay_models:
                    others += _comeback(state, iid, st.idle_active, now, live_models(iid, now))
                # ... and waits through one switch per other model in every round
                stretch = decode * others + others * (snap.switch_s or cfg.default_open_s)
                if cfg.price_rotation_join:  # ... and the slot and switch r adds to the others' rounds
                    join = _join_externality(cfg, state, view, model, decode, live_models(iid, now), later)
                decode += stretch
            act = st.act
            reason = ""
            # Only load ahead of r can make an instance inadmissible: a call whose own work
            # exceeds the budget would otherwise be rejected everywhere, forever.
            place = snap.running * (decode if running_s is None else running_s) \
                if first_call else 0.0
            place += later * stretch + join  # the session keeps paying this rotation here
            if kv_state in ("recompute", "migrated") and known > 0:  # a move: r's KV is elsewhere, or lost
                # (a pull too: its pages are restored inside r's prefill, which others' steps share)
                place += kv_s * state.homes.sessions_on(iid, call.session_id)
            # r's own KV is here: with kv_home_admits it waits here rather than recompute elsewhere
            home = cfg.kv_home_admits and own and kv_state in ("device", "host") and k_have > 0
            if queue > 0 and queue + prefill + kv_s + act > budget and not home:
                reason = "round_admission"
            elif not st.weights_fit or (st.kv_cap > 0 and prompt >= st.kv_cap):
                reason = "hbm"  # it can never start here
            elif st.kv_cap > 0 and not home and \
                    (overlay + st.kv_used if st.mstate == "active" else 0) + prompt + kv_out > st.kv_cap:
                reason = "kv_full"  # a wait for running calls' KV, or an output past the estimate: soft
            out.append(Priced(
                CandidateCost(iid, queue + prefill + decode + kv_s + act + place, queued, prefill, decode, kv_s,
                              act, place, kv_state, st.mstate, not reason, reason, reserved_s=reserved,
                              kv_from=kv_from),
                st.fresh and not view.overlay_models.get(model),
                view,
            ))
        return out

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
        saving = best_existing - (eq1_total(c) - c.activation_s)
        prof = state.models.get(model)
        rate = prof.arrival_rate(now) if prof is not None else 0.0
        demand = 1.0 + rate * self.cfg.control_window_s + state.leases.live_for(model, now)
        return max(0.0, saving) * demand, threshold


def in_rotation(view: InstanceView, model: str, live) -> bool:
    """`model` already has a slot in i's rounds: it runs or is queued there, was routed there
    since the snapshot, or has a session living there between calls (`live`, homes.py)."""
    snap = view.snapshot
    busy_here = snap.active_model == model and (snap.running or snap.queued.get(model))
    return bool(busy_here or snap.queued.get(model) or view.overlay_models.get(model) or model in live)


def _join_externality(cfg: PolicyConfig, state: RouterState, view: InstanceView, model: str, decode: float,
                      live, later: float) -> float:
    """Seconds r's session adds to the other sessions on i when r's model is new to i's
    rotation (nothing of it runs, is queued, was routed there since the snapshot, or lives
    there between calls): each session of another model living there (homes.py) waits
    through r's slot (r's decode) and one more switch per round, once per call r's session
    makes (this one and `later`). 0 where the model already rotates, and on a hot instance
    (it rotates its pinned model only: other models' sessions there are leaving)."""
    snap = view.snapshot
    if view.pinned is not None or in_rotation(view, model, live):
        return 0.0
    sessions = state.homes.sessions_of_other_models(snap.instance_id, model)
    return sessions * (decode + (snap.switch_s or cfg.default_open_s)) * (1.0 + later)


def _comeback(state: RouterState, iid: str, model: str, now: float, live) -> float:
    """The share of a round slot an idle instance's last model `model` still claims there,
    beyond its live sessions (counted already, homes.py): a session of it that ran there and
    has been idle longer than every tool gap measured for the model is most likely done, yet
    returns with the chance that the next gap exceeds all n measured ones, 1 / (n + 1) (the
    rule of succession; 1 before any gap was measured). 0 when none of its sessions is
    known to have run there."""
    if model in live:
        return 0.0
    homes = state.homes.by_instance.get(iid, {}).get(model)
    if homes is None or not homes.idle_since:
        return 0.0
    prof = state.models.get(model)
    return 1.0 / (1 + (len(prof.gaps) if prof is not None else 0))


def _holder(state: RouterState, key: tuple[str, str], entry: SessionEntry, now: float, stale_after: float
            ) -> tuple[str, int, int] | None:
    """(instance, tokens, KV bytes per token) of the fresh instance reporting most of the
    session's pages for its model (device or host registry), or None; the session's last
    instance counts with its context when its snapshot predates that completion. A holder
    whose model reports no bytes per token cannot be priced, so is never a source."""
    best = None
    for iid, view in state.instances.items():
        snap = view.snapshot
        if now - view.received_at > stale_after or not snap.healthy:
            continue
        kv = (view._kv if view._kv is not None else view.kv).get(key)
        if kv is not None and kv.state in ("device", "host") and kv.kv_tokens > 0:
            tokens = kv.kv_tokens
        elif iid == entry.last_instance and entry.model == key[1] and snap.at < entry.last_used:
            tokens = entry.kv_tokens
        else:
            continue
        res = view.models.get(key[1])
        bpt = res.kv_bytes_per_token if res is not None else 0
        if bpt > 0 and (best is None or tokens > best[1]):
            best = (iid, tokens, bpt)
    return best


def _migrate_s(cfg: PolicyConfig, dest, remote: tuple[str, int, int], k_total: int, pf: float,
               restore: float) -> float:
    """Seconds to recover k_total prefix tokens on `dest` (a snapshot) by pulling the holder's
    pages: a fixed setup, the bytes over the link, the restore of the pages into the device
    pool (they arrive in the host registry), and recompute of any tail the holder lacks."""
    k = min(remote[1], k_total)
    bw = dest.migrate_bytes_s if dest.migrate_bytes_s > 0 else cfg.default_migrate_bytes_s
    setup = dest.migrate_setup_s if dest.migrate_setup_s >= 0 else cfg.default_migrate_setup_s
    return setup + k * remote[2] / bw + k * restore + (k_total - k) * pf


def _model_rates(cfg: PolicyConfig, prof) -> tuple[float, float]:
    """(prefill, restore) seconds per token of a model on an instance where it is not
    active: as the engines running it measured them (snapshots), else the fallbacks.
    Never another model's rate (what a snapshot reports belongs to its active model)."""
    if prof is None:
        return cfg.default_prefill_s_per_tok, cfg.default_restore_s_per_tok
    return (prof.prefill_rate() or cfg.default_prefill_s_per_tok,
            prof.engine_restore_s_per_tok or cfg.default_restore_s_per_tok)


def eq1_total(c: CandidateCost) -> float:
    """The paper's Eq. 1 cost of a candidate: its total without the session-placement term."""
    return c.total_s - c.placement_s


def _shared_prefix(kvmap, hit: tuple[int, str], model: str, prompt: int) -> tuple[int, str]:
    """A prefix another session left here counts only while that session's KV is reported."""
    owner = kvmap.get((hit[1], model))
    if owner is not None and owner.state in ("device", "host"):
        return min(hit[0], owner.kv_tokens, prompt), owner.state
    return 0, "none"


def _infeasible(iid: str, reason: str, view: InstanceView) -> Priced:
    # total_s 0 (not inf): the audit row must stay JSON-encodable; feasible=False rules it out.
    return Priced(CandidateCost(iid, 0.0, feasible=False, reason=reason), False, view)
