"""lease_decisions.reason: why the policy decided as it did (a rejection names its bound).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("lease_decisions", sa.Column("reason", sa.Text))


def downgrade() -> None:
    op.drop_column("lease_decisions", "reason")
