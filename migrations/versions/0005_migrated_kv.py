"""calls.migrated_bytes, calls.migrate_s: a call whose prefix pages were pulled from another
instance (kv_source = migrated, issue 40) records the bytes and the seconds of the pull.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("calls", sa.Column("migrated_bytes", sa.BigInteger))
    op.add_column("calls", sa.Column("migrate_s", sa.Float))


def downgrade() -> None:
    op.drop_column("calls", "migrate_s")
    op.drop_column("calls", "migrated_bytes")
