"""Policies by name. Registering an existing name, or asking for an unknown one, fails loudly.

Each policy module registers its class (`@register`); the package (policy/__init__.py) imports
every one of them, so importing this module (which imports the package first) fills the table."""

from __future__ import annotations

from talaria.services.router.policy.base import PlacementPolicy, PolicyConfig

REGISTRY: dict[str, type[PlacementPolicy]] = {}


class UnknownPolicyError(KeyError):
    """Asked for a policy name nobody registered; `str()` lists the known ones."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown routing policy {self.name!r}; known: {', '.join(sorted(REGISTRY))}"


def register(cls: type[PlacementPolicy]) -> type[PlacementPolicy]:
    name = getattr(cls, "name", None)
    if not name:
        raise ValueError(f"{cls.__name__} has no policy name")
    if name in REGISTRY:
        raise ValueError(f"routing policy {name!r} is already registered")
    REGISTRY[name] = cls
    return cls


def create_policy(name: str, config: PolicyConfig | None = None) -> PlacementPolicy:
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise UnknownPolicyError(name) from None
    return cls(config)


def policy_names() -> list[str]:
    return sorted(REGISTRY)

