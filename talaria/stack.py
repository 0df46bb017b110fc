"""`talaria up`: start embedded servers (when no URLs are set), migrate, start every service.

Services run as child processes; the stack is ready when the gateway's /healthz sees
the router, telemetry and every agent. Once up, `supervise()` restarts whatever exits
(a service, or an embedded server on its old port) with exponential backoff, while the
rest keeps serving. Stopping sends SIGTERM to each service, waits, kills stragglers, then
stops the embedded servers: nothing is left behind. Processes a killed earlier run left on
the same data directory (listed in its stack.json) are stopped before starting.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from talaria.services.gateway.auth import KeyStore
from talaria.shared.api_keys import hash_key, new_key, write_key_file
from talaria.shared.db.connection import upgrade
from talaria.shared.nats_auth import generate_users
from talaria.roles import ROLES, HostPlan, credentials_env
from talaria.shared.settings import Settings, redact_url
from talaria.embedded import (
    EmbeddedNats,
    EmbeddedNatsCluster,
    EmbeddedPostgres,
    EmbeddedServerError,
    RouteTls,
    free_port,
    stop_stale,
)
from talaria.shared.bus import servers
from talaria.services.gateway.admission import default_min_free_bytes

# Restart backoff: the first restart after RESTART_MIN_S, doubling while a process keeps
# dying within STABLE_S of its start, at most RESTART_MAX_S apart.
RESTART_MIN_S = 0.2
RESTART_MAX_S = 15.0
STABLE_S = 30.0


@dataclass
class Child:
    """A supervised service process: how to start it again and its restart history."""

    module: str
    env: dict[str, str]  # what this service sets beyond the stack's common environment
    proc: subprocess.Popen
    started_at: float
    restarts: int = 0
    delay_s: float = 0.0
    restart_at: float | None = None  # set while it is down and waiting for its restart


def _unset_or(value: object) -> str:
    return "" if value is None else str(value)


class StackError(RuntimeError):
    pass


# nats-server's log when a write failed: it disables JetStream ("JetStream out of space, will be
# DISABLED"), or a stream's file store keeps failing with ENOSPC after space came back (seen
# for minutes in the disk-full-hard fault) until the server restarts.
BROKER_WRITE_FAILED = (b"will be DISABLED", b"no space left on device")
LOCK_FILE = "up.lock"
LOG_FILE_MAX_BYTES = 64 * 1024 * 1024  # ~160,000 calls at the ~0.4 KB of gateway log each (issue 25)


def lock_data_dir(data: Path):
    """One `talaria up` per data directory: an exclusive lock held for the run's life (the
    kernel drops it when the process dies, so a killed run never blocks the next). A second
    run fails at once, naming the first, instead of the two stopping each other's processes."""
    import fcntl

    f = open(data / LOCK_FILE, "a+", opener=lambda p, flags: os.open(p, flags, 0o600))
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise StackError(f"another `talaria up` (pid {holder}) is running on {data}; stop it first, "
                         "or give this one its own --data-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it holds credentials)."""
    with open(path, "w", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
        f.write(text)
    path.chmod(0o600)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _logged_ready(path: Path, offset: int) -> bool:
    """Has the service's log, past `offset`, a structured `... ready` event?"""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return any(b' ready"' in line or b' ready ' in line for line in f)
    except OSError:
        return False


def _server_key(server) -> str:
    """stack.json's name of an embedded server (a cluster member: EmbeddedNats:<its name>)."""
    name = type(server).__name__
    return f"{name}:{server.name}" if isinstance(server, EmbeddedNats) and server.cluster_port else name


def write_prometheus_config(path: Path, targets: dict[str, str]) -> None:
    """A Prometheus scrape config for this stack: one job, each service a target labelled
    `service` (`prometheus --config.file=<data_dir>/prometheus.yml`)."""
    from urllib.parse import urlsplit

    lines = ["# Written by `talaria up`: where each service serves GET /metrics.", "global:",
             "  scrape_interval: 5s", "scrape_configs:", "  - job_name: talaria", "    static_configs:"]
    for name, url in sorted(targets.items()):
        lines += [f"      - targets: ['{urlsplit(url).netloc}']", f"        labels: {{service: '{name}'}}"]
    path.write_text("\n".join(lines) + "\n")


def _reachable(what: str, url: str, timeout: float = 3.0) -> None:
    """Fail fast with a clear message instead of services retrying a dead address forever."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout=timeout):
            return
    except OSError as exc:
        raise StackError(f"cannot reach {what} at {url}: {exc}") from None


@dataclass
class Stack:
    settings: Settings
    agents: int = 2
    hot: tuple[str, ...] = ()  # one extra hot-pool agent pinned to each of these models
    nats_cluster: int = 1  # embedded NATS: this many JetStream servers, streams replicated on all (at most 5)
    routers: int = 1  # router replicas splitting the sessions (services/router/ownership.py)
    plan: HostPlan = HostPlan(frozenset(ROLES))  # what this host runs (talaria/roles.py)
    credentials: Path | None = None  # `talaria nats-config` output: each service's own NATS user
    agent_prefix: str = "agent"  # instance ids <prefix>-0, <prefix>-1, ...: unique across hosts
    route_tls: RouteTls | None = None  # the embedded cluster's routes over mutual TLS
    log_to_files: bool = True
    embedded: list = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    children: dict[str, Child] = field(default_factory=dict)
    log_files: list = field(default_factory=list)
    server_restart_at: dict[str, float] = field(default_factory=dict)
    nats_url: str = ""
    database_url: str = ""
    gateway_url: str = ""
    nats_users: dict = field(default_factory=dict)  # embedded NATS: one user per service
    api_key: str | None = None  # generated when no keys are configured (printed once, saved 0600)
    metrics: dict[str, str] = field(default_factory=dict)  # service -> its GET /metrics URL
    _lock: object = None  # the data directory's lock file, held while this run lives
    _log_offsets: dict = field(default_factory=dict)  # how far each server log has been read
    broker_disabled: bool = False  # the embedded NATS turned JetStream off and awaits a restart
    cluster: EmbeddedNatsCluster | None = None  # the embedded JetStream cluster (--nats-cluster > 1)

    def start(self, timeout: float = 120.0, progress=print) -> "Stack":
        data = self.settings.common.data_dir.resolve()
        # Others may traverse it (as root, the embedded Postgres runs as another user and must
        # reach its cluster inside), never list it; what is inside is 0600 / 0700.
        data.mkdir(mode=0o711, parents=True, exist_ok=True)
        self._lock = lock_data_dir(data)  # before anything: a second run must not touch the first's
        try:
            self._stop_leftovers(data, progress)
            if self.plan.api_keys:
                self._api_keys(data)  # before NATS: each tenant gets its own NATS API client user
            self._servers(data, progress)
            if self.plan.database:
                progress("applying migrations")
                try:
                    upgrade(self.database_url)
                except Exception as exc:
                    raise StackError(f"could not migrate the database at {redact_url(self.database_url)}: {exc}") from exc
            self._services(data, progress)
            self._wait_ready(timeout, progress)
        except BaseException:
            self.stop()
            raise
        self._write_description()
        return self

    def _write_description(self) -> None:
        path = self.settings.common.data_dir.resolve() / "stack.json"
        write_private(path, json.dumps(self.describe(), indent=2))  # holds credentials

    def _stop_leftovers(self, data: Path, progress) -> None:
        """A killed `talaria up` (SIGKILL, closed terminal before SIGHUP was handled) leaves its
        services running on this data directory: stop them, or they answer in our place."""
        try:
            pids = json.loads((data / "stack.json").read_text()).get("pids", {})
        except (OSError, ValueError):
            return
        for name, pid in pids.items():
            # A server's command line names its directory (as root, Postgres's may lie outside `data`,
            # behind the pgdata symlink: embedded._reachable); a cluster member's is `EmbeddedNats:<name>`.
            program = {"EmbeddedPostgres": str((data / "postgres" / "pgdata").resolve())}.get(
                name, str(data) if name.startswith("EmbeddedNats") else "talaria.services")
            if isinstance(pid, int) and stop_stale(pid, program):
                progress(f"stopped {name} (pid {pid}) left running by an earlier run")

    def _api_keys(self, data: Path) -> None:
        """No keys configured: generate one for this run; only its hash reaches the gateway."""
        if self.settings.gateway.api_keys or self.settings.gateway.api_keys_file:
            return
        self.api_key = new_key()
        write_key_file(data / "api_keys", [("default", hash_key(self.api_key))])
        write_private(data / "api_key", self.api_key + "\n")  # for scripts: `$(cat .talaria/api_key)`

    def tenants(self) -> list[str]:
        """The tenants of the configured API keys (`default` for the key generated for this run)."""
        if self.api_key is not None:
            return ["default"]
        return sorted(set(KeyStore.from_settings(self.settings.gateway).tenants.values()))

    @property
    def client_nats_urls(self) -> dict[str, str]:
        """tenant -> the NATS URL (with that tenant's user) a NATS API client connects with
        (`nats_auth.client_options(url)` adds the inbox prefix its user is fenced to)."""
        return {u.tenant or "": _with_user(self.nats_url, u) for u in self.nats_users.values() if u.role == "client"}

    @property
    def admin_nats_url(self) -> str:
        """The admin user's URL (`talaria drain`), or the plain URL on an external NATS."""
        admin = self.nats_users.get("admin")
        return _with_user(self.nats_url, admin) if admin is not None else self.nats_url

    @property
    def client_nats_url(self) -> str:
        """The NATS URL a NATS API client (e.g. `talaria replay`) connects with: the generated
        key's tenant, else the first tenant's; the plain URL on an external NATS."""
        urls = self.client_nats_urls
        if not urls:
            return self.nats_url
        return urls.get("default") or urls[sorted(urls)[0]]

    def describe(self) -> dict[str, object]:
        described = {"gateway": self.gateway_url, "nats": self.nats_url, "database": self.database_url,
                "nats_client": self.client_nats_url, "nats_clients": self.client_nats_urls, "api_key": self.api_key,
                "nats_admin": self.admin_nats_url,
                "data_dir": str(self.settings.common.data_dir.resolve()), "agents": self.agents,
                "traces": str(self.settings.common.traces_path.resolve()), "metrics": self.metrics,
                "roles": sorted(self.plan.roles),
                "prometheus_config": str(self.settings.common.data_dir.resolve() / "prometheus.yml"),
                "pids": {**{name: p.pid for name, p in self.procs.items()},
                         **{_server_key(s): s.proc.pid for s in self.embedded if s.proc is not None}}}
        if self.cluster is not None:  # where its members take routes (the route credentials stay in auth.conf)
            described["nats_cluster"] = {"name": self.cluster.name, "routes": self.cluster.routes}
        return described

    def _servers(self, data: Path, progress) -> None:
        if self.settings.common.nats_url:
            self.nats_url = self.settings.common.nats_url
            _reachable("NATS", servers(self.nats_url)[0])
        else:
            self.nats_users = generate_users(self._agent_ids(), self.tenants())
            if self.nats_cluster > 1:
                self._nats_cluster(data, progress)
            else:
                progress("starting embedded NATS (JetStream) with per-service users")
                nats = EmbeddedNats(data / "nats", users=self.nats_users, prefix=self.settings.common.deployment.name)
                self.embedded.append(nats)  # before start(): stop() must reach a half-started server
                self.nats_url = nats.start().url
                if nats.stale:
                    progress(f"stopped a NATS server (pid {nats.stale}) left running by an earlier run")
        if self.settings.common.database_url:
            self.database_url = self.settings.common.database_url
        elif self.plan.database:
            progress("starting embedded PostgreSQL")
            pg = EmbeddedPostgres(data / "postgres")
            self.embedded.append(pg)
            self.database_url = pg.start().url
            if pg.stale:
                progress(f"stopped a PostgreSQL server (pid {pg.stale}) left running by an earlier run")

    def _nats_cluster(self, data: Path, progress) -> None:
        """A JetStream cluster of `nats_cluster` members; every stream gets that many replicas
        (TALARIA_NATS_REPLICAS), so a majority keeps it: 3 members survive one's loss."""
        if not 1 < self.nats_cluster <= 5:
            raise StackError(f"--nats-cluster {self.nats_cluster}: 1 to 5 servers (JetStream replicates at most 5x)")
        progress(f"starting an embedded {self.nats_cluster}-node NATS JetStream cluster with per-service users")
        cluster = EmbeddedNatsCluster(data / "nats-cluster", self.nats_cluster, users=self.nats_users,
                                      prefix=self.settings.common.deployment.name, route_tls=self.route_tls)
        self.cluster = cluster
        try:
            cluster.start()
        finally:  # each member supervised (restarted on its ports) like a single server
            self.embedded.extend(cluster.nodes)
        self.nats_url = cluster.url

    def _agent_ids(self) -> list[str]:
        return [f"{self.agent_prefix}-{i}" for i in range(self.agents)] + [f"hot-{m}" for m in self.hot]

    def _env(self, **extra: str) -> dict[str, str]:
        s = self.settings
        env = dict(os.environ)
        env.update({
            "TALARIA_NATS_URL": self.nats_url, "TALARIA_DATABASE_URL": self.database_url,
            "TALARIA_DATA_DIR": str(s.common.data_dir.resolve()), "TALARIA_TRACES_DIR": str(s.common.traces_path.resolve()),
            # the named configuration (services/configs.py), the same for every service; "": unset
            "TALARIA_CONFIG": s.common.config or s.router.policy, "TALARIA_CONFIG_SET": ",".join(s.common.config_set),
            "TALARIA_POLICY": s.router.policy, "TALARIA_LEASE_TIMEOUT_S": _unset_or(s.router.lease_timeout_s),
            "TALARIA_ADAPTIVE_LEASE": _unset_or(s.router.adaptive_lease), "TALARIA_ABLATION": s.agent.ablation,
            "TALARIA_MODELS": s.common.models_env(), "TALARIA_DEVICE": s.agent.device,
            "TALARIA_HTTP_HOST": s.gateway.http_host, "TALARIA_SESSION_IDLE_S": str(s.telemetry.session_idle_s),
            "TALARIA_NATS_REPLICAS": str(self.nats_cluster if not s.common.nats_url else s.common.nats_replicas),
            "TALARIA_LOG_LEVEL": s.common.log_level, "TALARIA_METRICS_HOST": s.common.metrics_host, "TALARIA_DEPLOYMENT": s.common.deployment.name, "PYTHONUNBUFFERED": "1",
        })
        if self.api_key is not None:
            env["TALARIA_API_KEYS_FILE"] = str((s.common.data_dir / "api_keys").resolve())
        env.update(extra)
        return env

    def _spawn(self, name: str, module: str, data: Path, **env: str) -> None:
        extra = {}
        if name not in self.metrics:  # a port for the service's life: a restart comes back on it
            self.metrics[name] = f"http://{self.settings.common.metrics_host}:{free_port()}/metrics"
        extra["TALARIA_METRICS_PORT"] = self.metrics[name].rsplit(":", 1)[1].split("/")[0]
        logs = data / "logs"
        logs.mkdir(mode=0o700, exist_ok=True)  # logs name every tenant's calls: owner-only
        logs.chmod(0o700)
        out = open(logs / f"{name}.log", "ab", opener=lambda p, flags: os.open(p, flags, 0o600)) \
            if self.log_to_files else None
        if out is not None:
            self.log_files.append(out)
        # A session of its own: Ctrl-C reaches only `talaria up`, which then stops the
        # services first and the servers they write to last, in that order.
        role = "router" if name.startswith("router") else name  # every router replica is the router user
        key = role if role in ("gateway", "router", "telemetry") else f"agent-{name}"
        user = self.nats_users.get(key)
        if user is not None:  # embedded NATS: this service's own user (its permissions)
            env = {**user.env(), **env}
        elif self.credentials is not None:  # an operator's NATS: the user `talaria nats-config` wrote
            env = {**credentials_env(self.credentials, key), **env}
        proc = subprocess.Popen(
            [sys.executable, "-m", module], env=self._env(**extra, **env), stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True,
        )
        self.procs[name] = proc
        old = self.children.get(name)
        if old is None:
            self.children[name] = Child(module, dict(env), proc, time.monotonic())
        else:
            old.proc, old.started_at, old.restart_at = proc, time.monotonic(), None

    def _services(self, data: Path, progress) -> None:
        port = self.settings.gateway.http_port or free_port()
        self.gateway_url = f"http://{self.settings.gateway.http_host}:{port}"
        progress(f"starting {self.routers} router(s), telemetry, gateway and {self.agents} instance agent(s)")
        roles = self.plan.roles
        if "control" in roles:
            self._spawn("telemetry", "talaria.services.telemetry", data)
        for i in range(self.routers if "control" in roles else 0):  # a stable id: a restart adopts its claims
            self._spawn(f"router-{i}", "talaria.services.router", data, TALARIA_ROUTER_ID=f"router-{i}")
        for agent_id in self._agent_ids()[:self.agents]:
            self._spawn(agent_id, "talaria.services.instance_agent", data, TALARIA_INSTANCE_ID=agent_id,
                        TALARIA_POOL=self.settings.agent.pool)
        for model in self.hot:
            self._spawn(f"hot-{model}", "talaria.services.instance_agent", data, TALARIA_INSTANCE_ID=f"hot-{model}",
                        TALARIA_POOL="hot", TALARIA_MODELS=model)
        if "gateway" in roles:
            self._spawn("gateway", "talaria.services.gateway", data, TALARIA_HTTP_PORT=str(port))
        else:
            self.gateway_url = ""
        write_prometheus_config(data / "prometheus.yml", self.metrics)

    def _wait_ready(self, timeout: float, progress) -> None:
        if "gateway" not in self.plan.roles:
            return self._wait_logged_ready(timeout, progress)
        deadline = time.monotonic() + timeout
        want_agents = set(self._agent_ids())
        last = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise StackError(f"{name} exited with code {proc.returncode}; see "
                                     f"{self.settings.common.data_dir / 'logs' / (name + '.log')}")
            try:
                try:
                    with urllib.request.urlopen(self.gateway_url + "/healthz", timeout=1) as r:
                        health = json.load(r)
                except urllib.error.HTTPError as exc:  # 503 until ready: its body still says who is up
                    health = json.load(exc)
                ok = {"router", "telemetry"} <= set(health["services"]) and want_agents <= set(health["instances"])
                if ok:
                    return
                state = (tuple(health["services"]), tuple(health["instances"]))
                if state != last:
                    progress(f"waiting: services {list(state[0])}, instances {list(state[1])}")
                    last = state
            except (OSError, ValueError):  # not up yet, or a body that is not JSON
                pass
            time.sleep(0.2)  # polling an external readiness condition, not synchronising tests
        raise StackError(f"stack not ready after {timeout:.0f}s")

    def _wait_logged_ready(self, timeout: float, progress) -> None:
        """A host without the gateway has no /healthz to ask: each service it started says it
        is ready in its own log (its `... ready` line, after it connected and subscribed)."""
        logs = self.settings.common.data_dir.resolve() / "logs"
        offsets = {name: _size(logs / f"{name}.log") for name in self.procs}
        pending = set(self.procs)
        deadline = time.monotonic() + timeout
        while pending:
            for name in sorted(pending):
                proc = self.procs[name]
                if proc.poll() is not None:
                    raise StackError(f"{name} exited with code {proc.returncode}; see {logs / (name + '.log')}")
                if _logged_ready(logs / f"{name}.log", offsets[name]):
                    pending.discard(name)
                    progress(f"{name} ready")
            if time.monotonic() > deadline:
                raise StackError(f"not ready after {timeout:.0f}s: {', '.join(sorted(pending))}")
            time.sleep(0.2)  # polling another process's log: there is no event to wait on

    # ---- supervision -------------------------------------------------------------------

    def supervise(self, progress=print, now: float | None = None) -> None:
        """One supervision pass (call it every few hundred ms): schedule a restart for each
        process that exited, and start those whose backoff has passed."""
        now = time.monotonic() if now is None else now
        data = self.settings.common.data_dir.resolve()
        changed = self._supervise_servers(now, progress)
        for name, child in self.children.items():
            code = child.proc.poll()
            if code is None:
                continue
            if child.restart_at is None:
                ran = now - child.started_at
                child.delay_s = RESTART_MIN_S if ran >= STABLE_S or not child.delay_s \
                    else min(RESTART_MAX_S, 2 * child.delay_s)
                child.restart_at = now + child.delay_s
                progress(f"{name} exited with code {code} after {ran:.1f}s; restarting in {child.delay_s:.1f}s "
                         f"(see {data / 'logs' / (name + '.log')})")
            elif now >= child.restart_at:
                child.restarts += 1
                self._spawn(name, child.module, data, **child.env)
                progress(f"{name} restarted (restart #{child.restarts}, pid {child.proc.pid})")
                changed = True
        if changed:
            self._write_description()
        self._rotate_logs(data)

    def _rotate_logs(self, data: Path) -> None:
        """A service log past LOG_FILE_MAX_BYTES is copied to `<name>.log.1` and truncated
        (logrotate's copytruncate: the service appends to the same open file), so logs take at
        most twice that per service."""
        for path in (data / "logs").glob("*.log"):
            try:
                if path.stat().st_size >= LOG_FILE_MAX_BYTES:
                    shutil.copyfile(path, path.with_name(path.name + ".1"))
                    os.truncate(path, 0)
            except OSError:  # e.g. the disk is full: the copy fails, the log is kept
                continue

    def _broker_disabled(self, server) -> bool:
        """Has the embedded NATS failed to write (a full disk)? It stays broken, alive and
        answering core NATS, until restarted (issue 25: every call 503 `bus_unavailable` for
        minutes after space came back). Read from its log, new lines only."""
        log = server.data_dir / "nats.log"
        try:
            with open(log, "rb") as f:
                f.seek(self._log_offsets.get(log, 0))
                new = f.read()
                self._log_offsets[log] = f.tell()
        except OSError:
            return False
        return any(marker in new for marker in BROKER_WRITE_FAILED)

    def _restart_disabled_broker(self, server, progress) -> bool:
        """Restart a NATS whose JetStream is off once the disk has room again (else it would
        disable itself again at once)."""
        if self._broker_disabled(server):
            self.broker_disabled = True
            progress("embedded nats: JetStream failed to write (disk full?); it is restarted once the disk "
                     "has room")
        if not self.broker_disabled:
            return False
        data = self.settings.common.data_dir.resolve()
        if shutil.disk_usage(data).free < default_min_free_bytes(data):
            return False
        server.stop()
        server.start()
        self.broker_disabled = False
        progress(f"embedded nats restarted on port {server.port} (JetStream back on)")
        return True

    def _supervise_servers(self, now: float, progress) -> bool:
        """An embedded server that died comes back on its old port and data (services reconnect)."""
        changed = False
        for server in self.embedded:
            if isinstance(server, EmbeddedNats) and server.proc is not None and server.proc.poll() is None:
                changed |= self._restart_disabled_broker(server, progress)
            name = server.name if isinstance(server, EmbeddedNats) else type(server).__name__.removeprefix("Embedded").lower()
            if server.proc is None or server.proc.poll() is None:
                continue
            due = self.server_restart_at.get(name)
            if due is None:
                self.server_restart_at[name] = now + RESTART_MIN_S
                progress(f"embedded {name} exited with code {server.proc.returncode}; restarting it")
            elif now >= due:
                try:
                    server.start()
                    progress(f"embedded {name} restarted on port {server.port}")
                    del self.server_restart_at[name]
                    changed = True
                except EmbeddedServerError as exc:
                    self.server_restart_at[name] = now + RESTART_MAX_S
                    progress(f"embedded {name} did not restart: {exc}; trying again in {RESTART_MAX_S:.0f}s")
        return changed

    def stop(self, grace_s: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for server in reversed(self.embedded):
            server.stop()
        self.embedded.clear()
        for f in self.log_files:
            f.close()
        self.log_files.clear()
        if self._lock is not None:
            self._lock.close()  # releases the data directory's lock
            self._lock = None


def _with_user(url: str, u) -> str:
    """`url` (each member of a cluster) with NATS user `u`'s credentials."""
    return ",".join(f"{scheme}://{u.name}:{u.password}@{rest}"
                    for scheme, _, rest in (s.partition("://") for s in servers(url)))
