"""Scheduler settings: one frozen object, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from talaria.services.instance_agent.scheduler.types import ConfigError
from talaria.shared.ablations import ABLATIONS

@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of one instance's scheduler.

    Targets have no single number in the paper; the defaults are placeholders sized for
    agent traffic (TTFT p95 ≈ 14 s in calibration.md) and are meant to be overridden.
    """

    pool: Literal["cold", "hot"] = "cold"
    pinned_model: str | None = None  # hot pool: the one model it serves
    initial_model: str | None = None  # cold pool: model already on the device at start
    # Mechanisms (paper §5 ablations). Turning one off changes timing only, never output.
    sp: bool = True  # mid-slot session-prefill; off: returns wait for the next slot's P
    hkvr: bool = True  # host-restorable KV; off: host KV counts as missing (recompute)
    staging: bool = True  # D2D-staged switch; off: SwitchModel(staged=False), host-only cost
    # Resumable switches only: a switched-out model's running calls keep their KV on device
    # while HBM has room (memory/parked_kv.py); off: it is offloaded and restored on reopen.
    park_kv: bool = True
    # A finished call's KV stays for the session's next call (an engine's prefix cache, on by
    # default in vLLM V1 and SGLang); off: freed when the call ends (Aegaeon's per-request
    # KV, services/configs.py). The simulator frees it; live, the engine's cache decides.
    keep_kv: bool = True
    # A model's weights wait in host memory between uses (sleep mode, host-cached checkpoints,
    # talaria), so a load is the host-to-device copy; off: a full engine reload (the
    # simulator prices it at RELOAD_OVER_WAKE x the copy, talaria/sim/executor.py).
    weights_in_host: bool = True
    # A return routed away from its KV pulls the pages from the instance holding them when the
    # router priced that cheaper than recompute (issue 40); off: it recomputes, as before.
    migrate: bool = True
    # Switch away from a model only once its running calls have finished (Dfin drains them).
    # The torch engine refuses `switch_to` while calls run, so this is the default; False is
    # the paper's resumable mode (running calls decode on in the model's next slot), which
    # needs an engine that parks running calls' KV across a switch. The agent derives it
    # from the engine's capabilities (`for_engine`).
    drain_on_switch: bool = True
    # A contended slot decodes on past its protected decode until its share of the round
    # budget is spent (paper §3.4: "the slot closes when the round budget is exhausted");
    # False closes it as soon as protected decode (Eq. 4's minimum) is done.
    fill_slot: bool = True
    # Slot fill pays for switches: with this on, a slot fills past protected decode for at
    # most the switch time per slot it amortises (switch_s / models in the round), not for
    # its whole share of the round cap, so a waiting call of another model (a return, say)
    # waits about one switch's worth, not seconds, when switches are cheap.
    fill_by_switch: bool = False
    # A round over its cap (overload) decodes at least this many seconds per second of
    # switching (budget.py: Overload); 0 keeps the paper's least decode, d = 1 there.
    switch_amortisation: float = 1.0
    gamma: float = 0.9  # Eq. 5 margin: round <= gamma * ttft_target_s
    ttft_target_s: float = 10.0
    tpot_target_s: float = 0.2  # Eq. 4 average time per output token
    max_batch: int = 64  # running calls of one model
    sp_max_batch: int = 8  # calls admitted by one SP step
    kv_budget_bytes: int | None = None  # device KV for the active model's running calls
    min_slot_s: float = 0.0  # a slot with running work decodes at least this long
    max_slot_s: float | None = None  # cap on protected decode time per slot (None: round cap)
    max_decode_iters: int = 4096  # hard cap on protected decode iterations per slot
    ewma_alpha: float = 0.2  # weight of a new cost observation
    # Chunked prefill: a prompt is computed in chunks sized from the round budget (Eq. 4's
    # decode slack, see budget.chunk_s), so decodes and short calls interleave with a long
    # prefill instead of waiting for all of it. Off: one Prefill computes whole prompts.
    chunked_prefill: bool = False

    def __post_init__(self) -> None:
        if self.pool not in ("cold", "hot"):
            raise ConfigError("pool", f"{self.pool!r} is not 'cold' or 'hot'")
        if self.pool == "hot" and not self.pinned_model:
            raise ConfigError("pinned_model", "a hot-pool instance needs its pinned model")
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError("gamma", f"{self.gamma} not in (0, 1]")
        for name in ("ttft_target_s", "tpot_target_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")
        for name in ("max_batch", "sp_max_batch", "max_decode_iters"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise ConfigError("kv_budget_bytes", "must be > 0 or None")
        if self.max_slot_s is not None and self.max_slot_s < self.min_slot_s:
            raise ConfigError("max_slot_s", "must be >= min_slot_s")
        if self.switch_amortisation < 0:
            raise ConfigError("switch_amortisation", "must be >= 0")
        if not 0.0 < self.ewma_alpha <= 1.0:
            raise ConfigError("ewma_alpha", f"{self.ewma_alpha} not in (0, 1]")

    @property
    def round_cap_s(self) -> float:
        """Eq. 5: R_i <= gamma * T_TTFT."""
        return self.gamma * self.ttft_target_s

    @classmethod
    def for_engine(cls, capabilities, **knobs) -> SchedulerConfig:
        """A config whose mechanisms follow what the engine declares (engine/contract.py):
        it drains before a switch unless the engine can switch with calls running, and
        host KV / D2D staging are only used where the engine has them."""
        knobs["drain_on_switch"] = not capabilities.switch_with_calls_running
        knobs["hkvr"] = knobs.get("hkvr", True) and capabilities.host_kv
        knobs["staging"] = (knobs.get("staging", True) and capabilities.d2d_staging
                            and not getattr(capabilities, "resident_models", False))  # nothing to stage
        return cls(**knobs)

    def with_(self, **changes) -> SchedulerConfig:
        return replace(self, **changes)


class SharedConfig:
    """The scheduler's one config, read by it and its parts (work_costs, chunked_prefill, the
    pools) through `config`: a repin replaces `value` once and every part sees the new one."""

    __slots__ = ("value",)

    def __init__(self, value: SchedulerConfig) -> None:
        self.value = value


class ConfigReader:
    """A scheduler part: `config` is the scheduler's current one (SharedConfig)."""

    shared: SharedConfig

    @property
    def config(self) -> SchedulerConfig:
        return self.shared.value
