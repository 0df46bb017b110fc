"""docker-compose.yml is valid and starts what the design says (parsed by a real compose)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(COMPOSE is None, reason="needs Debian's docker-compose (apt-get install docker-compose)")
def test_compose_file_parses_and_has_every_service():
    def compose(*args):
        out = subprocess.run([COMPOSE, "-f", str(ROOT / "docker-compose.yml"), *args],
                             capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return out.stdout

    services = set(compose("config", "--services").split())
    assert {"nats-0", "nats-1", "nats-2", "postgres", "jaeger", "prometheus", "grafana", "migrate", "gateway",
            "router-0", "router-1", "telemetry", "agent-0"} <= services
    resolved = compose("config")
    assert "TALARIA_NATS_URL: nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222" in resolved
    assert "OTEL_EXPORTER_OTLP_ENDPOINT: http://jaeger:4318" in resolved


def test_every_service_module_named_in_compose_exists():
    text = (ROOT / "docker-compose.yml").read_text()
    for module in ("talaria.services.gateway", "talaria.services.router", "talaria.services.telemetry", "talaria.services.instance_agent"):
        assert module in text
        assert (ROOT / module.removeprefix("talaria.").replace(".", "/") / "__main__.py").exists()


def test_every_long_running_service_restarts_and_has_a_healthcheck():
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name, svc in services.items():
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), name
        if name not in ("migrate", "secrets"):  # one-shot jobs: done when they exit 0
            assert svc.get("healthcheck", {}).get("test"), name
    checks = {name: svc["healthcheck"]["test"][-1] for name, svc in services.items()
              if "talaria.healthcheck" in svc.get("healthcheck", {}).get("test", [])}
    assert checks == {"gateway": "gateway", "router-0": "router", "router-1": "router", "telemetry": "telemetry",
                      "agent-0": "agent", "agent-1": "agent"}


def test_healthcheck_says_why_in_one_line_when_nothing_answers(monkeypatch):
    from talaria.embedded import free_port
    from talaria.healthcheck import check

    monkeypatch.setenv("TALARIA_NATS_URL", f"nats://127.0.0.1:{free_port()}")
    monkeypatch.setenv("TALARIA_HTTP_PORT", str(free_port()))
    for service in ("gateway", "router"):
        why = check(service, timeout=1.0)
        assert why and "\n" not in why
    assert "unknown service" in check("nope")


def test_nats_its_monitor_and_postgres_are_not_published_outside_compose():
    import yaml

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("nats-0", "nats-1", "nats-2", "postgres"):
        assert "ports" not in services[name], f"{name} must stay on the internal network"
    assert all(not p.startswith(("4222", "6222", "8222", "5432")) for s in services.values() for p in s.get("ports", []))
    assert services["postgres"]["environment"]["POSTGRES_USER"] == "postgres"  # the app role is not it
    # migrate's database URLs (the app role's, the superuser's) come from its own generated secrets
    assert _secrets_subpath(services["migrate"]) == "migrate"


def test_compose_runs_a_three_node_nats_cluster_with_streams_replicated_on_all():
    import yaml

    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services, env = doc["services"], doc["x-talaria-env"]
    nodes = sorted(n for n in services if n.startswith("nats-"))
    assert nodes == ["nats-0", "nats-1", "nats-2"]
    for n in nodes:  # each a member by name; routes and their credentials in the generated config
        cmd = services[n]["command"]
        assert cmd[cmd.index("-n") + 1] == n and cmd[cmd.index("-c") + 1] == "/secrets/nats.conf"
        assert "--routes" not in cmd and "--auth" not in cmd
    assert env["TALARIA_NATS_URL"] == ",".join(f"nats://{n}:4222" for n in nodes)
    assert env["TALARIA_NATS_REPLICAS"] == "3"
    for name in ("gateway", "router-0", "router-1", "telemetry", "agent-0"):
        assert set(nodes) <= set(services[name]["depends_on"])


def test_compose_runs_two_router_replicas_with_their_own_ids():
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    routers = {n: s for n, s in services.items() if s.get("command") == ["talaria.services.router"]}
    assert len(routers) == 2
    assert {s["environment"]["TALARIA_ROUTER_ID"] for s in routers.values()} == set(routers)
    assert all(s["environment"]["TALARIA_ROUTER_PARTITIONS"] == "8" for s in routers.values())


def _secrets_subpath(service: dict) -> str | None:
    """The subdirectory of the generated `secrets` volume a service mounts (None: none)."""
    mounts = [v for v in service.get("volumes", []) if isinstance(v, dict) and v.get("source") == "secrets"]
    assert all(m.get("read_only") for m in mounts), "a consumer mounts its secrets read-only"
    return mounts[0]["volume"]["subpath"] if mounts else None


SECRET_WORDS = ("PASSWORD", "TOKEN", "SECRET", "API_KEYS")


def _environments(doc: dict):
    yield "x-talaria-env", doc["x-talaria-env"]
    for name, svc in doc["services"].items():
        env = svc.get("environment") or {}
        yield name, env if isinstance(env, dict) else dict(e.split("=", 1) for e in env)


def test_compose_holds_no_secret_and_each_service_reads_only_its_own():
    import re

    import yaml

    text = (ROOT / "docker-compose.yml").read_text()
    doc = yaml.safe_load(text)
    for name, env in _environments(doc):
        for key, value in env.items():
            if any(w in key for w in SECRET_WORDS) and not key.endswith(("_FILE", "__FILE")):
                raise AssertionError(f"{name}: {key} set in the compose file")
    # No default value that is a credential (`${X:-secret}`), no password in a URL.
    assert not re.search(r"\$\{[A-Z_]*(PASSWORD|TOKEN|KEY)[A-Z_]*:-", text)
    assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", text)
    assert not any(s in text for s in ("talaria-dev-key-change-me", "talaria-admin", "talaria-dev-nats-token"))
    services = doc["services"]
    own = {name: _secrets_subpath(svc) for name, svc in services.items()}
    assert own == {"gateway": "gateway", "router-0": "router", "router-1": "router", "telemetry": "telemetry",
                   "agent-0": "agent-0", "agent-1": "agent-1", "migrate": "migrate", "nats-0": "nats",
                   "nats-1": "nats", "nats-2": "nats", "postgres": "postgres", "grafana": "grafana",
                   "secrets": None, "jaeger": None, "prometheus": None}
    assert "secrets:/secrets" in services["secrets"]["volumes"]  # the generator: the whole volume
    assert services["secrets"]["command"][:2] == ["talaria.cli", "compose-secrets"]
    for name, svc in services.items():  # every Talaria service loads its secrets at start
        if svc.get("image") == "talaria:latest" and name != "secrets":
            assert svc["entrypoint"] == ["python", "-m", "talaria.container"], name
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_SECURITY_ADMIN_PASSWORD__FILE" in grafana
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"].startswith("/run/secrets/postgres/")


def test_the_gateway_is_published_on_localhost_unless_configured():
    import re

    import yaml

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    published = [p for svc in services.values() for p in svc.get("ports", [])]
    resolved = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", p) for p in published]  # the defaults
    assert resolved and all(p.startswith("127.0.0.1:") for p in resolved), resolved
    assert services["gateway"]["ports"] == ["${TALARIA_GATEWAY_BIND:-127.0.0.1}:8000:8000"]


def test_the_image_runs_as_a_non_root_user():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    final = lines[max(i for i, ln in enumerate(lines) if ln.startswith("FROM ")):]  # the image's own stage
    users = [ln.split()[1] for ln in final if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert any("useradd" in ln and "10001" in ln for ln in final)
