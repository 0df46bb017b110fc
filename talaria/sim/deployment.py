"""How each configuration's cluster is deployed in the simulator (issue 21, part 2).

A peer runs the way its users deploy it: where the models fit the instances, static
per-model pools split by offered demand (`pool_split`); where they do not, serverless, every
instance cold and loading models on demand (services/router/policy/serverless.py). Talaria
runs its own machinery in both regimes: hot pools resized online where the models fit,
cold-pool agents time-sharing models in rounds where they do not (`talaria_pools`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from talaria.services.configs import Configuration
from talaria.services.router.hot_pools import HotPools
from talaria.services.router.policy.base import PolicyConfig


def pool_split(demand: dict[str, float], instances: int) -> tuple[str, ...]:
    """The model each instance is pinned to: one per model, then each spare instance to the
    model furthest below its share of `demand` (non-negative weights). Needs len(demand) <= instances."""
    models = sorted(demand)
    if not models or len(models) > instances:
        raise ValueError(f"{len(models)} models do not fit {instances} per-model pools")
    total = sum(max(0.0, demand[m]) for m in models)
    share = {m: (max(0.0, demand[m]) / total if total > 0 else 1.0 / len(models)) for m in models}
    count = {m: 1 for m in models}
    for _ in range(instances - len(models)):  # each spare instance to the model furthest below its share
        m = max(models, key=lambda m: (share[m] * instances - count[m], -models.index(m)))
        count[m] += 1
    return tuple(m for m in models for _ in range(count[m]))


def deploy(policy_config: PolicyConfig, demand: dict[str, float], instances: int,
           catalogue: int) -> tuple[PolicyConfig, tuple[str, ...]]:
    """(policy config, pinned models per instance) for a peer: per-model pools where the
    models fit, else serverless with every instance cold."""
    if catalogue <= instances:
        return policy_config, pool_split(demand, instances)
    return replace(policy_config, serverless=True), ()


TALARIA_POOLS = ("online", "forecast")


def talaria_pools(demand: dict[str, float], instances: int, catalogue: int,
                  pools: str = "online") -> tuple[tuple[str, ...], bool]:
    """(pinned model per instance, resized online?) for talaria (module doc). Where the models
    fit: `online` starts every instance hot from an even split (no forecast) and its router
    resizes the pools from measured demand; `forecast` pins the peers' split of `demand` (what
    an operator who knows the traffic configures with `talaria up --hot`; the matrix's
    talaria-forecast-pools ablation). Where they do not: every instance cold (no pins)."""
    if pools not in TALARIA_POOLS:
        raise ValueError(f"pools must be one of {TALARIA_POOLS}, not {pools!r}")
    if catalogue > instances:
        return (), False
    if pools == "forecast":
        return pool_split(demand, instances), False
    return pool_split({m: 1.0 for m in demand}, instances), True


@dataclass(frozen=True)
class Placement:
    """How a run's instances start: the router's knobs (serverless or not), the model each
    instance is pinned to (empty: every instance cold), and whether the router resizes them."""

    policy_config: PolicyConfig
    pinned: tuple[str | None, ...] = ()
    online: bool = False


def place(cfg: Configuration, demand: Mapping[str, float], instances: int, catalogue: int,
          forecast: Mapping[str, float] | None = None) -> Placement:
    """Deploy configuration `cfg` (its `pools`, services/configs.py POOLS) on `instances`.
    `demand`: the run's offered demand per model (its keys are the models); `forecast`: what
    static splits are sized on (default `demand`; the matrix's `--peer-split history`).

    A peer router is run the way its users deploy it:

    - models <= instances: static per-model pools. Each model gets its own hot-pool instances
      (pinned, loaded at start, never switching) and the peer's rule routes within the model's
      pool (`PlacementPolicy.serving` only offers a call the instances pinned to its model).
      Instances are split by offered demand, as an operator sizes pools ahead: each model's
      server-seconds of work in the workload (matrix.session_work_s summed over its sessions,
      a forecast that is exact here, which favours the peers), one instance per model first,
      then each spare instance to the model furthest below its demand share.
    - models > instances: a serverless deployment (services/router/policy/serverless.py):
      every instance is a cold instance that loads models on demand; the peer's rule chooses
      among the instances holding the call's model, a model is loaded where it starts fastest
      (idle, weights staged, least recently used), and stays until another model needs it.

    Talaria runs its own machinery in both regimes. Where the models fit, its hot pools (paper
    §3.1: hot instances serve one model and never switch) start from an even split (no
    forecast) and its router resizes them online from the demand it measures
    (services/router/hot_pools.py; matrix.run_one, RunConfig.hot_pools); the matrix's
    `talaria-forecast-pools` ablation gives it the peers' forecast split instead. Where the
    models outnumber the instances, every instance is a cold-pool talaria agent that
    time-shares models in rounds (residency and placement from the router's costs). Measured
    alternative, not kept: hot pools only for the instances a model's demand fills completely
    (floor(share x instances)) plus a cold pool for the rest: SCT p95 geomean over the best peer
    per cell 1.05x vs 1.02x with the full split (talaria only, 38 cells).
    """
    pc, fc, fits = cfg.router, dict(forecast if forecast is not None else demand), catalogue <= instances
    if cfg.pools == "per-model":
        pc, pinned = deploy(pc, fc, instances, catalogue)
        return Placement(pc, pinned)
    if cfg.pools == "shared":
        return Placement(pc)
    if fits and cfg.pools == "split-start":
        return Placement(pc, pool_split(fc, instances), True)
    if fits and cfg.pools == "hot-cold":
        pools = HotPools.spare_cold([str(k) for k in range(instances)], sorted(demand))
        return Placement(pc, tuple(pools.pins.values()), True)
    if cfg.pools == "forecast":
        pinned, online = talaria_pools(fc, instances, catalogue, "forecast")
    else:  # online, and split-start / hot-cold where the models outnumber the instances
        pinned, online = talaria_pools(dict(demand), instances, catalogue, "online")
    return Placement(pc, pinned, online)
