"""`talaria up` supervision: a process that exits is restarted with backoff while the rest
keeps running; leftovers of a killed earlier run on the same data directory are stopped;
an embedded server's error is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from talaria.embedded import EmbeddedPostgres, EmbeddedServerError, process_alive
from talaria.shared.settings import Settings
from talaria.stack import RESTART_MIN_S, Stack


@pytest.fixture
def stack(tmp_path):
    s = Stack(Settings.from_env().with_(data_dir=tmp_path), log_to_files=True)
    yield s
    s.stop(grace_s=2)


def test_an_exited_service_is_restarted_with_growing_backoff_and_the_others_keep_running(stack, tmp_path):
    data = tmp_path.resolve()
    stack._spawn("quick", "this", data, TALARIA_EXTRA="kept")  # `python -m this` prints and exits
    stack._spawn("steady", "http.server", data)  # keeps running
    messages: list[str] = []
    first = stack.procs["quick"]
    first.wait(10)
    t = time.monotonic()
    stack.supervise(messages.append, now=t)
    assert "quick exited with code 0" in messages[-1] and f"restarting in {RESTART_MIN_S:.1f}s" in messages[-1]
    stack.supervise(messages.append, now=t + RESTART_MIN_S / 2)
    assert stack.procs["quick"] is first  # still backing off
    stack.supervise(messages.append, now=t + RESTART_MIN_S * 1.01)
    second = stack.procs["quick"]
    assert second is not first and "restarted (restart #1" in messages[-1]
    assert stack.children["quick"].env == {"TALARIA_EXTRA": "kept"}  # same service, same settings
    second.wait(10)
    stack.supervise(messages.append, now=time.monotonic())
    assert f"restarting in {2 * RESTART_MIN_S:.1f}s" in messages[-1]  # died quickly again: doubled
    assert stack.procs["steady"].poll() is None  # untouched throughout
    assert json.loads((data / "stack.json").read_text())["pids"]["quick"] == second.pid


def test_leftover_services_of_a_killed_run_are_stopped_before_starting(stack, tmp_path):
    data = tmp_path.resolve()
    # Each says when it runs: Popen can return while the child is still inside execve, before
    # /proc/<pid>/cmdline names the new program, and a process not yet ours by its command line
    # is (rightly) never signalled. That race made this test fail now and then (issue 25 item 8).
    started = "import sys, time; print('up', flush=True); time.sleep(120)"
    orphan = subprocess.Popen([sys.executable, "-c", started, "talaria.services.router"], stdout=subprocess.PIPE)
    unrelated = subprocess.Popen([sys.executable, "-c", started], stdout=subprocess.PIPE)
    try:
        for p in (orphan, unrelated):
            assert p.stdout.readline() == b"up\n"
        (data / "stack.json").write_text(json.dumps({"pids": {"router": orphan.pid, "gateway": unrelated.pid}}))
        messages: list[str] = []
        stack._stop_leftovers(data, messages.append)
        assert orphan.wait(10) is not None
        assert messages == [f"stopped router (pid {orphan.pid}) left running by an earlier run"]
        assert unrelated.poll() is None  # a pid that is not one of ours is never signalled
    finally:
        for p in (orphan, unrelated):
            p.kill()
            p.wait()
            p.stdout.close()


@pytest.mark.integration
def test_a_postgres_left_running_on_the_data_dir_is_stopped_and_replaced(tmp_path):
    first = EmbeddedPostgres(tmp_path / "pg").start()
    second = EmbeddedPostgres(tmp_path / "pg")
    try:
        second.start()  # before: "lock file postmaster.pid already exists" and the whole log
        assert second.stale == first.proc.pid
        assert first.proc.wait(60) is not None  # a loaded machine can take a while to stop it
        # (as root under a 0700 temp dir the cluster lives outside it: its path is the symlink's)
        assert process_alive(second.proc.pid, str((tmp_path / "pg" / "pgdata").resolve()))
    finally:
        second.stop()
        first.stop()
        if (tmp_path / "pg" / "pgdata").is_symlink():
            import shutil

            shutil.rmtree((tmp_path / "pg" / "pgdata").resolve(), ignore_errors=True)


def test_embedded_server_errors_are_one_line_naming_the_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("noise\n" * 50 + 'FATAL:  lock file "postmaster.pid" already exists\nmore noise\n')
    message = str(EmbeddedServerError("postgres", "exited with code 1", log))
    assert "\n" not in message
    assert 'FATAL:  lock file "postmaster.pid" already exists' in message and str(log) in message


def test_one_talaria_up_per_data_directory(tmp_path):
    """Issue 25: two runs on one data directory stopped each other's processes until one died."""
    from talaria.stack import StackError, lock_data_dir

    first = lock_data_dir(tmp_path)
    try:
        with pytest.raises(StackError, match=rf"another `talaria up` \(pid {os.getpid()}\) is running on"):
            lock_data_dir(tmp_path)
    finally:
        first.close()  # the run ended (or was killed: the kernel drops the lock with it)
    lock_data_dir(tmp_path).close()
    assert (tmp_path / "up.lock").stat().st_mode & 0o077 == 0


def test_logs_and_traces_are_private_and_bounded(stack, tmp_path):
    from talaria.shared.tracing import JsonLinesExporter

    data = tmp_path.resolve()
    stack._spawn("quick", "this", data)
    stack.procs["quick"].wait(10)
    assert (data / "logs").stat().st_mode & 0o777 == 0o700
    assert (data / "logs" / "quick.log").stat().st_mode & 0o777 == 0o600
    exporter = JsonLinesExporter(data / "traces" / "spans.jsonl", max_bytes=100)
    for _ in range(3):
        exporter._path.write_text("x" * 150) if not exporter._path.exists() else None
        exporter.export([])
    assert (data / "traces").stat().st_mode & 0o777 == 0o700
    assert exporter._path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in (data / "traces").iterdir()) == ["spans.jsonl", "spans.jsonl.1"]
    assert exporter._path.stat().st_size < 100  # rotated, not grown


@pytest.mark.integration
def test_a_broker_that_turned_jetstream_off_is_restarted_once_the_disk_has_room(stack, tmp_path):
    """Issue 25: after a full disk nats-server disables JetStream and stays up without it; the
    supervisor notices (its log says so) and restarts it, which turns JetStream back on."""
    from talaria.embedded import EmbeddedNats

    server = EmbeddedNats(tmp_path.resolve() / "nats").start()
    stack.embedded.append(server)
    first = server.proc.pid
    messages: list[str] = []
    stack.supervise(messages.append)
    assert server.proc.pid == first and not messages  # a healthy broker is left alone
    with open(server.data_dir / "nats.log", "ab") as log:  # what nats-server writes on a failed write
        log.write(b"[1] [ERR] JetStream out of space, will be DISABLED\n")
    stack.supervise(messages.append)
    assert server.proc.pid != first and "JetStream failed to write" in messages[0], messages
    assert "restarted" in messages[-1]
    second, messages = server.proc.pid, []
    with open(server.data_dir / "nats.log", "ab") as log:  # a stream's store stuck on ENOSPC
        log.write(b"[1] [ERR] JetStream failed to store a msg on stream: write x.blk: no space left on device\n")
    stack.supervise(messages.append)
    assert server.proc.pid != second and "restarted" in messages[-1]
