"""refused_dispatches: dispatches an agent did not run, their router's partition claim superseded.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "refused_dispatches",
        sa.Column("seq", sa.BigInteger, primary_key=True),
        sa.Column("call_id", sa.Text, nullable=False),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("instance_id", sa.Text, nullable=False),
        sa.Column("router_id", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("holder_epoch", sa.BigInteger, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("refused_dispatches")
