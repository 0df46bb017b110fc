"""Async SQLAlchemy engine from a settings URL; migrations applied with alembic."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import asyncpg
import msgspec
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from talaria.shared.settings import async_database_url

MIGRATIONS_DIR = Path(str(resources.files("talaria.migrations")))


# What a database call raises when Postgres or the connection to it fails: a service catches
# these at its boundary with the database; anything else is a bug and propagates.
DB_ERRORS = (SQLAlchemyError, asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)

_JSON = msgspec.json.Encoder()


def _json(value) -> str:
    # JSONB values (the router's checkpoint, audit rows) encoded by msgspec: ~10x faster than
    # json.dumps on the router's checkpoint (results/router_checkpoint.md).
    return _JSON.encode(value).decode()


def create_engine(url: str) -> AsyncEngine:
    return create_async_engine(async_database_url(url), pool_size=5, max_overflow=5, pool_pre_ping=True,
                               json_serializer=_json)


def upgrade(url: str, revision: str = "head") -> None:
    """Apply alembic migrations (blocking; creates the schema in an empty database)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", async_database_url(url))
    command.upgrade(cfg, revision)
