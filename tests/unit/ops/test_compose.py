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
