"""Quarantined events: poison events the telemetry projection recorded and skipped.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quarantined_events",
        sa.Column("seq", sa.BigInteger, primary_key=True),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("quarantined_events")
