"""`talaria`: session-aware residency routing, paper Algorithm 1 with Eq. 1 and Eq. 2.

    1  live lease for (session, model)?  ── instance answers and KV valid ──► consume, route
                                         │  (or leave a shared rotation: `_lease_or_leave`)
                                         └─ otherwise ──► discard (reason), fall through
    2  price every instance (costs.py): Eq. 1 terms, round-admission and HBM checks
    3  a candidate that would open a fresh replica must also pass Eq. 2
    4  none left ──► overload policy: reject (retry_after_s) | queue (least cost, bounded)
    5  of those, only where r's first token comes by its deadline (deadlines.py); none ──► reject
    6  route to argmin Cost(r, i)

Beyond the paper: prefix-aware placement of a new session (PolicyConfig.prefix_placement),
a tau that adapts to observed tool gaps (PolicyConfig.adaptive_lease), and a live lease that
does not hold a session in a rotation a move to where its model already runs would spare.
"""

from __future__ import annotations

from talaria.services.router import deadlines
from talaria.services.router.costs import HARD_REASONS, CostModel, Priced, eq1_total, in_rotation
from talaria.services.router.instances import ON_DEVICE
from talaria.services.router.policy import soft_reservation as sr
from talaria.services.router.policy.base import PlacementPolicy, PolicyConfig
from talaria.services.router.policy.registry import register
from talaria.services.router.state import RouterState, SessionEntry
from talaria.shared.events import CallCompleted, CallSubmitted, CandidateCost, Event, LeaseIssued, RoutingDecision
from talaria.shared.wire import replace


@register
class Talaria(PlacementPolicy):
    name = "talaria"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.costs = CostModel(self.config)

    # ---- Algorithm 1 ------------------------------------------------------------------

    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        entry = state.sessions.get(call.session_id)
        lease = entry.lease if entry is not None else None
        problem = None
        if lease is not None:
            problem = sr.lease_problem(state, lease, call, now, self.config)
            if problem is None:
                return self._lease_or_leave(state, lease, call, entry, now)
        hit = None
        if self.config.prefix_placement and call.block_hashes and (entry is None or entry.kv_tokens == 0):
            hit = state.prefix.match(call.model, call.block_hashes)
        priced = self.costs.price_all(state, state.instances.values(), call, entry, now, lease, hit)
        priced = self._replica_rule(state, call.model, priced, now)
        decision = self._choose(state, call, priced, now)
        if lease is None:
            return decision
        return replace(decision, lease_outcome="discarded", lease_instance=lease.instance_id,
                       discard_reason=problem)

    def _lease_or_leave(self, state: RouterState, lease: LeaseIssued, call: CallSubmitted,
                        entry: SessionEntry | None, now: float) -> RoutingDecision:
        """Consume the live lease, unless the rotation r's session pays at home on every later
        call makes another instance cheaper (step 1 of the module doc, beyond the paper).

        The paper consumes a live lease even where its instance is busier: the work queued
        there and the wait for r's model to come back are one call's, which the reservation
        rides out. What a lease must not ride out is the round sharing at home, which
        persists: where r's model shares the home's rounds with other models, every later
        call of the session pays that stretch (placement_s, costs.py). So only where the
        home's placement term is positive are the other instances priced, each in full (its
        queue, activation, a move's recompute or pull, its own rotation, what r's session adds
        to the sessions there), against the home's cost less its queue, reservations and
        activation; the session leaves only for one strictly cheaper where its model already
        has a slot in the rounds (`in_rotation`: running, queued or living there, as a peer's
        keep-alive routes to where the model is awake). So a move never adds a model to any
        instance's rotation and takes one out of the home's when r's session was its last
        there: slots only consolidate, and a session cannot trade one rotation for another
        on a snapshot's noise (the looser variants measured and dropped:
        docs/decisions/2026-12-05-lease-leaves-rotation.md). Where r's model runs alone at
        home (placement 0) the lease is consumed unpriced, as before. No constant."""
        view = state.instances[lease.instance_id]
        # The lease bypasses admission (its unit was charged while live); price it for the audit.
        home = self.costs.price(state, view, call, entry, now, own_lease=lease).cost
        if home.placement_s > 0:
            priced = self._replica_rule(
                state, call.model, self.costs.price_all(state, state.instances.values(), call, entry, now, lease), now)
            stay_s = home.total_s - home.queue_s - home.reserved_s - home.activation_s
            cheaper = [p for p in priced if p.cost.feasible and p.cost.instance_id != lease.instance_id
                       and p.cost.total_s < stay_s and p.view is not None
                       and (p.view.snapshot.active_model == call.model
                            or in_rotation(p.view, call.model, state.live_models(p.cost.instance_id, now)))]
            if cheaper:
                decision = self._choose(state, call, cheaper, now)
                if decision.action == "route":
                    return replace(decision, candidates=[p.cost for p in priced], lease_outcome="discarded",
                                   lease_instance=lease.instance_id, discard_reason="rotation_elsewhere_cheaper")
        return self._consume(state, lease, call, home, now)

    def _consume(self, state: RouterState, lease: LeaseIssued, call: CallSubmitted, home: CandidateCost,
                 now: float) -> RoutingDecision:
        cost = replace(home, feasible=True, reason="lease")
        opened = cost.model_state not in ON_DEVICE
        return self.route(
            state, call, now, lease.instance_id,
            candidates=(cost,),
            lease_outcome="consumed",
            lease_instance=lease.instance_id,
            expected_kv=cost.kv_state,
            model_opened=opened,
            avoidable_cold_open=opened and self._resident_elsewhere(state, call.model, lease.instance_id, now),
        )

    def _replica_rule(self, state: RouterState, model: str, priced: list[Priced], now: float) -> list[Priced]:
        """Eq. 2: a feasible candidate that needs a fresh replica stays only if gain > cost."""
        existing = [eq1_total(p.cost) for p in priced if p.cost.feasible and not p.fresh]
        best = min(existing) if existing else None
        out = []
        for p in priced:
            if p.fresh and p.cost.feasible:
                gain, threshold = self.costs.replica_gain(state, model, p, best, now)
                if not gain > threshold:
                    p = Priced(replace(p.cost, feasible=False,
                                       reason=f"eq2: gain {gain:.3f}s <= {threshold:.3f}s"), True, p.view)
            out.append(p)
        return out

    def _choose(self, state: RouterState, call: CallSubmitted, priced: list[Priced],
                now: float) -> RoutingDecision:
        model = call.model
        feasible = [p for p in priced if p.cost.feasible]
        reason = ""
        if not feasible and self.config.overload == "queue":
            feasible = [p for p in priced if p.cost.reason not in HARD_REASONS
                        and p.view is not None and p.view.queued_calls() < self.config.max_queued_per_instance]
            reason = "overload: queued past admission"
        candidates = tuple(p.cost for p in priced)
        if feasible and call.deadline_at > 0:  # placed where it cannot answer in time, it holds others up
            over = {p.cost.instance_id: p.view.snapshot.prefill_overstatement for p in feasible if p.view is not None}
            timely = {c.instance_id for c in deadlines.in_time(call, [p.cost for p in feasible], now, over)}
            if not timely:
                status, why = deadlines.refusal(call, [p.cost for p in feasible], now, over)
                return self.reject(state, call, now, why, candidates, status=status)
            feasible = [p for p in feasible if p.cost.instance_id in timely]
        if not feasible:
            hard = all(p.cost.reason in HARD_REASONS for p in priced)
            if hard:
                why = f"no healthy instance can serve {model}"
            else:  # say how far the best instance is from serving r in time, even after queueing
                soft = [p.cost for p in priced if p.cost.reason not in HARD_REASONS]
                ttft = min(c.queue_s + c.prefill_s + c.kv_recovery_s + c.activation_s for c in soft)
                bound = (f"; every instance already holds {self.config.max_queued_per_instance} calls"
                         if self.config.overload == "queue" else "")
                why = (f"overload: no instance passes admission (best predicted TTFT {ttft:.1f} s, "
                       f"budget {self.costs.budget:.1f} s){bound}")
            return self.reject(state, call, now, why, candidates)
        best = min(feasible, key=lambda p: (p.cost.total_s, p.cost.instance_id))
        opened = best.cost.model_state not in ON_DEVICE
        return self.route(
            state, call, now, best.cost.instance_id,
            candidates=candidates,
            expected_kv=best.cost.kv_state,
            model_opened=opened,
            # Hard-infeasible candidates carry model_state "absent", so they never count here.
            avoidable_cold_open=opened and any(
                p.cost.model_state in ON_DEVICE and p.cost.instance_id != best.cost.instance_id
                for p in priced),
            reason=reason,
        )

    def _resident_elsewhere(self, state: RouterState, model: str, chosen: str, now: float) -> bool:
        return any(v.model_state(model) in ON_DEVICE and iid != chosen and self.healthy(v, now)
                   for iid, v in state.instances.items())

    # ---- completion hook and expiry ------------------------------------------------------

    def react(self, state: RouterState, event: Event, now: float) -> list[Event]:
        if isinstance(event, CallCompleted):
            return sr.successor(state, event, self.config)
        return []

    def tick(self, state: RouterState, now: float) -> list[Event]:
        return sr.expiries(state, now)
