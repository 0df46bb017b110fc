"""Placement policies, chosen by name from `REGISTRY`."""

from talaria.services.router.policy.base import PlacementPolicy, PolicyConfig
from talaria.services.router.policy.registry import REGISTRY, create_policy, register

__all__ = ["PlacementPolicy", "PolicyConfig", "REGISTRY", "create_policy", "register"]
