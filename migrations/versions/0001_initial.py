"""Initial schema: sessions, calls, lease decisions and events, switches, rounds, projections.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.Text, primary_key=True),
        sa.Column("first_seen_at", TS, nullable=False),
        sa.Column("last_seen_at", TS, nullable=False),
        sa.Column("calls", sa.Integer, nullable=False, server_default="0"),
        sa.Column("completed", sa.Integer, nullable=False, server_default="0"),
        sa.Column("failed", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_model", sa.Text),
        sa.Column("last_instance", sa.Text),
        sa.Column("trace_id", sa.Text),
    )
    op.create_table(
        "calls",
        sa.Column("call_id", sa.Text, primary_key=True),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("call_index", sa.Integer),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("instance_id", sa.Text),
        sa.Column("api", sa.Text),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("output_tokens", sa.Integer),
        sa.Column("cached_tokens", sa.Integer),
        sa.Column("kv_source", sa.Text),
        sa.Column("finish_reason", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("failed_stage", sa.Text),
        sa.Column("status", sa.Integer),
        sa.Column("submitted_at", TS),
        sa.Column("routed_at", TS),
        sa.Column("started_at", TS),
        sa.Column("first_token_at", TS),
        sa.Column("completed_at", TS),
        sa.Column("queue_s", sa.Float),
        sa.Column("ttft_s", sa.Float),
        sa.Column("prefill_s", sa.Float),
        sa.Column("decode_s", sa.Float),
        sa.Column("slot_wait_s", sa.Float),
        sa.Column("trace_id", sa.Text),
    )
    op.create_index("calls_session_idx", "calls", ["session_id", "call_index"])
    op.create_table(
        "lease_decisions",
        sa.Column("call_id", sa.Text, primary_key=True),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("call_index", sa.Integer),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("policy", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("decided_at", TS, nullable=False),
        sa.Column("chosen_instance", sa.Text),
        sa.Column("lease_outcome", sa.Text, nullable=False),
        sa.Column("lease_instance", sa.Text),
        sa.Column("discard_reason", sa.Text),
        sa.Column("candidates", JSONB, nullable=False),
        sa.Column("retry_after_s", sa.Float),
        sa.Column("decision_us", sa.Float),
        sa.Column("model_opened", sa.Boolean),
        sa.Column("avoidable_cold_open", sa.Boolean),
        sa.Column("outcome", sa.Text),
        sa.Column("ttft_s", sa.Float),
        sa.Column("kv_source", sa.Text),
        sa.Column("completed_at", TS),
    )
    op.create_index("lease_decisions_session_idx", "lease_decisions", ["session_id", "call_index"])
    op.create_table(
        "lease_events",
        sa.Column("seq", sa.BigInteger, primary_key=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("instance_id", sa.Text, nullable=False),
        sa.Column("call_id", sa.Text),
        sa.Column("reason", sa.Text),
        sa.Column("at", TS, nullable=False),
        sa.Column("expires_at", TS),
    )
    op.create_index("lease_events_session_idx", "lease_events", ["session_id", "at"])
    op.create_table(
        "switches",
        sa.Column("seq", sa.BigInteger, primary_key=True),
        sa.Column("instance_id", sa.Text, nullable=False),
        sa.Column("from_model", sa.Text),
        sa.Column("to_model", sa.Text, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("total_s", sa.Float, nullable=False),
        sa.Column("phases", JSONB, nullable=False),
        sa.Column("bytes_staged", sa.BigInteger),
        sa.Column("bytes_uncovered", sa.BigInteger),
        sa.Column("at", TS, nullable=False),
    )
    op.create_table(
        "rounds",
        sa.Column("seq", sa.BigInteger, primary_key=True),
        sa.Column("instance_id", sa.Text, nullable=False),
        sa.Column("round_index", sa.Integer, nullable=False),
        sa.Column("wall_s", sa.Float, nullable=False),
        sa.Column("active_s", sa.Float, nullable=False),
        sa.Column("switch_s", sa.Float, nullable=False),
        sa.Column("slots", JSONB, nullable=False),
        sa.Column("sp_admitted", sa.Integer),
        sa.Column("sp_parked", sa.Integer),
        sa.Column("deadline_risk", sa.Integer),
        sa.Column("at", TS, nullable=False),
    )
    op.create_table(
        "projections",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("state", JSONB),
        sa.Column("saved_at", TS, nullable=False),
    )


def downgrade() -> None:
    for table in ("projections", "rounds", "switches", "lease_events", "lease_decisions", "calls", "sessions"):
        op.drop_table(table)
