"""The alembic migrations and shared/db/schema.py describe the same database."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from talaria.shared.db.engine import create_engine
from talaria.shared.db.schema import metadata

pytestmark = pytest.mark.integration


async def test_migrated_database_matches_the_schema_module(database_url):
    db = create_engine(database_url)
    try:
        async with db.connect() as conn:
            diff = await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c), metadata))
    finally:
        await db.dispose()
    assert diff == []
