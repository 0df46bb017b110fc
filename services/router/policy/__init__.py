"""Placement policies, chosen by name from `REGISTRY`. Importing the package imports every
policy module, each of which registers its class: a new policy adds its import here."""

from talaria.services.router.policy import (  # noqa: F401 - each registers its policy
    dynamo_kv,
    kv_cost,
    least_pressure,
    llm_d,
    prefix_aware,
    sglang_cache_aware,
    sticky,
    talaria,
    vllm_stack,
)
from talaria.services.router.policy.base import PlacementPolicy, PolicyConfig
from talaria.services.router.policy.registry import REGISTRY, create_policy, register

__all__ = ["PlacementPolicy", "PolicyConfig", "REGISTRY", "create_policy", "register"]
