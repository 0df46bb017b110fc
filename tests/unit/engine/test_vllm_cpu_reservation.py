"""vLLM's CPU build keeps one more core off its worker whenever a KV connector is configured;
the vllm engine starts vLLM with the usual reservation when its connector is on a CPU
(bench/vllm_writethrough.py measured the extra one costing 2.5-4x in prefill on 2 cores), and
leaves a user's own setting and every other case alone. Pure: runs without vLLM."""

import os

import pytest

from talaria.services.instance_agent.engine.vllm_engine import _reserved_cpus

VAR = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def test_vllm_connector_on_cpu_starts_with_one_reserved_core(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    with _reserved_cpus("cpu", connector=True):
        assert os.environ[VAR] == "1"  # what the engine processes spawned here inherit
    assert VAR not in os.environ  # and nothing is left behind


@pytest.mark.parametrize("device, connector", [("cpu", False), ("cuda", True)])
def test_vllm_reservation_untouched_without_a_connector_or_on_a_gpu(monkeypatch, device, connector):
    monkeypatch.delenv(VAR, raising=False)
    with _reserved_cpus(device, connector):
        assert VAR not in os.environ


def test_vllm_reservation_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(VAR, "0")
    with _reserved_cpus("cpu", connector=True):
        assert os.environ[VAR] == "0"
    assert os.environ[VAR] == "0"
