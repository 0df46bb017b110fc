"""Round scheduler with session-prefill (SP) for one instance (paper §3.2, §3.4, Eq. 3-5).

A cold-pool instance time-shares several models, one at a time. Time is cut into rounds;
each active model (one with queued or running work) gets one slot per round, and the
device switches model only between slots. A slot is

    P -> D1 -> (SP -> D)* -> Dfin

P admits the work waiting when the slot opens; D1 is the first decode; at each later
decode boundary an SP step may admit a bounded batch of *returning* calls (continuations
of the active model that arrived after P, with device or host-restorable KV); Dfin drains
the protected decode budget and, with `drain_on_switch` (the default, because the torch
engine refuses to switch with calls running), runs on until the slot's calls finish
before another model's slot. A hot-pool instance pins one model and does plain
continuous batching. The scheduler is pure: it takes `now`, returns actions and events,
and never touches an engine or a clock, so the live agent, the simulator and the unit
tests drive the same object.

Driving loop (live agent or simulator; `run_*` execute on an engine or a cost profile):

    sched = RoundScheduler(SchedulerConfig(), ["qwen", "glm"], costs)
    sched.submit(AgentCall("c1", "s1", "qwen", prompt_tokens=900, max_tokens=64), now=clock())
    while serving:
        match sched.next_action(clock()):
            case SwitchModel() as a: took = run_switch(a); events = sched.on_switch_done(a, clock(), took)
            case Prefill() as a: eos = run_prefill(a); events = sched.on_prefill_done(a, clock(), eos)
            case Decode() as a: eos = run_decode(a); events = sched.on_decode_done(a, clock(), eos)
            case Idle(): events = sched.drain_events(); wait_for_submit()
        publish(events)        # CallAdmitted / CallFinished / RoundEnded / DeadlineRisk ...

`submit`/`abort` may be called between any two calls above, including while an action
runs. The scheduler counts generated tokens itself and finishes a call at `max_tokens`;
`eos` lets a live engine finish one earlier. Every `CallFinished` event is the cue to
release the call in the engine (`engine.finish`). A simulator advances its clock by its
own profile's duration for the action (`sched.estimate_s(action)` if it has none); the
scheduler learns from the gap between its estimate and the reported completion time.

Package map:
    types.py      actions, events, SchedulerView
    config.py     SchedulerConfig (the paper's ablations: shared/ablations.py)
    scheduler_errors.py  the error hierarchy
    costs.py      StepCostModel protocol, per-call prefill/restore cost, EWMA calibration
    budget.py     Eq. 3-5: protected decode, slot budgets, switch cycle
    admission.py  batch selection under batch, KV and time budgets (P, SP, hot)
    calls.py      AgentCall (a call's one record, what `submit` takes) and the call table:
                  every call by id, queued/running per model
    rounds.py     round and slot bookkeeping
    reports.py    event outbox and the counters (sp_admitted, sp_parked, deadline_risk)
    scheduler.py  RoundScheduler: the driver API and the telemetry view (snapshot), composed of
    work_costs.py WorkPricing: the work priced under the calibrated costs
    chunked_prefill.py  PrefillPlanner: prefill actions, chunk sizes, the prefill a newcomer waits behind
    rotation.py   the order rounds visit the models
    cold_pool.py  ColdPool: rounds and slots of a time-shared (cold) instance
    hot_pool.py   HotPool: continuous batching of one pinned model
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
