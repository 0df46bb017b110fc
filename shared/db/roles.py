"""The application role: owns Talaria's schema and nothing else.

Services and migrations connect as this role, never as a superuser: it cannot read server
files, run `COPY ... PROGRAM`, create roles or databases, or touch other schemas. Run once
per database by an administrator (the embedded server does it at start).
"""

from __future__ import annotations

import asyncpg

from talaria.shared.settings import asyncpg_dsn

SCHEMA = "talaria"


def sql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _ident(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


def app_role_sql(role: str, password: str, database: str) -> str:
    """Create (or reset) `role` as a plain login role owning schema `talaria` of `database`
    (run while connected to it), with that schema as its search path."""
    r = _ident(role)
    attrs = f"LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS PASSWORD {sql_literal(password)}"
    return f"""
DO $$ BEGIN
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {sql_literal(role)}) THEN ALTER ROLE {r} WITH {attrs};
  ELSE CREATE ROLE {r} WITH {attrs}; END IF;
END $$;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
CREATE SCHEMA IF NOT EXISTS {SCHEMA} AUTHORIZATION {r};
GRANT CONNECT ON DATABASE {_ident(database)} TO {r};
ALTER ROLE {r} IN DATABASE {_ident(database)} SET search_path = {SCHEMA};
"""


async def ensure_app_role(admin_url: str, role: str, password: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(admin_url))
    try:
        await conn.execute(app_role_sql(role, password, await conn.fetchval("SELECT current_database()")))
    finally:
        await conn.close()


async def drop_app_role(admin_url: str, role: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(admin_url))
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await conn.execute(f"DROP OWNED BY {_ident(role)} CASCADE")
        await conn.execute(f"DROP ROLE IF EXISTS {_ident(role)}")
    finally:
        await conn.close()
