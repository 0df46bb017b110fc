"""No process outlives the service that started it: a SIGKILLed gateway's body-parser worker
and the multiprocessing resource tracker exit with it (they would move to PID 1 and outlive
even a clean stop of the stack)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil
import pytest

from talaria.embedded import free_port
from tests.e2e.test_stack import Stack

pytestmark = pytest.mark.e2e


def test_a_sigkilled_gateways_worker_and_resource_tracker_exit_with_it(tmp_path):
    data_dir = tmp_path / "data"
    stack = Stack(data_dir, free_port(), agents=1)
    try:
        stack.wait_for(r"ready in", timeout=120)
        gateway = json.loads((data_dir / "stack.json").read_text())["pids"]["gateway"]
        children = psutil.Process(gateway).children(recursive=True)
        commands = [" ".join(c.cmdline()) for c in children]
        assert any("resource_tracker" in c for c in commands), commands
        assert any("spawn_main" in c and "resource_tracker" not in c for c in commands), commands
        os.kill(gateway, signal.SIGKILL)
        _, alive = psutil.wait_procs(children, timeout=15)
        assert alive == [], f"outlived the gateway: {[(p.pid, ' '.join(p.cmdline())) for p in alive]}"
        stack.wait_for(r"gateway restarted", timeout=30)  # the supervisor brings it back, with a new worker
    finally:
        if stack.proc.poll() is None:
            stack.proc.send_signal(signal.SIGINT)
            try:
                stack.proc.wait(60)
            except subprocess.TimeoutExpired:
                stack.proc.kill()
