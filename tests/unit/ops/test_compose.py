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
    assert {"nats", "postgres", "jaeger", "migrate", "gateway", "router", "telemetry", "agent-0"} <= services
    resolved = compose("config")
    assert "TALARIA_NATS_URL: nats://nats:4222" in resolved
    assert "OTEL_EXPORTER_OTLP_ENDPOINT: http://jaeger:4318" in resolved


def test_every_service_module_named_in_compose_exists():
    text = (ROOT / "docker-compose.yml").read_text()
    for module in ("talaria.services.gateway", "talaria.services.router", "talaria.services.telemetry", "talaria.services.instance_agent"):
        assert module in text
        assert (ROOT / module.removeprefix("talaria.").replace(".", "/") / "__main__.py").exists()


def test_nats_its_monitor_and_postgres_are_not_published_outside_compose():
    import yaml

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("nats", "postgres"):
        assert "ports" not in services[name], f"{name} must stay on the internal network"
    assert all(not p.startswith(("4222", "8222", "5432")) for s in services.values() for p in s.get("ports", []))
    assert services["postgres"]["environment"]["POSTGRES_USER"] == "postgres"  # the app role is not it
    assert "talaria:" in services["migrate"]["environment"]["TALARIA_DATABASE_URL"] or \
        "TALARIA_DATABASE_ADMIN_URL" in services["migrate"]["environment"]
