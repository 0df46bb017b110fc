"""Several network hosts on one machine: Linux network namespaces on a bridge.

`Cluster` runs talaria as an operator would on three machines: a control host (a NATS node,
`talaria up --role control,gateway`: Postgres, router, telemetry, gateway) and agent hosts
(a NATS node and `talaria up --role agent`), the NATS nodes one JetStream cluster with
authenticated routes. Faults are real: a host's link goes down (`partition`), a NATS node is
SIGKILLed, `tc netem` shapes a link. Needs root (`ip netns`); `available()` says why not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from talaria import running
from talaria.embedded import nats_server_binary

CLIENT_PORT, ROUTE_PORT, MONITOR_PORT, GATEWAY_PORT = 4222, 6222, 8222, 8000


def available() -> str | None:
    """None when namespaces can be made here, else the reason."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        return "needs Linux with iproute2 (`ip netns`)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"tlprobe{os.getpid() % 100000}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "`ip netns add` is not permitted here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Host:
    name: str  # the network namespace
    ip: str
    link: str  # its veth's end on the bridge: down = the host is cut off

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]


@dataclass
class Network:
    """A bridge in the root namespace and one namespace per host, 10.<a>.<b>.<i>/24; the root
    namespace (the test) is .254 on the bridge and reaches every host."""

    names: tuple[str, ...]
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000:04d}")
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"tlbr{self.tag}"

    def create(self) -> "Network":
        n = int(self.tag)
        prefix = f"10.{200 + n // 256 % 50}.{n % 256}"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{prefix}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names, 1):
            ns, outer = f"tl{self.tag}{name}", f"tl{self.tag}{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{prefix}.{i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[name] = Host(ns, f"{prefix}.{i}", outer)
        return self

    def partition(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].link, "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].link, "up")

    def shape(self, name: str, delay_ms: float, rate: str) -> str:
        """Shape the host's link both ways (e.g. 0.5 ms, "1gbit"); says what it applied. A
        kernel without sch_netem (this machine's) gets the rate alone, from tbf."""
        host = self.hosts[name]
        ends = (["tc", "qdisc", "replace", "dev", host.link, "root"],
                host.command(["tc", "qdisc", "replace", "dev", "eth0", "root"]))
        if all(subprocess.run([*end, "netem", "delay", f"{delay_ms}ms", "rate", rate], capture_output=True).returncode
               == 0 for end in ends):
            return f"netem {delay_ms} ms, {rate}"
        for end in ends:
            subprocess.run([*end, "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"], check=True,
                           capture_output=True)
        return f"tbf {rate} (no sch_netem in this kernel: no added delay)"

    def destroy(self) -> None:
        for host in self.hosts.values():
            _ip("netns", "del", host.name, check=False)
            _ip("link", "del", host.link, check=False)
        _ip("link", "del", self.bridge, check=False)


@dataclass
class Cluster:
    """talaria on a control host and agent hosts, one NATS node on each."""

    root: Path
    agent_hosts: tuple[str, ...] = ("a1", "a2")
    agents_per_host: int = 1
    net: Network | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    api_key: str = ""

    @property
    def host_names(self) -> tuple[str, ...]:
        return ("ctl", *self.agent_hosts)

    @property
    def gateway_url(self) -> str:
        return f"http://{self.net.hosts['ctl'].ip}:{GATEWAY_PORT}"

    def agent_ids(self) -> list[str]:
        return [f"{h}-{i}" for h in self.agent_hosts for i in range(self.agents_per_host)]

    def nats_urls(self, first: str) -> str:
        """Every member, the host's own first (a service connects to the first that answers)."""
        order = [first, *(h for h in self.host_names if h != first)]
        return ",".join(f"nats://{self.net.hosts[h].ip}:{CLIENT_PORT}" for h in order)

    def start(self, timeout: float = 180.0) -> "Cluster":
        self.root.mkdir(parents=True, exist_ok=True)
        self.net = Network(self.host_names).create()
        try:
            creds = self.root / "nats-credentials"
            routes = ",".join(f"{self.net.hosts[h].ip}:{ROUTE_PORT}" for h in self.host_names)
            self._talaria(["nats-config", str(creds), "--agents", ",".join(self.agent_ids()), "--cluster-routes", routes])
            for name in self.host_names:
                self.start_nats(name, creds)
            for name in self.host_names:
                self._wait_jetstream(name, timeout)
            self._up("ctl", ["--role", "control,gateway", "--port", str(GATEWAY_PORT)], creds)
            for name in self.agent_hosts:
                self._up(name, ["--role", "agent", "--agents", str(self.agents_per_host), "--agent-prefix", name],
                         creds)
            for name in self.host_names:
                self._wait_log(f"up-{name}", "ready in", timeout)
            self.api_key = (self.root / "ctl" / "api_key").read_text().strip()
            self._wait_instances(set(self.agent_ids()), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    # ---- NATS --------------------------------------------------------------------------

    def start_nats(self, name: str, creds: Path) -> None:
        """One cluster member, configured from `talaria nats-config`: its `cluster.conf` (routes
        need the cluster's user) with this member's own listen address, and `auth.conf` (the
        services' users)."""
        host = self.net.hosts[name]
        store = self.root / f"nats-{name}"
        store.mkdir(exist_ok=True)
        auth = json.loads((creds / "auth.conf").read_text())
        cluster = json.loads((creds / "cluster.conf").read_text())["cluster"]
        config = {
            "server_name": f"nats-{name}", "listen": f"0.0.0.0:{CLIENT_PORT}", "http": f"0.0.0.0:{MONITOR_PORT}",
            "jetstream": {"store_dir": str(store / "jetstream")},
            "cluster": {**cluster, "listen": f"0.0.0.0:{ROUTE_PORT}"},
            **auth,
        }
        path = store / "nats.conf"
        path.write_text(json.dumps(config, indent=1))
        path.chmod(0o600)
        self._spawn(f"nats-{name}", host.command([nats_server_binary(), "-c", str(path)]))

    def kill_nats(self, name: str) -> None:
        proc = self.procs[f"nats-{name}"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def restart_nats(self, name: str, timeout: float = 60.0) -> None:
        store = self.root / f"nats-{name}"
        self._spawn(f"nats-{name}", self.net.hosts[name].command([nats_server_binary(), "-c", str(store / "nats.conf")]))
        self._wait_jetstream(name, timeout)

    def _wait_jetstream(self, name: str, timeout: float) -> None:
        url = f"http://{self.net.hosts[name].ip}:{MONITOR_PORT}/healthz"
        self._poll(lambda: _http_ok(url), f"nats-{name}: JetStream not healthy", timeout)

    # ---- talaria -----------------------------------------------------------------------

    def _env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TALARIA_")}
        ip = self.net.hosts[name].ip
        env.update({"TALARIA_NATS_URL": self.nats_urls(name), "TALARIA_NATS_REPLICAS": str(len(self.host_names)),
                    "TALARIA_HTTP_HOST": ip, "TALARIA_DATA_DIR": str(self.root / name), "PYTHONUNBUFFERED": "1"})
        return env

    def _talaria(self, argv: list[str]) -> None:
        subprocess.run([sys.executable, "-m", "talaria.cli", *argv], check=True, capture_output=True,
                       env={k: v for k, v in os.environ.items() if not k.startswith("TALARIA_")})

    def _up(self, name: str, argv: list[str], creds: Path) -> None:
        cmd = [sys.executable, "-m", "talaria.cli", "up", "--nats-credentials", str(creds),
               "--data-dir", str(self.root / name), *argv]
        self._spawn(f"up-{name}", self.net.hosts[name].command(cmd), env=self._env(name))

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = self.root / f"{name}.out"
        self.logs[name] = log
        with open(log, "ab") as out:
            self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                env=env, start_new_session=True)

    def _wait_log(self, name: str, text: str, timeout: float) -> None:
        def seen() -> bool:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}): {self.logs[name].read_text()[-2000:]}")
            return text in self.logs[name].read_text(errors="replace")
        self._poll(seen, f"{name}: no {text!r}", timeout)

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(f"{self.gateway_url}/healthz", timeout=2) as r:
                return json.load(r)
        except urllib.error.HTTPError as exc:
            return json.load(exc)

    def _wait_instances(self, want: set[str], timeout: float) -> None:
        self._poll(lambda: want <= set(self.health().get("instances", [])), f"instances {sorted(want)} not seen",
                   timeout)

    def executions(self) -> dict[str, int]:
        """call_id -> how many times an agent ran it to completion, from every agent host's logs."""
        return running.executions(log for name in self.agent_hosts for log in (self.root / name / "logs").glob("*.log*"))

    @staticmethod
    def _poll(done, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} after {timeout:.0f}s")
            time.sleep(0.2)  # polling other processes' state: there is no event to wait on

    def stop(self) -> None:
        for name, proc in reversed(list(self.procs.items())):  # talaria first, NATS last
            if name.startswith("up-") and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(list(self.procs.items())):
            if name.startswith("up-"):
                _wait_or_kill(proc, 30)
        for name, proc in self.procs.items():
            if name.startswith("nats-") and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                _wait_or_kill(proc, 10)
        if self.net is not None:
            self.net.destroy()


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False
