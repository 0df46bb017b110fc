"""Async SQLAlchemy engine from a settings URL; migrations applied with alembic."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from talaria.shared.settings import async_database_url

MIGRATIONS_DIR = Path(str(resources.files("talaria.migrations")))


def create_engine(url: str) -> AsyncEngine:
    return create_async_engine(async_database_url(url), pool_size=5, max_overflow=5, pool_pre_ping=True)


def upgrade(url: str, revision: str = "head") -> None:
    """Apply alembic migrations (blocking; creates the schema in an empty database)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", async_database_url(url))
    command.upgrade(cfg, revision)
