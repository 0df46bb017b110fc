"""What an engine is: the calls the instance agent's runner makes, and what it declares it can do.

The runner drives an engine one step at a time (switch, prefill, decode, finish) from one
worker thread; the scheduler never touches it, but its mechanisms follow the engine's
`Capabilities` (`SchedulerConfig.for_engine`): an engine that cannot switch with calls running
makes the scheduler drain a model's calls before a switch, one without host KV or D2D staging
gets those mechanisms turned off rather than promised. The torch engine is the reference; a
vLLM backend (vllm_engine.py) implements the same Protocol and passes the same contract tests
(tests/unit/engine/test_engine_contract.py; tests/vllm/ runs them on vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from talaria.services.instance_agent.engine.api import EngineStats, GenRequest, GenResult, StepToken, SwitchRecord


@dataclass(frozen=True)
class Capabilities:
    switch_with_calls_running: bool  # switch_to() while calls run parks their KV (else EngineBusy)
    host_kv: bool  # sessions' KV is checkpointed to host memory and restored (kv_state "host")
    d2d_staging: bool  # the next model's weights can be pre-staged on the device (stage())
    chunked_prefill: bool  # a long prompt's prefill may be split across steps
    # Every served model stays loaded with its KV (vLLM on CPU: one engine per model, the idle
    # ones paused): a switch moves no weights and loses no session's device KV, so a session
    # of a non-active model stays kv_state "device" and there is nothing to stage.
    resident_models: bool = False
    # Reused KV comes in whole blocks of this many tokens (vLLM's prefix cache); 1: any
    # prefix (the torch engine copies a partial page).
    kv_block_tokens: int = 1


@runtime_checkable
class Engine(Protocol):
    """Every method may raise an `EngineError` subclass (errors.py) naming what is wrong;
    none of them may leave the engine unusable for other calls."""

    capabilities: Capabilities

    @property
    def active_model(self) -> str | None: ...

    def ensure_weights(self) -> None:
        """Make every served model's weights loadable (build, check or locate them)."""

    def switch_to(self, model: str) -> SwitchRecord:
        """Make `model` active; with calls running, only if `switch_with_calls_running`."""

    def stage(self, model: str, *, wait: bool = False) -> int:
        """Pre-stage `model` for the next switch; returns staged bytes (0 without d2d_staging)."""

    def prefill(self, reqs: list[GenRequest]) -> list[StepToken]:
        """Admit calls for the active model (or switch to theirs when none run) and return
        each one's first token; a session's reusable KV (device or host) is used."""

    def decode(self, call_ids: list[str]) -> list[StepToken]:
        """One decode step for each listed running call."""

    def finish(self, call_id: str) -> GenResult:
        """Release a call; an unfinished one is aborted (finish_reason 'abort'). Its KV stays
        reusable by its session's next call."""

    def kv_state(self, session_id: str, model: str) -> str:
        """Where the session's KV for `model` is: 'device', 'host' or 'none'."""

    def session_states(self) -> list[tuple[str, str, str, int]]:
        """(session_id, model, 'device' | 'host', tokens) for every session KV held."""

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...
