"""The Postgres schema: projections of the event stream, queried with plain SQL.

Alembic revisions in `migrations/` create exactly these tables; a test checks that
the migrated database and this metadata agree.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    LargeBinary,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

ts = lambda name, **kw: Column(name, DateTime(timezone=True), **kw)  # noqa: E731

sessions = Table(
    "sessions",
    metadata,
    Column("session_id", Text, primary_key=True),
    ts("first_seen_at", nullable=False),
    ts("last_seen_at", nullable=False),
    Column("calls", Integer, nullable=False, server_default="0"),
    Column("completed", Integer, nullable=False, server_default="0"),
    Column("failed", Integer, nullable=False, server_default="0"),
    Column("last_model", Text),
    Column("last_instance", Text),
    Column("trace_id", Text),
)

calls = Table(
    "calls",
    metadata,
    Column("call_id", Text, primary_key=True),
    Column("session_id", Text, nullable=False),
    Column("call_index", Integer),
    Column("model", Text, nullable=False),
    Column("instance_id", Text),
    Column("api", Text),  # set by the submission alone: NULL until it is projected
    Column("outcome", Text, nullable=False),  # submitted | routed | running | completed | failed
    Column("prompt_tokens", Integer),
    Column("output_tokens", Integer),
    Column("cached_tokens", Integer),
    Column("kv_source", Text),  # device | host | migrated | recompute | none
    Column("migrated_bytes", BigInteger),  # kv_source migrated: page bytes pulled (0005)
    Column("migrate_s", Float),  # ... and the seconds the pull took
    Column("finish_reason", Text),
    Column("error", Text),
    Column("failed_stage", Text),
    Column("status", Integer),
    ts("submitted_at"),
    ts("routed_at"),
    ts("started_at"),
    ts("first_token_at"),
    ts("completed_at"),
    Column("queue_s", Float),
    Column("ttft_s", Float),
    Column("prefill_s", Float),
    Column("decode_s", Float),
    Column("slot_wait_s", Float),
    Column("trace_id", Text),
    Index("calls_session_idx", "session_id", "call_index"),
)

lease_decisions = Table(
    "lease_decisions",
    metadata,
    Column("call_id", Text, primary_key=True),
    Column("session_id", Text, nullable=False),
    Column("call_index", Integer),
    Column("model", Text, nullable=False),
    Column("policy", Text, nullable=False),
    Column("action", Text, nullable=False),  # route | reject
    ts("decided_at", nullable=False),
    Column("chosen_instance", Text),
    Column("lease_outcome", Text, nullable=False),  # consumed | discarded | none
    Column("lease_instance", Text),
    Column("discard_reason", Text),
    Column("candidates", JSONB, nullable=False),
    Column("retry_after_s", Float),
    Column("decision_us", Float),
    Column("model_opened", Boolean),
    Column("avoidable_cold_open", Boolean),
    Column("reason", Text),  # why the policy decided so (a rejection names its bound); 0003
    # joined in when the call finishes
    Column("outcome", Text),
    Column("ttft_s", Float),
    Column("kv_source", Text),
    ts("completed_at"),
    Index("lease_decisions_session_idx", "session_id", "call_index"),
)

lease_events = Table(
    "lease_events",
    metadata,
    Column("seq", BigInteger, primary_key=True),  # JetStream stream sequence
    Column("kind", Text, nullable=False),  # issued | consumed | discarded | expired
    Column("session_id", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("instance_id", Text, nullable=False),
    Column("call_id", Text),
    Column("reason", Text),
    ts("at", nullable=False),
    ts("expires_at"),
    Index("lease_events_session_idx", "session_id", "at"),
)

switches = Table(
    "switches",
    metadata,
    Column("seq", BigInteger, primary_key=True),
    Column("instance_id", Text, nullable=False),
    Column("from_model", Text),
    Column("to_model", Text, nullable=False),
    Column("path", Text, nullable=False),
    Column("total_s", Float, nullable=False),
    Column("phases", JSONB, nullable=False),
    Column("bytes_staged", BigInteger),
    Column("bytes_uncovered", BigInteger),
    ts("at", nullable=False),
)

rounds = Table(
    "rounds",
    metadata,
    Column("seq", BigInteger, primary_key=True),
    Column("instance_id", Text, nullable=False),
    Column("round_index", Integer, nullable=False),
    Column("wall_s", Float, nullable=False),
    Column("active_s", Float, nullable=False),
    Column("switch_s", Float, nullable=False),
    Column("slots", JSONB, nullable=False),
    Column("sp_admitted", Integer),
    Column("sp_parked", Integer),
    Column("deadline_risk", Integer),
    ts("at", nullable=False),
)

projections = Table(
    "projections",
    metadata,
    Column("name", Text, primary_key=True),  # telemetry | router
    Column("seq", BigInteger, nullable=False),  # last stream sequence folded in
    Column("state", JSONB),
    ts("saved_at", nullable=False),
)

refused_dispatches = Table(
    "refused_dispatches",
    metadata,
    Column("seq", BigInteger, primary_key=True),
    Column("call_id", Text, nullable=False),
    Column("session_id", Text, nullable=False),
    Column("instance_id", Text, nullable=False),  # the agent that refused it
    Column("router_id", Text, nullable=False),  # the router whose claim was superseded
    Column("partition", Integer, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("holder", Text, nullable=False),  # who held the partition then
    Column("holder_epoch", BigInteger, nullable=False),
    ts("at", nullable=False),
)

quarantined_events = Table(
    "quarantined_events",
    metadata,
    Column("seq", BigInteger, primary_key=True),  # JetStream stream sequence of the poison event
    Column("subject", Text, nullable=False),
    Column("error", Text, nullable=False),  # why it could not be decoded or projected
    Column("data", LargeBinary, nullable=False),  # the raw message, for a replay once fixed
    ts("at", nullable=False),
)
