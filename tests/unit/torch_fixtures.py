"""Torch engine fixtures shared by the engine and memory-substrate tests (one data dir
with the catalogue's weights, small engines closed after each test)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

MODELS = ["qwen3-tiny", "qwen3-moe-tiny", "gpt2-tiny"]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-data")


@pytest.fixture
def make_engine(data_dir):
    from talaria.services.instance_agent.engine import TorchEngine

    made = []

    def make(models=None, **kw):
        kw.setdefault("kv_pages", 96)
        kw.setdefault("host_kv_pages", 512)
        eng = TorchEngine(data_dir, models or MODELS, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()
