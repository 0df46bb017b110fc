"""The placement-policy contract: `(state, call, now) -> RoutingDecision`, pure.

A policy never mutates `RouterState`; it returns the audit record itself (the
`RoutingDecision` that goes on the stream). `RouterCore` derives the lease and dispatch
events from it and folds them into the state, so live routing, the simulator and unit
tests all run the same code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from talaria.services.router.policy import serverless
from talaria.services.router.state import InstanceView, RouterState
from talaria.shared.events import CallSubmitted, Event, RoutingDecision


OVERLOAD_MODES = ("reject", "queue")


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs shared by all policies; each policy reads the ones it uses. Times in seconds.

    Defaults come from the paper where it gives a number (App. E, calibration.md) and are
    marked "ours" where it does not.
    """

    # soft reservation (paper §3.3, App. E)
    lease_timeout_s: float = 1.0  # tau; near the p90 tool gap
    lease_charge_s: float = 0.25  # one admission unit a live lease charges (ours)
    adaptive_lease: bool = False  # beyond the paper: tau from the session's observed gaps
    lease_quantile: float = 0.9
    lease_min_s: float = 0.25
    lease_max_s: float = 5.0
    lease_margin_s: float = 0.05  # gateway + router latency added to the gap quantile
    # admission and overload (Eq. 5, §3.3)
    gamma: float = 0.9  # simulated round load must stay <= gamma * ttft_target
    ttft_target_s: float = 10.0
    stale_after_s: float = 2.0  # older snapshots: no new non-reserved placements
    overload: str = "queue"  # queue (ours: reject only past the queue bound) | reject (the paper)
    # Beyond the paper (ours): a return whose KV is on an instance passes that instance's
    # round admission. Its own work there is a restore or nothing; failing it would send the
    # session to an idle instance to recompute and open its model (measured: router testbed
    # SCT p95 over 8 gap seeds, medium 171.6 -> 169.2 s, high 177.7 -> 176.3 s).
    kv_home_admits: bool = True
    # Beyond the paper (ours): a session's first call places the whole session (leases keep
    # its later calls there), so it also pays `new_session_running_s` per call already
    # running there (each will share its slots). Chosen on the router testbed; the matrix's
    # sensitivity table and results/router_sensitivity.md show it flat. 0.0 turns it off.
    # (A weight on the backlog it joins, chosen with it, was dropped: once decode was priced
    # over the session's calls it only cost, matrix over 8 seeds cells behind 12 -> 9.)
    new_session_running_s: float | None = 1.0  # None: derived, the call's own decode time
    # Beyond the paper (ours): r's decode term is stretched by the number of models it will
    # share i's rounds with (each takes a slot per round), so sessions consolidate by model
    # instead of adding a model to a busy instance's rotation; the stretch is paid again by
    # each call the session will still make there (costs.py placement_s). No constant.
    price_round_sharing: bool = True
    # Beyond the paper (ours), with price_round_sharing: when r brings a model NEW to i's
    # rotation (nothing of it runs, is queued, was routed there or lives there between calls),
    # every session of another model living on i waits through r's slot and one more switch
    # in each round, once per call r's session will make (costs.py, _join_externality). It
    # stops a session from turning a one-model instance into a rotating one when its model
    # already rotates elsewhere; no constant. Measured over 3 seeds: results/matrix_notes.md.
    price_rotation_join: bool = True
    retry_after_s: float = 1.0
    max_queued_per_instance: int = 64  # `queue` mode: route past admission up to this bound
    # replica opening, Eq. 2
    replica_penalty_s: float = 0.5  # nu_m default
    replica_penalty_by_model: dict[str, float] = field(default_factory=dict)
    hbm_price_s_per_gib: float = 0.05  # mu_j at full HBM pressure (ours)
    control_window_s: float = 10.0
    # cost-model fallbacks until profiles and telemetry exist (calibration.md anchors)
    default_prefill_s_per_tok: float = 4.3 / 25_000  # recompute 25K tokens: 4.3 s
    default_decode_s_per_tok: float = 0.03
    default_restore_s_per_tok: float = 4.3 / 25_000 / 10  # H2D restore ~10x recompute (ours)
    default_open_s: float = 2.011  # H2D fallback switch p50
    # Beyond the paper's recompute (issue 40): a return whose KV pages another instance holds
    # (its host registry or device) may pull them, priced bytes / link bandwidth + a fixed
    # setup, and is migrated only where that is cheaper than recompute. The rates are what the
    # destination's pulls measured (its snapshot); these fallbacks were measured on the dev box:
    # the page protocol's pull of a 64K-token session over loopback, 134 MB in 1.31 s
    # (results/migration.md, TTFT), and connect + first 64 KiB page over loopback, 0.6 ms.
    migrate: bool = True
    default_migrate_bytes_s: float = 0.1e9
    default_migrate_setup_s: float = 0.6e-3
    # beyond the paper: place new sessions next to KV that shares their prompt prefix
    prefix_placement: bool = True
    # baselines
    cache_threshold: float = 0.5  # prefix-aware (sgl-router defaults)
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    overlap_score_weight: float = 1.0  # kv-cost (Dynamo default)
    host_hit_weight: float = 0.5  # kv-cost: a host-tier block costs this much of a miss
    affinity_ttl_s: float = 30.0  # kv-cost: session affinity idle TTL
    # Deployment of a baseline where models outnumber instances: instances load models on
    # demand and the policy chooses among those that hold the call's model (serverless.py).
    serverless: bool = False

    def __post_init__(self) -> None:
        if self.overload not in OVERLOAD_MODES:
            raise ValueError(f"overload must be one of {OVERLOAD_MODES}, not {self.overload!r}")
        for name in ("lease_timeout_s", "stale_after_s", "control_window_s", "lease_charge_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if not 0.0 < self.gamma:
            raise ValueError(f"gamma must be > 0, not {self.gamma}")
        if not 0.0 < self.lease_quantile <= 1.0:
            raise ValueError(f"lease_quantile must be in (0, 1], not {self.lease_quantile}")
        if self.lease_min_s > self.lease_max_s:
            raise ValueError("lease_min_s must not exceed lease_max_s")

    def replica_penalty(self, model: str) -> float:
        return self.replica_penalty_by_model.get(model, self.replica_penalty_s)


class PlacementPolicy(ABC):
    """A routing policy. Subclasses set `name` and implement `decide`."""

    name: ClassVar[str]

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    @abstractmethod
    def decide(self, state: RouterState, call: CallSubmitted, now: float) -> RoutingDecision:
        """Choose an instance for `call` and say why (the audit record). Must not mutate
        `state`. Build the record with `route` / `reject`."""

    def react(self, state: RouterState, event: Event, now: float) -> list[Event]:
        """Events this policy emits in response to `event` (e.g. a lease on completion)."""
        return []

    def tick(self, state: RouterState, now: float) -> list[Event]:
        """Time-driven events (e.g. lease expiry)."""
        return []

    # ---- helpers shared by policies -------------------------------------------------

    def healthy(self, view: InstanceView, now: float) -> bool:
        """Fresh telemetry from an agent that says it is healthy (its watchdog sees no stuck
        engine step): the instance may take new non-reserved placements."""
        return view.snapshot.healthy and now - view.received_at <= self.config.stale_after_s

    def answers(self, view: InstanceView, now: float) -> bool:
        """Still answering: its live leases are honoured. We take "answers" to mean a healthy
        snapshot no older than twice the staleness bound (one missed heartbeat window)."""
        return view.snapshot.healthy and now - view.received_at <= 2.0 * self.config.stale_after_s

    def serving(self, state: RouterState, model: str, now: float) -> list[InstanceView]:
        """Healthy instances that can serve `model` at all: it is in their catalogue, and a
        hot-pool instance only ever serves its pinned model (it never switches). In a
        serverless deployment, only those that hold the model or will load it (serverless.py)."""
        views = [
            v
            for v in state.instances.values()
            if model in v.models and (v.pinned is None or v.pinned == model) and self.healthy(v, now)
        ]
        if self.config.serverless:
            return serverless.scope(state, views, model)
        return views

    def route(self, state: RouterState, call: CallSubmitted, now: float, instance_id: str,
              candidates=(), **fields) -> RoutingDecision:
        """The record of routing `call` to `instance_id`; `fields` are further record fields."""
        return self._record(state, call, now, "route", chosen=instance_id, candidates=list(candidates), **fields)

    def reject(self, state: RouterState, call: CallSubmitted, now: float, reason: str,
               candidates=(), status: int = 503) -> RoutingDecision:
        retry = self.config.retry_after_s if status == 503 else None
        return self._record(state, call, now, "reject", candidates=list(candidates),
                            retry_after_s=retry, reason=reason, status=status)

    def _record(self, state: RouterState, call: CallSubmitted, now: float, action: str,
                **fields) -> RoutingDecision:
        entry = state.sessions.get(call.session_id)
        return RoutingDecision(
            call_id=call.call_id,
            session_id=call.session_id,
            call_index=entry.calls if entry is not None else 0,  # calls routed before this one
            model=call.model,
            policy=self.name,
            action=action,  # type: ignore[arg-type]
            decided_at=now,  # decision_us is measured by the shell, not here
            **fields,
        )
