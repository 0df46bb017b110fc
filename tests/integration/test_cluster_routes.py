"""A JetStream cluster's route ports take only its members: a stranger's nats-server pointed at
them, knowing the cluster's name, is refused and reads none of the traffic (user permissions
do not apply to routes, so an admitted route would see every subject)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import nats
import pytest

from talaria.embedded import EmbeddedNatsCluster, RouteTls, free_port, nats_server_binary
from talaria.shared.bus import servers
from talaria.shared.nats_auth import SERVICE_INBOX, generate_users
from tests.integration.harness import wait_until

pytestmark = pytest.mark.integration


class Stranger:
    """A nats-server with no credentials soliciting `routes` as a member of `cluster_name`."""

    def __init__(self, data: Path, cluster_name: str, routes: list[str]) -> None:
        data.mkdir(parents=True, exist_ok=True)
        self.port, self.monitor, self.log = free_port(), free_port(), data / "stranger.log"
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor),
             "--cluster_name", cluster_name, "--cluster", f"nats://127.0.0.1:{free_port()}",
             "--routes", ",".join(routes), "-l", str(self.log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def routes(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/routez", timeout=1) as r:
            return json.load(r)["num_routes"]

    def refusals(self) -> int:
        return self.log.read_text(errors="replace").count("Authorization Violation") if self.log.exists() else 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def assert_stranger_refused(stranger: Stranger, members: int, cluster_url: str, user: dict) -> None:
    """The stranger tried every member and was refused (or joined: then this fails), and a
    subscriber to `>` on it receives nothing of what the cluster carries (published by the
    router's user: `user` holds its `nats.connect` credentials)."""
    async def settled() -> bool:
        try:
            return stranger.routes() > 0 or stranger.refusals() >= members
        except OSError:
            return False

    await wait_until(settled, "the stranger's route attempts", timeout=20)
    spy = await nats.connect(f"nats://127.0.0.1:{stranger.port}")
    seen: list[str] = []

    async def heard(msg) -> None:
        seen.append(msg.subject)

    try:
        await spy.subscribe(">", cb=heard)
        await spy.flush()
        nc = await nats.connect(servers(cluster_url), **user, inbox_prefix=SERVICE_INBOX)
        try:
            for i in range(20):
                await nc.publish("talaria.health.router", f"secret {i}".encode())
            await nc.flush()
        finally:
            await nc.close()
        await spy.flush()
        assert stranger.routes() == 0, "the stranger's routes were accepted"
        assert seen == [], f"the stranger read {len(seen)} messages: {seen[:3]}"
    finally:
        await spy.close()


@pytest.fixture
def cluster(tmp_path):
    c = EmbeddedNatsCluster(tmp_path / "nats", 3, users=generate_users(["agent-0"])).start()
    yield c
    c.stop()


async def test_a_stranger_on_the_route_ports_is_refused_and_reads_nothing(cluster, tmp_path):
    stranger = Stranger(tmp_path / "stranger", cluster.name, cluster.routes)
    try:
        await assert_stranger_refused(stranger, len(cluster.nodes), cluster.url, cluster.users["router"].options())
    finally:
        stranger.stop()
    # The members still route to each other (each has its two peers).
    for node in cluster.nodes:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port}/routez", timeout=1) as r:
            names = {route["remote_name"] for route in json.load(r)["routes"]}
        assert names == {n.name for n in cluster.nodes} - {node.name}


def test_route_credentials_are_only_in_the_private_config(cluster):
    for node in cluster.nodes:
        conf = node.data_dir / "auth.conf"
        assert conf.stat().st_mode & 0o777 == 0o600
        block = json.loads(conf.read_text())["cluster"]
        assert block["authorization"]["user"] == "route" and len(block["authorization"]["password"]) >= 24
        assert all(f"route:{node.route_password}@" in r for r in block["routes"])
        cmdline = Path(f"/proc/{node.proc.pid}/cmdline").read_bytes()
        assert node.route_password.encode() not in cmdline
    assert all("@" not in r for r in cluster.routes)  # what stack.json lists


def _route_certs(directory: Path) -> RouteTls:
    """A CA and one certificate it signed for 127.0.0.1 (openssl), as an operator would bring."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=talaria-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "route.key", "-out", "route.csr",
            "-subj", "/CN=127.0.0.1")
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("x509", "-req", "-in", "route.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "route.pem", "-days", "1", "-extfile", "ext.cnf")
    return RouteTls(directory / "route.pem", directory / "route.key", directory / "ca.pem")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make the test certificates")
async def test_routes_over_mutual_tls_join_members_and_refuse_a_stranger(tmp_path):
    cluster = EmbeddedNatsCluster(tmp_path / "nats", 3, users=generate_users(["agent-0"]),
                                  route_tls=_route_certs(tmp_path / "certs")).start()
    stranger = Stranger(tmp_path / "stranger", cluster.name, cluster.routes)
    try:
        for node in cluster.nodes:  # the members routed to each other over TLS
            with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port}/routez", timeout=1) as r:
                routes = json.load(r)["routes"]
            assert {route["remote_name"] for route in routes} == {n.name for n in cluster.nodes} - {node.name}
        async def tried() -> bool:
            text = stranger.log.read_text(errors="replace") if stranger.log.exists() else ""
            try:
                joined = stranger.routes() > 0
            except OSError:  # its monitor is not up yet
                return False
            return joined or text.count("Router connection closed") >= 3  # each member hung up on it

        await wait_until(tried, "the stranger's route attempts", timeout=20)
        spy = await nats.connect(f"nats://127.0.0.1:{stranger.port}")
        try:
            seen = []

            async def heard(msg) -> None:
                seen.append(msg.subject)

            await spy.subscribe(">", cb=heard)
            await spy.flush()
            assert stranger.routes() == 0 and seen == []
        finally:
            await spy.close()
    finally:
        stranger.stop()
        cluster.stop()
