"""`talaria compose-secrets`: a compose deployment's secrets, generated at its first start and
kept after; each service's env names its own NATS user, whose permissions the NATS config
holds, and `python -m talaria.container` loads that env before running the service."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from talaria.compose_secrets import write_compose_secrets
from talaria.container import read_env
from talaria.shared.api_keys import hash_key
from talaria.shared.nats_auth import permissions


def test_secrets_are_generated_once_private_and_consistent(tmp_path):
    out = tmp_path / "secrets"
    assert write_compose_secrets(out, ["agent-0", "agent-1"])
    first = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert not write_compose_secrets(out, ["agent-0", "agent-1"])  # a later start keeps them
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == first
    for path in first:
        shared = path.parent.name in ("postgres", "grafana")  # read by those images' own users
        assert path.stat().st_mode & 0o777 == (0o644 if shared else 0o600), path

    conf = json.loads((out / "nats" / "nats.conf").read_text())
    users = {u["user"]: u for u in conf["authorization"]["users"]}
    for service, role, instance in (("gateway", "gateway", None), ("router", "router", None),
                                    ("telemetry", "telemetry", None), ("agent-1", "agent", "agent-1")):
        env = read_env(out / service / "env")
        user = users[env["TALARIA_NATS_USER"]]
        assert user["password"] == env["TALARIA_NATS_PASSWORD"]
        assert user["permissions"] == permissions(role, "talaria", instance)
        assert env["TALARIA_DATABASE_URL"].startswith("postgresql://talaria:")
    cluster = conf["cluster"]
    password = cluster["authorization"]["password"]
    assert len(password) >= 24 and cluster["routes"] == [f"nats://route:{password}@nats-{i}:6222" for i in range(3)]
    key = (out / "operator" / "api_key").read_text().strip()
    assert (out / "gateway" / "api_keys").read_text().split() == ["default", hash_key(key)]
    admin = (out / "postgres" / "admin_password").read_text()
    assert read_env(out / "migrate" / "env")["TALARIA_DATABASE_ADMIN_URL"] == \
        f"postgresql://postgres:{admin}@postgres:5432/talaria"
    # Two deployments never share a secret.
    other = tmp_path / "other"
    write_compose_secrets(other, ["agent-0"])
    assert (other / "operator" / "api_key").read_text() != key


def test_the_container_entry_point_loads_the_services_env_then_runs_it(tmp_path):
    env_file = tmp_path / "env"
    env_file.write_text("TALARIA_NATS_USER=talaria-router\nTALARIA_NATS_PASSWORD=p=w\n")
    code = "import os; print(os.environ['TALARIA_NATS_USER'], os.environ['TALARIA_NATS_PASSWORD'])"
    script = tmp_path / "show.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, "-m", "talaria.container", "--env", str(env_file), "show"],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["talaria-router", "p=w"]
    missing = subprocess.run([sys.executable, "-m", "talaria.container", "--env", str(tmp_path / "nope"), "show"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no secrets" in missing.stderr


def test_nats_config_writes_an_external_clusters_route_credentials(tmp_path):
    out = tmp_path / "nats"
    run = subprocess.run([sys.executable, "-m", "talaria.cli", "nats-config", str(out), "--cluster-routes",
                          "nats-a:6222,nats-b:6222"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    conf = out / "cluster.conf"
    assert conf.stat().st_mode & 0o777 == 0o600
    cluster = json.loads(conf.read_text())["cluster"]
    password = cluster["authorization"]["password"]
    assert cluster["authorization"]["user"] == "route" and len(password) >= 24
    assert cluster["routes"] == [f"nats://route:{password}@nats-a:6222", f"nats://route:{password}@nats-b:6222"]
