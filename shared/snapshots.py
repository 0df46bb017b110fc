"""Instance telemetry snapshots on talaria.telemetry.<instance_id> (last-value, not events)
and the service heartbeats on talaria.health.<service>.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from talaria.shared.wire import KvState, ModelState, Name, Pool, Token


class ModelResidency(Struct, frozen=True):
    model: Name
    state: ModelState
    switch_cost_s: float = 0.0
    open_cost_s: float = 0.0
    weight_bytes: int = 0
    context_length: int = 0
    # KV bytes one token of this model holds (all layers, K+V): prices a page migration's
    # bytes (services/router/costs.py). 0: not reported, the model's KV is never migrated.
    kv_bytes_per_token: int = 0


class SessionKv(Struct, frozen=True):
    session_id: Name
    model: Name
    state: KvState
    kv_tokens: int = 0


class InstanceSnapshot(Struct, frozen=True):
    instance_id: Token
    version: int
    at: float
    pool: Pool = "cold"
    # A hot instance's pinned model (it may still be finishing another model's calls after
    # the router repinned it, services/router/hot_pools.py). None: cold, or not reported.
    pinned_model: Name | None = None
    models: list[ModelResidency] = []
    active_model: Name | None = None
    sessions: list[SessionKv] = []
    queued: dict[Name, int] = {}
    queued_tokens: int = 0
    # Predicted seconds of restore + prefill a call arriving now waits behind (queued_tokens
    # priced with the agent's calibrated costs, counting only what each call must compute:
    # a prompt whose prefix is on device costs its new tokens). -1: not reported.
    queued_prefill_s: float = -1.0
    # Predicted seconds of prefill the calls admitted here still owe past that (a long prompt
    # under way, chunk by chunk): calls placed here share every step with it. -1: not reported.
    prefill_left_s: float = -1.0
    running: int = 0
    round_remaining_s: float = 0.0
    deadline_risk: int = 0
    kv_capacity_tokens: int = 0
    kv_used_tokens: int = 0
    # Of kv_used_tokens, what running calls hold or reserved; the rest is idle sessions' KV,
    # which the agent evicts (to the host registry) on demand. -1: not reported.
    kv_pinned_tokens: int = -1
    staging_free_bytes: int = 0
    hbm_bytes: int = 0
    hbm_used_bytes: int = 0
    prefill_tok_s: float = 0.0
    # How the active model's prefill slows with context: seconds per prompt token per token
    # it attends over, fitted on the chunks run here once established (prefill_curve.py;
    # `prefill_ctx_measured`), before that the prior from the model's architecture times the
    # linear rate (shared/attention_prior.py). 0: neither (no rate measured yet).
    prefill_ctx_s_per_tok2: float = 0.0
    prefill_ctx_measured: bool = False
    # How far a long prompt's price (this slope on the linear rate the agent's probe measured,
    # else on prefill_tok_s) ran over the time of its recent chunked prefills (a high quantile
    # of price / time); 0: none ran. The router refuses a call for its deadline only past that
    # factor (router/deadlines.py).
    prefill_overstatement: float = 0.0
    decode_tok_s: float = 0.0
    restore_tok_s: float = 0.0
    switch_s: float = 0.0
    # Page migration into this instance (issue 40), as its own pulls measured them: link
    # bytes/s and the fixed seconds per pull (connect, request, hash checks). 0 / -1: none
    # measured yet (the router's defaults price it).
    migrate_bytes_s: float = 0.0
    migrate_setup_s: float = -1.0
    page_address: str = ""  # host:port of this agent's KV page server ("": it serves none)
    heartbeat_s: float = 0.5
    # Random per agent process: a new one means a restart, whose snapshots replace the old
    # view at once whatever their `version` (which restarts at 1).
    incarnation: str = ""
    # False while the agent's watchdog sees an engine step stuck: the router stops choosing it.
    healthy: bool = True
    unhealthy_reason: str = ""


class ServiceHeartbeat(Struct, frozen=True):
    """Liveness of router and telemetry on talaria.health.<service> (agents send snapshots)."""

    service: Name
    at: float
    detail: dict[str, str] = {}


SNAPSHOT_DECODER = msgspec.json.Decoder(InstanceSnapshot)
HEARTBEAT_DECODER = msgspec.json.Decoder(ServiceHeartbeat)
