"""Named configurations: what runs, in one frozen value per name.

A `Configuration` holds the routing policy and every one of its knobs (`PolicyConfig`), the
instance scheduler with its mechanisms (`SchedulerConfig`: SP, HKVR, staging, parked KV and
every other knob) and how the instances are pooled. Live (`talaria up --config NAME`,
`TALARIA_CONFIG`) and the simulator (`talaria sim run --config NAME`, the matrix) pick one the
same way, `get(name, **overrides)`; any knob is overridden by name and checked. A knob both the
router and the scheduler have (`gamma`, `ttft_target_s`) sets both; `router.gamma` sets one.

What the simulator runs differently from a live agent is declared once, in `SIM_DIFFERS`,
each with its reason; tests/unit/contract/test_configs.py fails on any other difference.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace

from talaria.services.instance_agent.scheduler.config import SchedulerConfig
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.policy.registry import policy_names
from talaria.shared.ablations import ABLATIONS, mechanisms
from talaria.shared.settings import CommonSettings, SettingsError

# How a configuration's instances are pooled (the simulator deploys it so, talaria/sim/deployment.py).
POOLS = {
    "shared": "every instance cold, serving every model (time-shared in rounds)",
    "online": "hot pools from an even split, resized online by the router (router/hot_pools.py); "
              "every instance cold where the models outnumber the instances",
    "forecast": "hot pools pinned to the peers' split of the offered demand; cold where models outnumber instances",
    "split-start": "online hot pools started from the peers' split instead of an even one",
    "hot-cold": "one hot instance per model and a cold pool, turned hot and cold online",
    "per-model": "a peer as it is deployed: per-model hot pools split by demand where the models fit, "
                 "else serverless on-demand loading",
}
# The faithful peers (router/policy/, each citing its source), deployed as their users deploy them.
PEERS = ("round-robin", "sglang-cache-aware", "dynamo-kv", "llm-d", "vllm-stack-session")


class ConfigurationError(ValueError):
    """An unknown configuration or knob, or a bad value; the message says which and why."""


@dataclass(frozen=True)
class Configuration:
    """One named deployment: router policy and knobs, scheduler and mechanisms, pools."""

    name: str
    summary: str
    policy: str = "talaria"  # the router's policy registry name
    router: PolicyConfig = field(default_factory=PolicyConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pools: str = "online"  # a key of POOLS
    hot_pools_z: float = 1.0  # the online pools' noise margin in standard errors (hot_pools.py)

    def __post_init__(self) -> None:
        if self.pools not in POOLS:
            raise ConfigurationError(f"pools={self.pools!r}: expected one of {', '.join(POOLS)}")
        if self.policy not in policy_names():
            raise ConfigurationError(f"policy={self.policy!r}: expected one of {', '.join(policy_names())}")

    def with_(self, **overrides) -> Configuration:
        """A copy with knobs changed by name (`knob`, or `router.knob` / `scheduler.knob`)."""
        return _override(self, overrides)

    def live_scheduler(self, capabilities, pool: str = "cold", pinned_model: str | None = None) -> SchedulerConfig:
        """The scheduler as a live agent runs it on an engine with `capabilities`
        (SchedulerConfig.for_engine: it drains before a switch unless the engine can park)."""
        knobs = {f.name: getattr(self.scheduler, f.name) for f in fields(SchedulerConfig)
                 if f.name not in ("pool", "pinned_model", "drain_on_switch")}
        return SchedulerConfig.for_engine(capabilities, pool=pool, pinned_model=pinned_model, **knobs)

    def sim_scheduler(self) -> SchedulerConfig:
        """The scheduler as the simulator runs it: this one with `SIM_DIFFERS` applied."""
        return replace(self.scheduler, **{d.knob: d.sim for d in SIM_DIFFERS})


@dataclass(frozen=True)
class Difference:
    """A scheduler knob the simulator sets apart from the live agent, and why."""

    knob: str
    sim: object
    live: str  # what the live agent does instead
    reason: str


SIM_DIFFERS = (
    Difference("drain_on_switch", False, "derived from the engine (SchedulerConfig.for_engine)",
               "the paper's resumable switches (§3.4): running calls decode on in their model's next "
               "slot; the torch engine refuses a switch while calls run, so live drains first"),
    Difference("chunked_prefill", False, "on",
               "the published simulator tables price whole-prompt prefills; chunked prefill in the "
               "simulator is not measured yet"),
    Difference("fill_by_switch", False, "on",
               "the published simulator tables fill a slot to its share of the round cap; the live "
               "agent bounds the fill by the switch it amortises (results/live_path.md), not measured in the simulator"),
)
# Live, the router resizes hot pools only with TALARIA_HOT_POOLS=true (else the operator's
# `--hot` pins); the simulator deploys a configuration's `pools`. Declared here, with its reason.
LIVE_POOLS = ("operator-pinned unless TALARIA_HOT_POOLS=true",
              "off until measured live: live agents register cold, and the controller started cold is a "
              "wash against all-cold agents in the simulator (results/hot_cold_sim.md)")


def _scheduler(ablation: str = "talaria", **knobs) -> SchedulerConfig:
    """The live agent's scheduler: the ablation's mechanisms, chunked prefill, switch-bounded fill."""
    return SchedulerConfig(**{**ABLATIONS[ablation], "chunked_prefill": True, "fill_by_switch": True, **knobs})


# The paper's router rules only: Eq. 1 ranking, its admission, fixed tau, reject on overload.
_PAPER_ROUTER = PolicyConfig(overload="reject", kv_home_admits=False, new_session_running_s=0.0,
                             prefix_placement=False, price_round_sharing=False)


def _build() -> dict[str, Configuration]:
    ours = PolicyConfig(overload="queue")
    table = [
        Configuration("talaria", "our configuration: every rule and mechanism, online hot pools", router=ours,
                      scheduler=_scheduler()),
        Configuration("talaria-paper", "the same policy under the paper's rules (Eq. 1 only, its admission, "
                      "fixed tau, reject on overload)", router=_PAPER_ROUTER, scheduler=_scheduler()),
        Configuration("talaria-no-lease", "talaria without soft leases (tau = 0)",
                      router=replace(ours, lease_timeout_s=0.0), scheduler=_scheduler()),
        Configuration("talaria-forecast-pools", "talaria with the peers' forecast pools instead of online ones",
                      router=ours, scheduler=_scheduler(), pools="forecast"),
        Configuration("talaria-split-start", "talaria's online pools started from the peers' split",
                      router=ours, scheduler=_scheduler(), pools="split-start"),
        Configuration("talaria-hot-cold", "talaria with a cold pool beside one hot instance per model",
                      router=ours, scheduler=_scheduler(), pools="hot-cold"),
    ]
    # each paper ablation (shared/ablations.py): talaria with some instance mechanisms off
    table += [Configuration(f"talaria-{a}", f"talaria with the {a} mechanisms (shared/ablations.py)",
                            router=replace(ours, migrate=ABLATIONS[a]["migrate"]),  # the router prices it
                            scheduler=_scheduler(a)) for a in ABLATIONS if a != "talaria"]
    table += [Configuration(p, f"{p} as it is deployed (router/policy/, deployment.py)", policy=p,
                            scheduler=_scheduler(), pools="per-model") for p in PEERS]
    named = {c.policy for c in table}
    table += [Configuration(p, f"the {p} router over cold instances", policy=p, scheduler=_scheduler(), pools="shared")
              for p in policy_names() if p not in named]
    out: dict[str, Configuration] = {}
    for c in table:
        if c.name in out:
            raise ValueError(f"configuration {c.name!r} is named twice")
        out[c.name] = c
    return out


CONFIGS = _build()


def names() -> list[str]:
    return list(CONFIGS)


def get(name: str, **overrides) -> Configuration:
    """Configuration `name` with `overrides` (knob -> value) applied; ConfigurationError otherwise."""
    try:
        base = CONFIGS[name]
    except KeyError:
        raise ConfigurationError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}") from None
    return base.with_(**overrides) if overrides else base


def ablation_name(ablation: str) -> str:
    """The configuration of paper ablation `ablation` (`--ablation`, TALARIA_ABLATION)."""
    if ablation not in ABLATIONS:
        raise ConfigurationError(f"unknown ablation {ablation!r}; known: {', '.join(ABLATIONS)}")
    return "talaria" if ablation == "talaria" else f"talaria-{ablation}"


def selected(common: CommonSettings, policy: str = "", ablation: str = "", **knobs) -> Configuration:
    """The configuration a live service runs: TALARIA_CONFIG (or its alias TALARIA_POLICY, a
    router's `policy`), with TALARIA_ABLATION's mechanisms, the service's own set knobs (None:
    unset) and TALARIA_CONFIG_SET applied. A SettingsError names the variable that is wrong."""
    if common.config and policy and policy != common.config:
        raise SettingsError("TALARIA_POLICY", policy, f"unset or {common.config!r}: it is TALARIA_CONFIG's alias")
    name = common.config or policy or "talaria"
    if name not in CONFIGS:
        raise SettingsError("TALARIA_CONFIG" if common.config else "TALARIA_POLICY", name,
                            f"a configuration: {', '.join(CONFIGS)}")
    overrides = {k: v for k, v in knobs.items() if v is not None}
    if ablation:
        overrides.update(mechanisms(ablation))
    try:
        overrides.update(parse_set(common.config_set))
        return get(name, **overrides)
    except ConfigurationError as exc:
        raise SettingsError("TALARIA_CONFIG_SET", ",".join(common.config_set), f"knobs of {name} ({exc})") from None


# ---- overrides by name ------------------------------------------------------------------

_OWN = ("policy", "pools", "hot_pools_z")
_PARTS = {"router": PolicyConfig, "scheduler": SchedulerConfig}


def knobs() -> dict[str, tuple[str, ...]]:
    """Every knob a name may override, with the parts it sets (a name in both sets both)."""
    out: dict[str, tuple[str, ...]] = {k: ("",) for k in _OWN}
    for part, cls in _PARTS.items():
        for f in fields(cls):
            out[f.name] = (*out.get(f.name, ()), part)
    return out


def _override(cfg: Configuration, overrides: dict[str, object]) -> Configuration:
    known = knobs()
    own: dict[str, object] = {}
    parts: dict[str, dict[str, object]] = {p: {} for p in _PARTS}
    for key, value in overrides.items():
        part, _, knob = key.rpartition(".")
        if knob not in known or (part and part not in known[knob]):
            close = difflib.get_close_matches(knob, known, n=3)
            raise ConfigurationError(f"unknown knob {key!r}; " + (f"did you mean {', '.join(close)}?" if close else
                                     "knobs are PolicyConfig's, SchedulerConfig's, policy, pools and hot_pools_z"))
        for p in ((part,) if part else known[knob]):
            current = getattr(cfg, knob) if p == "" else getattr(getattr(cfg, p), knob)
            typed = coerce(key, value, current)
            (own if p == "" else parts[p])[knob] = typed
    try:
        return replace(cfg, **own, **{p: replace(getattr(cfg, p), **v) for p, v in parts.items() if v})
    except (ValueError, TypeError) as exc:  # a part's own validation (PolicyConfig, SchedulerConfig)
        raise ConfigurationError(f"{cfg.name}: {exc}") from None


def coerce(key: str, value: object, current: object) -> object:
    """`value` as the type of the knob's `current` value; a string is parsed (`--set k=v`)."""
    if not isinstance(value, str) or isinstance(current, str):
        ok = (value is None or isinstance(current, (type(None), str)) or isinstance(value, type(current))
              or (isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool)))
        if not ok:
            raise ConfigurationError(f"{key}={value!r}: expected a {type(current).__name__}")
        return float(value) if isinstance(current, float) and value is not None else value
    text = value.strip().lower()
    if text == "none":
        return None
    try:
        if isinstance(current, bool):
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(current, int):
            return int(value)
        return float(value)  # float knobs, and optional ones (None default) that take seconds
    except ValueError:
        raise ConfigurationError(f"{key}={value!r}: expected a {type(current).__name__}") from None


def parse_set(assignments) -> dict[str, str]:
    """`knob=value` strings (`--set`, TALARIA_CONFIG_SET) as overrides; ConfigurationError on a bad one."""
    out = {}
    for a in assignments:
        knob, sep, value = a.partition("=")
        if not sep or not knob.strip():
            raise ConfigurationError(f"{a!r}: expected knob=value")
        out[knob.strip()] = value.strip()
    return out


def label(name: str, overrides: dict[str, object]) -> str:
    """The results' label of a configuration with overrides: `name[knob=value,...]`."""
    if not overrides:
        return name
    return f"{name}[{','.join(f'{k}={v:g}' if isinstance(v, float) else f'{k}={v}' for k, v in overrides.items())}]"


def from_label(text: str) -> Configuration:
    """The one reader of the results' spelling `name[knob=value,...]` (label's inverse; the
    matrix's sensitivity rows and bench/matrix_seeds.py `--ours` use it)."""
    name, bracket, rest = text.partition("[")
    if not bracket:
        return get(text)
    if not rest.endswith("]"):
        raise ConfigurationError(f"{text!r}: expected name[knob=value,...]")
    return get(name, **parse_set(rest[:-1].split(",")))
