"""The `torch` engine: small real models in plain torch with paged KV, prefix reuse,
host KV restore and staged model switches.

    contract.py   Engine (the Protocol the agent drives), its declared Capabilities, and the
                  records it takes and gives: GenRequest, StepToken, GenResult, SwitchRecord, EngineStats
    registry.py   engines by name (TALARIA_ENGINE, default torch)
    errors.py     error hierarchy (fields, no asserts on user input)
    weights.py    deterministic init, safetensors files, flat weight layouts
    model.py      functional forward for dense / moe / gpt2 over paged KV (+ reference)
    kv_cache.py   page pool (cache refs vs use refs), prefix index, session entries
    sampling.py   greedy / temperature + top-p, stop strings
    sequence.py   per-call running state
    switch.py     the five-phase model switch
    torch_engine.py  TorchEngine, the facade the instance agent calls (one worker thread)
"""

from talaria.services.instance_agent.engine.contract import (
    EngineStats, GenRequest, GenResult, StepToken, SwitchRecord,
)
from talaria.services.instance_agent.engine.torch_engine import TorchEngine
from talaria.services.instance_agent.engine.errors import (
    ContextTooLong, EngineBusy, EngineError, InvalidRequest, ModelNotActive, OutOfKvPages,
    UnknownCall, UnknownModel, WeightsCorrupt,
)

__all__ = [
    "ContextTooLong", "EngineBusy", "EngineError", "EngineStats", "GenRequest", "GenResult",
    "InvalidRequest", "ModelNotActive", "OutOfKvPages", "StepToken", "SwitchRecord", "TorchEngine",
    "UnknownCall", "UnknownModel", "WeightsCorrupt",
]
