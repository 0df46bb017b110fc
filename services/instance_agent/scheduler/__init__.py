"""Round scheduler with session-prefill (SP) for one instance (paper §3.2, §3.4, Eq. 3-5).

A cold-pool instance time-shares models in rounds: one slot per active model per round, switching
only between slots. A slot is P -> D1 -> (SP -> D)* -> Dfin: P admits the work waiting when it
opens; at a later decode boundary SP may admit a bounded batch of returning calls (the active
model's continuations with device or host-restorable KV); Dfin drains the protected decode budget
and, with `drain_on_switch` (default: the torch engine refuses to switch with calls running), the
slot's calls. A hot-pool instance pins one model and batches continuously. Pure: it takes `now` and
returns actions and events, so the agent, the simulator and the tests drive one object
(`RoundScheduler`, scheduler.py). It counts tokens and finishes a call at `max_tokens` (`eos` ends
one earlier); each `CallFinished` is the cue for `engine.finish`; it calibrates from the gap between
`estimate_s(action)` and the reported completion time. Modules: types, config, scheduler_errors,
costs (EWMA calibration), budget (Eq. 3-5), admission, calls (`AgentCall`, the call table), rounds,
reports, work_costs, chunked_prefill, rotation, cold_pool, hot_pool.
"""

from talaria.services.instance_agent.scheduler.calls import AgentCall
from talaria.services.instance_agent.scheduler.budget import ModelLoad, SlotPlan, plan_slot
from talaria.services.instance_agent.scheduler.config import ABLATIONS, SchedulerConfig
from talaria.services.instance_agent.scheduler.costs import CalibratedCosts, StepCostModel, LinearCosts
from talaria.services.instance_agent.scheduler.scheduler_errors import (
    ActionMismatchError,
    ConfigError,
    DuplicateCallError,
    InvalidWorkError,
    SchedulerBusyError,
    SchedulerError,
    UnknownCallError,
    ModelNotServedError,
)
from talaria.services.instance_agent.scheduler.scheduler import RoundScheduler
from talaria.services.instance_agent.scheduler.types import (
    Action,
    CallAdmitted,
    CallFinished,
    CallParked,
    DeadlineRisk,
    Decode,
    Idle,
    KvState,
    Prefill,
    RoundEnded,
    SchedulerEvent,
    SchedulerView,
    SlotOpened,
    SwitchModel,
)

__all__ = [
    "ABLATIONS",
    "Action",
    "ActionMismatchError",
    "AgentCall",
    "CalibratedCosts",
    "CallAdmitted",
    "CallFinished",
    "CallParked",
    "ConfigError",
    "StepCostModel",
    "DeadlineRisk",
    "Decode",
    "DuplicateCallError",
    "Idle",
    "InvalidWorkError",
    "KvState",
    "LinearCosts",
    "ModelLoad",
    "Prefill",
    "RoundEnded",
    "RoundScheduler",
    "SchedulerBusyError",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerEvent",
    "SchedulerView",
    "SlotOpened",
    "SlotPlan",
    "SwitchModel",
    "UnknownCallError",
    "ModelNotServedError",
    "plan_slot",
]
