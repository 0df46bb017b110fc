"""What an engine is: the calls the instance agent's runner makes, the records they take and
give back (the call's `Sequence` and the `StepToken`s it yields, sequence.py; SwitchRecord,
EngineStats), and what it declares it can do.

The runner builds each call's `Sequence` (the request: ids, prompt, cap, `SamplingParams`)
and hands that same object to `prefill`, `decode` and `finish`: the engine fills in its own
parts and gives it back finished. No engine method takes a call id.

The runner drives an engine one step at a time (switch, prefill, decode, finish) from one
worker thread; the scheduler never touches it, but its mechanisms follow the engine's
`Capabilities` (`SchedulerConfig.for_engine`): an engine that cannot switch with calls running
makes the scheduler drain a model's calls before a switch, one without host KV or D2D staging
gets those mechanisms turned off rather than promised. The torch engine is the reference; a
vLLM backend (vllm_engine.py) implements the same Protocol and passes the same contract tests
(tests/unit/engine/test_engine_contract.py; tests/vllm/ runs them on vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from talaria.services.instance_agent.engine.sequence import Sequence, StepToken
from talaria.shared.catalog import ModelSpec
from talaria.shared.wire import SwitchPath

__all__ = ["Capabilities", "Engine", "EngineStats", "Sequence", "StepToken", "SwitchRecord"]


# Switch records an engine keeps (its report reads the last one): a list grew by one per
# switch for the life of the process.
SWITCHES_KEPT = 64


@dataclass
class SwitchRecord:
    """One model switch, phase by phase (paper App. D). Times in seconds."""

    from_model: str | None
    to_model: str
    path: SwitchPath
    save_teardown_s: float = 0.0  # P1: drain outgoing D2H, release KV region
    open_weights_s: float = 0.0  # P2: D2D gather of staged chunks + H2D of the rest
    kv_shell_s: float = 0.0  # P3: rebind (or rebuild) the KV-pool view
    runtime_s: float = 0.0  # P4: runtime tables (RoPE) in the runtime region
    publish_s: float = 0.0  # P5: swap references
    total_s: float = 0.0
    bytes_d2d: int = 0
    bytes_h2d: int = 0
    bytes_from_file: int = 0
    bytes_staged: int = 0  # staged bytes that were usable (clean) at switch time
    bytes_uncovered: int = 0  # weight bytes that had to come from host
    dirty_chunks: int = 0
    drained_d2h_jobs: int = 0
    kv_shell_reused: bool = False
    pointer_check_ok: bool = True

    @property
    def bytes_moved(self) -> int:
        return self.bytes_d2d + self.bytes_h2d

    def phases(self) -> dict[str, float]:
        return {
            "save_teardown": self.save_teardown_s,
            "open_weights": self.open_weights_s,
            "kv_shell": self.kv_shell_s,
            "runtime": self.runtime_s,
            "publish": self.publish_s,
        }


@dataclass
class EngineStats:
    active_model: str | None
    kv_capacity_tokens: int
    kv_used_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    restore_tok_s: float
    last_switch_s: float
    hbm_bytes: int
    hbm_used_bytes: int
    staging_free_bytes: int
    staged_bytes: int = 0
    running_calls: int = 0
    host_kv_capacity_pages: int = 0
    host_kv_used_pages: int = 0
    host_hits: int = 0
    host_misses: int = 0
    host_evictions: int = 0
    weight_bytes: dict[str, int] = field(default_factory=dict)
    # KV that running calls hold or have reserved (plus copies in flight): the part of
    # kv_used_tokens that cannot be evicted. The rest is idle sessions' cache.
    kv_pinned_tokens: int = 0
    staged_model: str | None = None  # the model whose weights are being staged for the next switch


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
    # The engine is also a `PageStore`: a session's host KV pages can be sent to and taken
    # from another instance (KV migration, docs/migration.md): the torch engine with its host
    # registry, the vllm engine with its host KV connector.
    kv_migration: bool = False


@runtime_checkable
class PageStore(Protocol):
    """An engine's host KV pages as peers pull them (issue 40); engine-thread methods."""

    page_size: int  # tokens per page (the block hashes' block)

    def kv_bytes_per_token(self, model: str) -> int:
        """KV bytes one token of `model` holds (every layer and rank)."""

    def page_hashes(self, model: str, ids: list[int], scope: str) -> list[int]:
        """The keys of `ids`' full pages under the tenant's `scope`, as this engine keys its host
        pages (what a pull asks the holder for). Pure: read from any thread."""

    def export_pages(self, model: str, session_id: str, hashes: list[int], limit: int) -> list:
        """(hash, layout, rank slabs) of the leading `hashes` the session's own host prefix holds."""

    def session_hashes(self, model: str, session_id: str) -> list[int]:
        """The hashes of the session's own host prefix, in order (a drain's push lists them)."""

    def import_pages(self, model: str, session_id: str, hashes: list[int], slabs: list[list[bytes]],
                     dtype: str, shape: tuple[int, ...], ranks: int) -> int:
        """Store pulled pages as the session's host prefix; the tokens now restorable."""


@runtime_checkable
class Engine(Protocol):
    """Every method may raise an `EngineError` subclass (engine_errors.py) naming what is wrong;
    none of them may leave the engine unusable for other calls."""

    capabilities: Capabilities
    specs: Mapping[str, ModelSpec]  # the served models (context length, shapes), by name
    # Asked between forward passes of a chunked prefill: True ends the chunk early (the runner
    # sets it when a call arrives); the calls not done continue in a later chunk. None: never.
    should_yield: Callable[[], bool] | None

    @property
    def active_model(self) -> str | None: ...

    def ensure_weights(self) -> None:
        """Make every served model's weights loadable (build, check or locate them)."""

    def switch_to(self, model: str) -> SwitchRecord:
        """Make `model` active; with calls running, only if `switch_with_calls_running`."""

    def stage(self, model: str, *, wait: bool = False) -> int:
        """Pre-stage `model` for the next switch; returns staged bytes (0 without d2d_staging)."""

    def probe_prefill(self) -> tuple[str, list[tuple[int, int, float]]] | None:
        """The active model's prefill timed at no context and deep in it, the first time it is
        active: (model, [(tokens, context, seconds)]); None when there is nothing to probe or
        the engine cannot (the torch engine can: prefill_probe.py; without it an agent's
        slope starts from the architecture's prior on the engine's own rate)."""

    def prefill(self, seqs: list[Sequence], chunk_tokens: int = 0, more: Iterable[Sequence] = (),
                pass_tokens: int = 0) -> list[StepToken]:
        """Admit calls for the active model (or switch to theirs when none run) and return
        each one's first token; a session's reusable KV (device or host) is used. With
        `chunk_tokens` > 0 (only where `chunked_prefill`): at most that many prompt tokens per
        call, continuing the calls `more` admitted by an earlier chunk; only calls whose
        prompt is then complete return a token (the others' `Sequence.prompt_left` says what
        is left). `pass_tokens` > 0 caps one forward pass."""

    def decode(self, seqs: list[Sequence]) -> list[StepToken]:
        """One decode step for each listed running call."""

    def finish(self, seq: Sequence) -> Sequence:
        """Release a call and give it back; an unfinished one is aborted (finish_reason
        'abort'). Its KV stays reusable by its session's next call."""

    def kv_state(self, session_id: str, model: str) -> str:
        """Where the session's KV for `model` is: 'device', 'host' or 'none'."""

    def device_prefix(self, session_id: str, model: str, prompt_ids: list[int]) -> int:
        """Leading tokens of `prompt_ids` the session's device KV for `model` holds (0: none)."""

    def session_states(self) -> list[tuple[str, str, str, int]]:
        """(session_id, model, 'device' | 'host', tokens) for every session KV held."""

    def device_tokens(self) -> Mapping[tuple[str, str], list[int]]:
        """(session_id, model) -> the token ids each session's device KV holds (what
        `device_prefix` matches a prompt against); a held list is replaced, never changed."""

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...
