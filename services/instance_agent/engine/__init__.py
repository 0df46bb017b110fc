"""The `torch` engine: small real models in plain torch with paged KV, prefix reuse,
host KV restore and staged model switches; `TorchEngine` (torch_engine.py) composes the parts
and is what the instance agent calls, on one worker thread. The other engines (vllm_engine.py,
sglang_engine.py) share its contract (contract.py) and are chosen by name (engine_registry.py).
"""

# Where each part lives: contract (the Engine Protocol, Capabilities, Sequence/StepToken/SwitchRecord/
# EngineStats records), engine_registry (engines by name, TALARIA_ENGINE), engine_errors, weights
# (deterministic init, safetensors, flat layouts), model_store (specs, layouts, host images),
# device_model (the active model on the device, measured rates), model (forward for dense / moe /
# gpt2 over paged KV), kv_cache (page pool, prefix index, session entries), sampling, sequence (one
# call from request to result), admission (KvAdmission: validate, match reusable KV, reserve pages),
# forward_pass (batched chunked prefill and decode), switch (the five-phase ModelSwitcher),
# engine_report (where sessions' KV is, EngineStats), torch_engine (TorchEngine).
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
