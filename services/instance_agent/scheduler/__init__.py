"""Round scheduler with session-prefill (SP) for one instance (paper §3.2, §3.4, Eq. 3-5).

A cold-pool instance time-shares models in rounds of slots, P -> D1 -> (SP -> D)* -> Dfin (cold_pool.py;
SP admits the active model's returning calls at a decode boundary); a hot-pool one pins one model.
Pure: the agent, the simulator and the tests drive it alike (`submit`/`abort` may come at any time):

    sched = RoundScheduler(SchedulerConfig(), ["qwen", "glm"], costs)
    sched.submit(AgentCall("c1", "s1", "qwen", prompt_tokens=900, max_tokens=64), now=clock())
    while serving:
        match sched.next_action(clock()):
            case SwitchModel() as a: took = run_switch(a); events = sched.on_switch_done(a, clock(), took)
            case Prefill() as a: eos = run_prefill(a); events = sched.on_prefill_done(a, clock(), eos)
            case Decode() as a: eos = run_decode(a); events = sched.on_decode_done(a, clock(), eos)
            case Idle(): events = sched.drain_events(); wait_for_submit()
        publish(events)        # CallAdmitted / CallFinished (the cue for engine.finish) / RoundEnded ...
"""

# Where each part lives: types (actions, events, SchedulerView, errors), config (SchedulerConfig),
# costs (StepCostModel, EWMA calibration from each action's estimate_s against its reported time),
# budget (Eq. 3-5), admission (batches under batch, KV and time budgets), calls (AgentCall, the call
# table), rounds, reports (outbox, counters), scheduler (RoundScheduler), work_costs, chunked_prefill,
# cold_pool (with its model rotation), hot_pool.
from talaria.services.instance_agent.scheduler.calls import AgentCall
from talaria.services.instance_agent.scheduler.budget import ModelLoad, SlotPlan, plan_slot
from talaria.services.instance_agent.scheduler.config import ABLATIONS, SchedulerConfig
from talaria.services.instance_agent.scheduler.costs import CalibratedCosts, StepCostModel, LinearCosts
from talaria.services.instance_agent.scheduler.types import (
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
