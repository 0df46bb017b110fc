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
        if name != "migrate":  # a one-shot job: done when it exits 0
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
    assert "talaria:" in services["migrate"]["environment"]["TALARIA_DATABASE_URL"] or \
        "TALARIA_DATABASE_ADMIN_URL" in services["migrate"]["environment"]


def test_compose_runs_a_three_node_nats_cluster_with_streams_replicated_on_all():
    import yaml

    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services, env = doc["services"], doc["x-talaria-env"]
    nodes = sorted(n for n in services if n.startswith("nats-"))
    assert nodes == ["nats-0", "nats-1", "nats-2"]
    routes = {",".join(f"nats://{n}:6222" for n in nodes)}
    for n in nodes:
        cmd = services[n]["command"]
        assert cmd[cmd.index("-n") + 1] == n and {cmd[cmd.index("--routes") + 1]} == routes
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
