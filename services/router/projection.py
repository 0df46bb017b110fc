"""The router's projection in Postgres: its state and the stream sequence it covers."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from talaria.services.router.state import RouterState
from talaria.shared.db.schema import projections

NAME = "router"


class ProjectionStore:
    def __init__(self, db: AsyncEngine) -> None:
        self.db = db

    async def load(self) -> tuple[RouterState, int] | None:
        """The saved state and the stream sequence it covers, or None before the first save."""
        async with self.db.connect() as conn:
            row = (await conn.execute(select(projections).where(projections.c.name == NAME))).first()
        if row is None or row.state is None:
            return None
        return RouterState.from_dict(row.state), row.seq

    async def save_dict(self, seq: int, snapshot: dict) -> None:
        values = dict(name=NAME, seq=seq, state=snapshot, saved_at=dt.datetime.now(dt.timezone.utc))
        stmt = insert(projections).values(**values)
        stmt = stmt.on_conflict_do_update(index_elements=[projections.c.name], set_=values)
        async with self.db.begin() as conn:
            await conn.execute(stmt)
