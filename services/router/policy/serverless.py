"""Serverless deployment of a peer router: instances load models on demand.

Where a cluster has more models than instances, the peers are deployed the way serverless
LLM platforms run them (ServerlessLLM, Knative/KServe scale-from-zero): each instance serves
one model at a time, a model is loaded where it starts fastest when no instance holds it,
and a loaded model stays until another model needs the instance (keep-alive until evicted,
least recently used first). The peer's own rule then picks among the instances in scope
(which instances those are: `scope`).

Pure: reads snapshots, the overlay and the session homes (homes.py: when each instance's
models were last used). Talaria does not use it (it places by its own costs).
"""

from __future__ import annotations

from talaria.services.router.instances import ON_DEVICE, InstanceView
from talaria.services.router.state import RouterState

START_ORDER = {"active": 0, "resident": 0, "staged": 1}  # else 2: a full load


def holds(view: InstanceView, model: str) -> bool:
    return (view.model_state(model) in ON_DEVICE or model in view.overlay_models
            or view.snapshot.queued.get(model, 0) > 0)


def saturated(view: InstanceView, model: str) -> bool:
    """The engine reports calls of the model waiting there (an autoscaler's queue metric)."""
    return view.snapshot.queued.get(model, 0) > 0


def last_used(state: RouterState, instance_id: str) -> float:
    models = state.homes.by_instance.get(instance_id, {})
    return max((h.latest for h in models.values()), default=float("-inf"))


def load_target(state: RouterState, views: list[InstanceView], model: str) -> InstanceView:
    idle = [v for v in views if v.queued_calls() == 0]
    if idle:
        return min(idle, key=lambda v: (START_ORDER.get(v.model_state(model), 2),
                                        last_used(state, v.instance_id), v.instance_id))
    return min(views, key=lambda v: (v.queued_calls(), v.instance_id))


def scope(state: RouterState, views: list[InstanceView], model: str) -> list[InstanceView]:
    """The instances a serverless deployment lets the peer's rule choose among.

        holders  = instances with the model on device, loading it, or with calls of it queued
        holders, none saturated         -> holders (the peer's rule among them)
        holders all have calls waiting  -> holders + one instance to load it on (scale out)
        no holder                       -> the instance to load it on
        load target: an idle instance (nothing running or waiting), fastest start first
                     (weights staged > absent), then least recently used; none idle: the
                     instance with the fewest calls (its scheduler runs the call after them)
    """
    if not views:
        return views
    holders = [v for v in views if holds(v, model)]
    if not holders:
        return [load_target(state, views, model)]
    if all(saturated(v, model) for v in holders):
        others = [v for v in views if not holds(v, model) and v.queued_calls() == 0]
        if others:
            return holders + [load_target(state, others, model)]
    return holders
