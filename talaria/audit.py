"""`talaria audit`: run the operator's SQL audits in ops/audit/ against the database.

Each query is a plain .sql file (first comment lines describe it; `-- params: a, b` lists
its bind parameters), so operators can also paste them into psql. A `session_id` parameter
is the id the client sent; it is matched to the stored, tenant-scoped id (talaria/running.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from importlib import resources
from pathlib import Path

import asyncpg
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from talaria.running import match_sessions, pick_session
from talaria.shared.db.connection import create_engine
from talaria.shared.settings import redact_url

# ops/audit/ ships in the wheel as package data of `talaria.ops`.
AUDIT_DIR = Path(str(resources.files("talaria.ops").joinpath("audit")))


def audits() -> dict[str, Path]:
    return {p.stem: p for p in sorted(AUDIT_DIR.glob("*.sql"))}


def describe(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("--"):
            break
        lines.append(line[2:].strip())
    return " ".join(lines)


def params_of(sql: str) -> list[str]:
    return sorted(set(re.findall(r"(?<!:):([a-z_]+)", sql)))


async def query(database_url: str, name: str, params: dict[str, str]) -> list[dict]:
    sql = audits()[name].read_text()
    db = create_engine(database_url)
    try:
        async with db.connect() as conn:
            result = await conn.execute(text(sql), params)
            return [dict(r._mapping) for r in result]
    finally:
        await db.dispose()


async def stored_sessions(database_url: str, typed: str) -> list[str]:
    """The stored session ids that are `typed` or end in `:<typed>` (one per tenant that sent it)."""
    sql = text("SELECT session_id FROM sessions WHERE session_id = :t OR right(session_id, length(:t) + 1) = ':' || :t")
    db = create_engine(database_url)
    try:
        async with db.connect() as conn:
            return [r[0] for r in await conn.execute(sql, {"t": typed})]
    finally:
        await db.dispose()


def run_audit(database_url, name: str | None, raw_params: list[str], fmt: str,
              tenant: str | None = None) -> int:
    """`database_url`: a callable giving the URL, asked only when a query runs (listing needs none)."""
    known = audits()
    if name is None:
        for stem, path in known.items():
            print(f"{stem:32} {describe(path)}")
        return 0
    if name not in known:
        print(f"talaria audit: unknown audit {name!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    params = dict(p.split("=", 1) for p in raw_params if "=" in p)
    missing = [p for p in params_of(known[name].read_text()) if p not in params]
    if missing:
        print(f"talaria audit: {name} needs --param {'=… --param '.join(missing)}=…", file=sys.stderr)
        return 2
    url = database_url()
    try:
        return _run(url, name, params, fmt, tenant)
    except OSError as exc:  # e.g. a stopped stack: its stack.json stays behind
        print(f"talaria audit: cannot reach the database at {redact_url(url)}: {exc} (is the stack running?)",
              file=sys.stderr)
        return 1
    except (DBAPIError, asyncpg.PostgresError) as exc:  # refused login, a parameter of the wrong type
        print(f"talaria audit: {name}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1


def _run(url: str, name: str, params: dict[str, str], fmt: str, tenant: str | None) -> int:
    if "session_id" in params:  # the id the client sent -> the stored `<tenant>:<id>`
        typed = params["session_id"]
        matches = match_sessions(typed, asyncio.run(stored_sessions(url, typed)), tenant)
        if not matches:
            print(f"talaria audit: no session {typed!r}{f' of tenant {tenant!r}' if tenant else ''} "
                  "has been recorded", file=sys.stderr)
            return 1
        params["session_id"] = pick_session(typed, matches)
    rows = asyncio.run(query(url, name, params))
    if fmt == "json":
        print(json.dumps(rows, default=str, indent=2))
    else:
        print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    if not rows:
        print("(no rows)")
        return
    cols = list(rows[0])
    cells = [[("" if r[c] is None else str(r[c])) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
