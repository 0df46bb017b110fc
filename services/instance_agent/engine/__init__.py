"""The `torch` engine: small real models in plain torch with paged KV, prefix reuse,
host KV restore and staged model switches.

    contract.py   Engine (the Protocol the agent drives), its declared Capabilities, and the
                  records it takes and gives: Sequence, StepToken, SwitchRecord, EngineStats
    engine_registry.py  engines by name (TALARIA_ENGINE, default torch)
    engine_errors.py    error hierarchy (fields, no asserts on user input)
    weights.py    deterministic init, safetensors files, flat weight layouts
    model_store.py  the served models' specs, layouts and host images
    device_model.py the active model on the device (what a switch publishes), measured rates
    model.py      functional forward for dense / moe / gpt2 over paged KV (+ reference)
    kv_cache.py   page pool (cache refs vs use refs), prefix index, session entries
    sampling.py   greedy / temperature + top-p, stop strings; a call's SamplingParams
    sequence.py   Sequence: one call from request to result (the caller's request, the
                  engine's running state, the result)
    admission.py  KvAdmission: validate, match reusable KV, reserve pages
    forward_pass.py  ForwardPass: batched (chunked) prefill and decode forwards over paged KV
    switch.py     ModelSwitcher: the five-phase model switch
    engine_report.py  where sessions' KV is, EngineStats
    torch_engine.py  TorchEngine, the parts composed; what the instance agent calls (one worker thread)
"""

from talaria.services.instance_agent.engine.contract import EngineStats, SwitchRecord
from talaria.services.instance_agent.engine.sampling import SamplingParams
from talaria.services.instance_agent.engine.sequence import Sequence, StepToken
from talaria.services.instance_agent.engine.torch_engine import TorchEngine
from talaria.services.instance_agent.engine.engine_errors import (
    ContextTooLong, EngineBusy, EngineError, InvalidRequest, ModelNotActive, OutOfKvPages,
    UnknownCall, UnknownModel, WeightsCorrupt,
)

__all__ = [
    "ContextTooLong", "EngineBusy", "EngineError", "EngineStats", "InvalidRequest", "ModelNotActive",
    "OutOfKvPages", "SamplingParams", "Sequence", "StepToken", "SwitchRecord", "TorchEngine",
    "UnknownCall", "UnknownModel", "WeightsCorrupt",
]
