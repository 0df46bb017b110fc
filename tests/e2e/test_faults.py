"""The short fault-injection run (bench/faults.py has the full one): a real `talaria up`,
12 concurrent sessions over three models, one agent SIGKILLed mid-load. Its in-flight calls
are failed with a retryable 503 by heartbeat loss (never the 30 s call timeout), the client
retries, the supervisor restarts the agent; nothing is lost, nothing runs twice, and the
rows in Postgres agree with what the clients were told."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("faults_bench", ROOT / "bench" / "faults.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_killing_an_agent_mid_load_loses_nothing_and_runs_nothing_twice(tmp_path):
    bench = load_bench()
    [result] = bench.run(["kill-agent"], sessions=12, calls=6, data_dir=tmp_path)
    assert result["ok"] == 72, result
    assert result["inflight_wait_s"] > 0, "the fault must hit while calls are in flight"
    assert (result["lost"], result["twice"], result["rows_wrong"]) == (0, 0, 0), result
    # in-flight calls on the dead agent were answered by heartbeat loss, far below the call timeout
    assert result["inflight_wait_s"] < bench.CALL_TIMEOUT_S / 2, result
    assert set(result["error_kinds"]) <= {"instance_lost", "no_capacity", "not_served"}, result


@pytest.mark.faults
def test_a_router_hung_under_load_runs_no_call_twice(tmp_path):
    """`--routers 2`; one router SIGSTOPped past its ownership TTL, three times, under load:
    its partitions are taken over meanwhile, and when it resumes nothing it decided or still
    held runs again (executions counted from the agents' `call completed` log lines)."""
    bench = load_bench()
    [result] = bench.run(["stop-router"], sessions=10, calls=60, data_dir=tmp_path)
    assert result["executions"] >= result["ok"] > 0, result
    assert (result["lost"], result["ran_twice"], result["twice"], result["rows_wrong"]) == (0, 0, 0, 0), result
    assert result["ok"] == 600, result
