"""Alembic environment: async engine (asyncpg), URL from the caller or TALARIA_DATABASE_URL."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from talaria.shared.db.schema import metadata
from talaria.shared.settings import Settings, async_database_url

config = context.config
target_metadata = metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or Settings.from_env().common.database_url
    if not url:
        raise RuntimeError("no database URL: set TALARIA_DATABASE_URL")
    return async_database_url(url)


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


async def _online() -> None:
    engine = create_async_engine(_url())
    async with engine.connect() as conn:
        await conn.run_sync(_run)
        await conn.commit()
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_online())
