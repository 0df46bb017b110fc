"""Policies by name. Registering an existing name, or asking for an unknown one, fails loudly."""

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
    _load_builtin()
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise UnknownPolicyError(name) from None
    return cls(config)


def policy_names() -> list[str]:
    _load_builtin()
    return sorted(REGISTRY)


def _load_builtin() -> None:
    # Importing the modules registers them; done lazily to avoid import cycles.
    import talaria.services.router.policy.dynamo_kv  # noqa: F401
    import talaria.services.router.policy.kv_cost  # noqa: F401
    import talaria.services.router.policy.llm_d  # noqa: F401
    import talaria.services.router.policy.sglang_cache_aware  # noqa: F401
    import talaria.services.router.policy.vllm_stack  # noqa: F401
    import talaria.services.router.policy.least_pressure  # noqa: F401
    import talaria.services.router.policy.prefix_aware  # noqa: F401
    import talaria.services.router.policy.sticky  # noqa: F401
    import talaria.services.router.policy.talaria  # noqa: F401
