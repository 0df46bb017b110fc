"""Named configurations: what runs, in one frozen value per name.

A `Configuration` holds the routing policy and all its knobs (`PolicyConfig`), the instance
scheduler with its mechanisms (`SchedulerConfig`) and how the instances are pooled. Live
(`talaria up --config NAME`, `TALARIA_CONFIG`) and the simulator (`talaria sim run --config
NAME`, the matrix) pick one the same way, `get(name, **overrides)`; any knob is overridden by
name and checked (`gamma` sets the router's and the scheduler's; `router.gamma` one). What the
simulator runs differently is declared once, in `SIM_DIFFERS`, each with its reason.

Each row also cites its `source`, says how its models come and go (`models`) and which
mechanisms it has on by default (`mechanisms()`, read from the knobs the simulator acts on).
A peer gets only what its system ships on by default; an opt-in equivalent is a labelled
variant (`+hicache`). `peer_deployments()` lists the peers `sim capacity` compares.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace

from talaria.services.instance_agent.scheduler.config import SchedulerConfig
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.policy.registry import REGISTRY, policy_names
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
# Real multi-model serverless systems (their rows below cite the figures they are priced by).
SERVERLESS = ("vllm-sleep", "serverlessllm", "aegaeon-like")
# How a row's weights come and go (`Configuration.weights`): the simulator prices a load as the
# profile's host-to-device copy (bytes / H2D + the engine's fixed phases, profiles.py), or, for
# `pinned` (SchedulerConfig.weights_in_host off), a full engine reload.
WEIGHTS = {
    "pinned": "loaded once per instance; where the models outnumber the instances, a full engine reload "
              "on demand (executor.RELOAD_OVER_WAKE x the H2D copy: a plain engine reloads in 30-100+ s, "
              "blog.vllm.ai/2025/10/26/sleep-mode.html), kept until another model needs the instance",
    "sleep": "sleep/wake: an idle model's weights sleep in host memory and wake by H2D (bytes / H2D "
             "bandwidth + fixed cost), its KV dropped",
    "tiered": "checkpoints in host DRAM / SSD tiers, loaded by a pipelined loader into the GPU",
    "switched": "time-shared: every model's weights in host memory, switched in per slot",
}
# The instance mechanisms a row may have (mechanisms()), in the words.
MECHANISMS = ("session-prefill", "host KV across switches", "staging", "KV kept after a call",
              "token-level time-sharing", "sleep/wake", "tiered checkpoint loading", "live migration")
# Labelled variants of a peer's router beyond its shipped defaults (not in the headline tables).
PEER_VARIANTS = ("llm-d-affinity",)


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
    # The engine switches models with calls running (they resume in the model's next slot):
    # token-level time-sharing. False: it drains first (vLLM sleeps only an idle engine).
    resumable: bool = True
    weights: str = "switched"  # a key of WEIGHTS
    source: str = "paper (/work/shared/paper); this repository"  # where the row's rule and figures come from
    models: str = ""  # how models come and go, in words ("" : from `pools` and `weights`)
    not_modelled: tuple[str, ...] = ()  # mechanisms the source ships that the simulator does not run

    def __post_init__(self) -> None:
        if self.pools not in POOLS:
            raise ConfigurationError(f"pools={self.pools!r}: expected one of {', '.join(POOLS)}")
        if self.weights not in WEIGHTS:
            raise ConfigurationError(f"weights={self.weights!r}: expected one of {', '.join(WEIGHTS)}")
        if (self.weights == "pinned") == self.scheduler.weights_in_host:
            raise ConfigurationError(f"weights={self.weights!r} needs weights_in_host="
                                     f"{self.weights != 'pinned'} (a pinned engine reloads, the others wake from host)")
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
        """The scheduler as the simulator runs it: this one with `SIM_DIFFERS` applied (the
        resumable switches only where its engine has them)."""
        return replace(self.scheduler, **{**{d.knob: d.sim for d in SIM_DIFFERS}, "drain_on_switch": not self.resumable})

    def mechanisms(self) -> dict[str, bool]:
        """Which of MECHANISMS this row runs, read off the knobs the simulator acts on."""
        sc = self.scheduler
        return dict(zip(MECHANISMS, (sc.sp, sc.hkvr, sc.staging, sc.keep_kv, self.resumable,
                                     self.weights == "sleep", self.weights == "tiered", False)))

    def describe_models(self) -> str:
        return self.models or f"{POOLS[self.pools]}; {WEIGHTS[self.weights]}"


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
               "slot; the torch engine refuses a switch while calls run, so live drains first "
               "(a row that is not `resumable`, a peer's engine, drains in the simulator too)"),
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
              "wash against all-cold agents in the simulator (results/hot_cold_sim.md); the simulator's "
              "`online` (every instance hot from an even split) beats operator-pinned pools sized on "
              "another draw over 3 held-out seeds (SCT p95 geomean 0.986x, mix=shift 0.94x: "
              "results/matrix_notes.md, issue 35), but live has no even hot start yet")


def _scheduler(ablation: str = "talaria", **knobs) -> SchedulerConfig:
    """The live agent's scheduler: the ablation's mechanisms, chunked prefill, switch-bounded fill."""
    return SchedulerConfig(**{**ABLATIONS[ablation], "chunked_prefill": True, "fill_by_switch": True, **knobs})


# The paper's router rules only: Eq. 1 ranking, its admission, fixed tau, reject on overload.
_PAPER_ROUTER = PolicyConfig(overload="reject", kv_home_admits=False, new_session_running_s=0.0,
                             prefix_placement=False, price_round_sharing=False)


# A peer's instance (faithful to its engine's defaults): continuous batching admits a request at
# any decode step (session-prefill's effect, the engine's own), its prefix cache keeps a
# finished call's KV (vLLM V1: automatic prefix caching on by default, docs.vllm.ai/en/latest/
# features/automatic_prefix_caching; SGLang: RadixAttention on unless --disable-radix-cache),
# no host KV tier (HiCache, LMCache, KVBM are opt-in), no D2D staging, no parked KV.
_PEER_MECHANISMS = {"sp": True, "hkvr": False, "staging": False, "park_kv": False, "keep_kv": True,
                    "weights_in_host": False}


def _peer(name: str, summary: str, policy: str, source: str, **kw) -> Configuration:
    """A peer row: its router `policy`, its engine's default mechanisms (overridden by `kw`'s
    `mechanisms`), drained switches unless `resumable`."""
    mech = {**_PEER_MECHANISMS, **kw.pop("mechanisms", {})}
    return Configuration(name, summary, policy=policy, scheduler=_scheduler("round-only", **mech),
                         **{"pools": "per-model", "resumable": False, "weights": "pinned", "source": source, **kw})


def _peers() -> list[Configuration]:
    rows = [_peer(p, f"{p} as it is deployed (router/policy/, deployment.py)", p,
                  f"router rule: {REGISTRY[p].__module__} (its source and version cited there)") for p in PEERS]
    rows += [
        _peer("vllm-sleep", "vLLM sleep mode (level 1) behind the production-stack session router, keep-alive LRU",
              "vllm-stack-session", weights="sleep", mechanisms={"weights_in_host": True},
              source="docs.vllm.ai/en/latest/features/sleep_mode (level 1: weights offloaded to CPU memory, KV "
                     "discarded; wake reloads them); blog.vllm.ai/2025/10/26/sleep-mode.html (wake 18-200x faster "
                     "than a full reload of 30-100+ s; level-1 wake 0.1-6 s): priced as bytes / H2D + the profile's "
                     "fixed phases; router: services/router/policy/vllm_stack.py",
              models="serverless (router/policy/serverless.py): a model wakes where it starts fastest (idle, least "
                     "recently used) and sleeps when another model needs the instance (keep-alive LRU); it sleeps "
                     "only once its calls have finished (drained); per-model pools where the models fit"),
        _peer("serverlessllm", "ServerlessLLM (OSDI'24): startup-time-optimised placement, multi-tier checkpoint "
              "loading, keep-alive", "round-robin", weights="tiered", mechanisms={"weights_in_host": True},
              source="Fu et al., ServerlessLLM, OSDI'24 (arXiv 2401.14351): loader 3.6-8.2x faster than "
                     "PyTorch/Safetensors, saturating the DRAM/SSD-to-GPU bandwidth (priced here as the profile's H2D "
                     "copy: the DRAM tier); ServerlessLLM/ServerlessLLM sllm/serve/routers/roundrobin_router.py "
                     "(requests round-robin over a model's instances), schedulers/storage_aware_scheduler.py "
                     "(load where startup is fastest)",
              models="serverless (router/policy/serverless.py): loaded where the estimated startup is least (idle, "
                     "checkpoint staged > in host memory, least recently used), kept alive until another model "
                     "needs the instance",
              not_modelled=("live migration (sllm/serve/routers/migration_router.py: token-only migration of a "
                            "running call to free an instance for a locality-better load; here that call finishes "
                            "where it runs)", "the SSD tier (every checkpoint loads at the DRAM tier's rate: "
                            "favours the peer)")),
        Configuration("aegaeon-like", "an Aegaeon-like token-level multi-model scheduler (SOSP'25): rounds over every "
                      "model, KV freed when a call ends, no session state", policy="least-pressure",
                      scheduler=_scheduler("round-only", keep_kv=False), pools="shared", weights="switched",
                      source="Xiang et al., Aegaeon: Effective GPU Pooling for Concurrent LLM Serving on the Market, "
                             "SOSP'25 (doi 10.1145/3731569.3764815): token-level preemptive switching, decode "
                             "weighted round-robin, per-request KV, auto-scaling overhead cut 97% (component reuse, "
                             "explicit memory management, fine-grained KV sync); modelled by the paper's Round-only "
                             "scheduler (shared/ablations.py) with its resumable switches at the profile's H2D cost "
                             "and no KV kept after a call, under the least-pressure router; [asm] the round scheduler's "
                             "overload rule (budget.py) stands in for its decode quotas sized against switch overhead",
                      models="every instance serves every model, switching per slot with calls running",
                      not_modelled=("prefill/decode disaggregation", "grouped-FCFS prefill")),
    ]
    # opt-in host KV tiers, run as labelled variants (never the peer's default)
    rows += [replace(base, name=f"{base.name}+{tier}", summary=f"{base.summary}, with opt-in {tier} host KV",
                     scheduler=replace(base.scheduler, hkvr=True), source=f"{base.source}; {cite}")
             for base, tier, cite in (
                 (rows[PEERS.index("sglang-cache-aware")], "hicache",
                  "SGLang HiCache (--enable-hierarchical-cache, off by default)"),
                 (rows[len(PEERS)], "lmcache", "LMCache connector for vLLM (--kv-transfer-config, off by default)"))]
    rows += [_peer(p, f"{p}: a labelled variant of a peer's router (router/policy/), not its shipped default", p,
                   f"router rule: {REGISTRY[p].__module__} (its source and version cited there)") for p in PEER_VARIANTS]
    return rows


def peer_deployments() -> tuple[str, ...]:
    """The peer deployments a capacity search compares with talaria: dedicated pools and the
    serverless systems, not talaria's ablations nor the opt-in variants."""
    return (*PEERS, *SERVERLESS)


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
    table += _peers()
    named = {c.name for c in table}  # a policy with no row of its own name gets a shared one
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

_OWN = ("policy", "pools", "hot_pools_z", "resumable", "weights")
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
                                     "knobs are PolicyConfig's, SchedulerConfig's, policy, pools, hot_pools_z, "
                                     "resumable and weights"))
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
