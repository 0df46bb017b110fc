"""Mutable bookkeeping of the current round and slot (owned by `RoundScheduler`).

    round i:  | S | P D1 SP D SP D ... Dfin | S | P D1 ... Dfin | S | ...
                  '-------- slot (m1) ------'     '-- slot (m2) --'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from talaria.services.instance_agent.scheduler.budget import SlotPlan
from talaria.services.instance_agent.scheduler.types import RoundEnded


@dataclass
class Slot:
    model: str
    plan: SlotPlan
    opened_at: float
    protected: int  # protected decode iterations; SP batches extend it (Eq. 4)
    prefill_left_s: float
    sp_left_s: float
    p_done: bool = False
    p_mark: int = 0  # calls with seq > p_mark arrived after P: SP candidates
    decodes: int = 0
    last: str = ""  # P | SP | D | C (a prefill chunk): what ran last; SP follows a decode or chunk
    extended: bool = False  # decoding on past its round because nothing else waits
    deadline: float = float("inf")  # end of the slot's time budget (fill_slot)
    free_run: bool = False  # the decode in flight was issued uncontended, past protected decode allowed
    sp_retry: bool = False  # an SP candidate was left only for the batch cap: try next boundary

    @property
    def at_decode_boundary(self) -> bool:
        return self.last in ("D", "C")

    def filling(self, now: float) -> bool:
        """Past protected decode but still inside the slot's time budget."""
        return now < self.deadline - 1e-9

    @property
    def decode_left(self) -> int:
        return max(0, self.protected - self.decodes)


@dataclass
class RoundState:
    index: int
    started_at: float
    slots: list[str] = field(default_factory=list)
    switch_s: float = 0.0
    sp_admitted: int = 0
    sp_parked: int = 0
    deadline_risk: int = 0
    predicted_s: float = 0.0  # latest slot plan's R_i
    risks: set[str] = field(default_factory=set)  # round-level risk reasons already raised

    def served(self, model: str) -> bool:
        return model in self.slots

    def ended(self, now: float) -> RoundEnded:
        wall = max(0.0, now - self.started_at)
        return RoundEnded(
            round_index=self.index,
            wall_s=wall,
            active_s=max(0.0, wall - self.switch_s),
            switch_s=self.switch_s,
            slots=tuple(self.slots),
            sp_admitted=self.sp_admitted,
            sp_parked=self.sp_parked,
            deadline_risk=self.deadline_risk,
            at=now,
        )
