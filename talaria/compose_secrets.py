"""`talaria compose-secrets DIR`: the secrets of a docker-compose deployment, generated once.

docker-compose.yml runs it as a one-shot `secrets` service before anything else; it writes
into a volume every consumer mounts only its own subdirectory of (a compose `subpath`), so
no secret is ever in the compose file or an image. A second start keeps what the first wrote.

    <service>/env         TALARIA_NATS_USER/PASSWORD (its own NATS user, as `talaria up`
                          gives each service), TALARIA_DATABASE_URL (the application role)
    gateway/api_keys      the API key's hash (TALARIA_API_KEYS_FILE)
    migrate/env           the database URLs, the superuser's too (it creates the app role)
    nats/nats.conf        users, permissions, and the cluster's route user and password
    postgres/, grafana/   admin_password (read by those images' own users: mode 0644)
    operator/             the generated API key and the tenant's NATS API client user
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from talaria.embedded import cluster_block
from talaria.shared.api_keys import hash_key, new_key, write_key_file
from talaria.shared.nats_auth import authorization_block, cluster_route_urls, generate_users

DONE = ".complete"  # written last: a start interrupted half-way generates everything again
NATS_NODES = ("nats-0", "nats-1", "nats-2")
ROUTE_PORT = 6222


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path, "w", opener=lambda p, flags: os.open(p, flags, mode)) as f:
        f.write(text)
    path.chmod(mode)


def _env(values: dict[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in values.items())


def write_compose_secrets(out: Path, agents: list[str], tenant: str = "default", deployment: str = "talaria",
                          database: str = "postgres:5432/talaria") -> bool:
    """Generate every secret under `out`; False (nothing written) when a previous start did."""
    if (out / DONE).exists():
        return False
    users = generate_users(agents, [tenant])
    admin, app = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    app_url = f"postgresql://talaria:{app}@{database}"
    key = new_key()
    own = {"gateway": "gateway", "router": "router", "telemetry": "telemetry", **{a: f"agent-{a}" for a in agents}}
    for directory, user in own.items():  # directory -> its NATS user (every router replica shares one)
        _write(out / directory / "env", _env({**users[user].env(), "TALARIA_DATABASE_URL": app_url}))
    write_key_file(out / "gateway" / "api_keys", [(tenant, hash_key(key))])
    _write(out / "migrate" / "env", _env({"TALARIA_DATABASE_URL": app_url,
                                          "TALARIA_DATABASE_ADMIN_URL": f"postgresql://postgres:{admin}@{database}"}))
    route = secrets.token_urlsafe(24)
    cluster = cluster_block(deployment, ROUTE_PORT, (), "route", route)
    cluster["listen"] = f"0.0.0.0:{ROUTE_PORT}"
    cluster["routes"] = cluster_route_urls([f"{node}:{ROUTE_PORT}" for node in NATS_NODES], "route", route)
    _write(out / "nats" / "nats.conf", json.dumps({"authorization": authorization_block(users, deployment),
                                                   "cluster": cluster}, indent=1))
    _write(out / "postgres" / "admin_password", admin, 0o644)
    _write(out / "grafana" / "admin_password", secrets.token_urlsafe(18), 0o644)
    _write(out / "operator" / "api_key", key + "\n")
    _write(out / "operator" / "nats_client.env", _env(users[f"client-{tenant}"].env()))  # the NATS API
    for sub in ("postgres", "grafana"):  # their images read them as their own (non-root) users
        (out / sub).chmod(0o755)
    _write(out / DONE, "")
    return True
