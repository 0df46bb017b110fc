"""What the scheduler reports: the event outbox and the counters telemetry reads.

Every counter rises in two places at once: the instance total (snapshot) and the
current round (round summary), so the two always agree.
"""

from __future__ import annotations

from talaria.services.instance_agent.scheduler.calls import AgentCall
from talaria.services.instance_agent.scheduler.rounds import RoundState
from talaria.services.instance_agent.scheduler.types import (
    CallAdmitted,
    CallFinished,
    CallParked,
    DeadlineRisk,
    KvState,
    SchedulerEvent,
)


class Reports:
    def __init__(self) -> None:
        self.outbox: list[SchedulerEvent] = []
        self.sp_admitted = 0
        self.sp_parked = 0
        self.deadline_risk = 0

    def emit(self, event: SchedulerEvent) -> None:
        self.outbox.append(event)

    def drain(self) -> list[SchedulerEvent]:
        events, self.outbox = self.outbox, []
        return events

    def admitted(self, call: AgentCall, kv: KvState, issued_at: float, rnd: RoundState | None, now: float) -> None:
        via = call.via or "P"
        if via == "SP":
            self.sp_admitted += 1
            if rnd is not None:
                rnd.sp_admitted += 1
        wait = max(0.0, issued_at - call.arrived_at)
        self.emit(CallAdmitted(call.call_id, call.model, via, wait, kv, now))

    def finished(self, call: AgentCall, reason: str, now: float) -> None:
        self.emit(CallFinished(call.call_id, call.model, call.generated, reason, now))

    def parked(self, call: AgentCall, reason: str, rnd: RoundState | None, now: float) -> None:
        if call.parked:
            return  # counted once per call, as the paper counts return-handling events
        call.parked = True
        self.sp_parked += 1
        if rnd is not None:
            rnd.sp_parked += 1
        self.emit(CallParked(call.call_id, call.model, reason, now))

    def risk(
        self,
        model: str | None,
        reason: str,
        predicted_s: float,
        budget_s: float,
        rnd: RoundState | None,
        now: float,
        calls: int = 0,
    ) -> None:
        self.deadline_risk += 1
        if rnd is not None:
            rnd.deadline_risk += 1
        self.emit(DeadlineRisk(model, reason, predicted_s, budget_s, calls, now))

    def round_risk(
        self, model: str, reason: str, predicted_s: float, budget_s: float, rnd: RoundState, now: float
    ) -> None:
        """A round-level risk is raised once per round, not once per slot."""
        if reason not in rnd.risks:
            rnd.risks.add(reason)
            self.risk(model, reason, predicted_s, budget_s, rnd, now)

    def round_ended(self, rnd: RoundState, cap_s: float, now: float) -> None:
        wall = now - rnd.started_at
        if wall > cap_s + 1e-9:
            self.risk(None, "round_overrun", wall, cap_s, rnd, now)
        self.emit(rnd.ended(now))
