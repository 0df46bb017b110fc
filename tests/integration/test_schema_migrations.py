"""The schema is written once: alembic's migrations and the SQLAlchemy metadata agree."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from talaria.shared.db.connection import create_engine
from talaria.shared.db.schema import metadata

pytestmark = pytest.mark.integration


def _diff(sync_conn) -> list:
    ctx = MigrationContext.configure(sync_conn, opts={"compare_type": True, "compare_server_default": True})
    return compare_metadata(ctx, metadata)


async def test_migrated_database_matches_the_sqlalchemy_schema(database_url):
    """database_url is a clone of a template migrated with `alembic upgrade head`."""
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            diff = await conn.run_sync(_diff)
    finally:
        await engine.dispose()
    assert diff == [], f"migrations and shared/db/schema.py disagree: {diff}"
