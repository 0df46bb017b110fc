"""Request, result and record types of the torch engine (the contract the service uses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from talaria.shared.messages import TokenLogprob  # noqa: F401 - re-exported
from talaria.shared.wire import KvSource, KvState, SwitchPath  # noqa: F401 - re-exported



@dataclass
class GenRequest:
    call_id: str
    session_id: str
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] = ()
    kv_scope: str = ""  # salts the KV block hashes: prefixes are shared only within one scope
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    logprobs: bool = False  # report each generated token's logprob ...
    top_logprobs: int = 0  # ... and this many most likely alternatives
    # Output tokens to reserve KV pages for: the router's estimate (CallRouted.kv_output_tokens,
    # <= max_tokens); 0 = max_tokens. A call that outgrows it grows into unreserved pages.
    kv_output_tokens: int = 0


@dataclass
class GenResult:
    call_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # stop | length
    prompt_tokens: int
    cached_tokens: int
    kv_source: KvSource
    prefill_s: float
    decode_s: float
    ttft_s: float  # from the engine's start of this call to its first token
    session_id: str = ""
    model: str = ""
    host_restored_tokens: int = 0
    stop_sequence: str | None = None  # the stop string that ended the call, if one did
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the request asked


@dataclass
class StepToken:
    call_id: str
    token_id: int
    text: str  # incremental text released by this token (stop-string hold-back applied)
    finished: bool
    finish_reason: str | None
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


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
