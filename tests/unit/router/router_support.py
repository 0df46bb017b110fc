"""Builders for router unit tests: snapshots, calls, completions, a core with a fixed policy."""

from __future__ import annotations

from talaria.services.router.router_core import RouterCore
from talaria.services.router.policy.base import PolicyConfig
from talaria.services.router.policy.registry import create_policy
from talaria.shared.events import CallCompleted, CallSubmitted
from talaria.shared.snapshots import InstanceSnapshot, ModelResidency, SessionKv

GIB = 1 << 30


def snap(iid: str, *, version: int = 1, at: float = 0.0, models=None, active: str | None = "m1",
         pool: str = "cold", sessions=(), queued=None, queued_tokens: int = 0, queued_prefill_s: float = -1.0,
         running: int = 0,
         round_remaining_s: float = 0.0, switch_cost_s: float = 1.0, open_cost_s: float = 2.0,
         weight_gib: float = 10.0, hbm_gib: float = 80.0, hbm_used_gib: float = 20.0,
         kv_capacity_tokens: int = 0, kv_used_tokens: int = 0, kv_pinned_tokens: int = -1, deadline_risk: int = 0,
         prefill_tok_s: float = 10_000.0, decode_tok_s: float = 100.0,
         restore_tok_s: float = 100_000.0, incarnation: str = "", heartbeat_s: float = 0.5) -> InstanceSnapshot:
    """`models`: {name: state}; default {"m1": "active" if active == "m1" else "absent"}."""
    if models is None:
        models = {"m1": "active" if active == "m1" else "absent"}
    residency = [
        ModelResidency(name, "active" if name == active else st, 0.0 if name == active else switch_cost_s,
                       open_cost_s, int(weight_gib * GIB))
        for name, st in models.items()
    ]
    return InstanceSnapshot(
        instance_id=iid, version=version, at=at, pool=pool, models=residency, active_model=active,
        sessions=[SessionKv(s, m, st, t) for s, m, st, t in sessions], queued=queued or {},
        queued_tokens=queued_tokens, queued_prefill_s=queued_prefill_s, running=running, round_remaining_s=round_remaining_s,
        deadline_risk=deadline_risk, kv_capacity_tokens=kv_capacity_tokens,
        kv_used_tokens=kv_used_tokens, kv_pinned_tokens=kv_pinned_tokens, hbm_bytes=int(hbm_gib * GIB), hbm_used_bytes=int(hbm_used_gib * GIB),
        staging_free_bytes=0, prefill_tok_s=prefill_tok_s, decode_tok_s=decode_tok_s,
        restore_tok_s=restore_tok_s, incarnation=incarnation, heartbeat_s=heartbeat_s,
    )


def call(call_id: str, session: str = "s1", model: str = "m1", *, tokens: int = 1000,
         max_tokens: int = 10, at: float = 0.0, hashes=()) -> CallSubmitted:
    return CallSubmitted(call_id=call_id, session_id=session, model=model, prompt_ids=[1] * tokens,
                         block_hashes=list(hashes), max_tokens=max_tokens, submitted_at=at)


def done(call_id: str, instance: str, *, session: str = "s1", model: str = "m1", index: int = 0,
         at: float = 1.0, prompt: int = 1000, output: int = 10, **extra) -> CallCompleted:
    return CallCompleted(call_id=call_id, session_id=session, call_index=index, model=model,
                         instance_id=instance, prompt_tokens=prompt, output_tokens=output,
                         finish_reason="stop", submitted_at=at - 0.5, started_at=at - 0.4,
                         first_token_at=at - 0.3, completed_at=at, **extra)


# The tests check the paper's Eq. 1 term by term, so the first-call session-placement term
# and the round-sharing stretch of decode (ours, PolicyConfig.new_session_*,
# price_round_sharing) are off unless a test turns them on.
PAPER_EQ1 = dict(new_session_running_s=0.0, price_round_sharing=False)


def core(policy: str = "talaria", **config) -> RouterCore:
    return RouterCore(create_policy(policy, PolicyConfig(**{**PAPER_EQ1, **config})))


def of_type(events, kind):
    return [e for e in events if isinstance(e, kind)]


def one(events, kind):
    found = of_type(events, kind)
    assert len(found) == 1, f"expected one {kind.__name__}, got {events}"
    return found[0]
