"""Cold pool: rounds and slots, P -> D1 -> (SP -> D)* -> Dfin (paper §3.4, Eq. 3-5).

A part of `RoundScheduler` (scheduler.py) that decides, for a time-shared instance, which
model's slot runs, what its P admits, when an SP step may follow a decode, and when the
slot closes. It owns the round and slot in progress (and the model a switch is opening);
the call table, the reports, the pricing and prefill parts and the model rotation are
handed to it. The driver tells it what the executor did (`prefill_done`, `decode_done`,
`switch_done`).
"""

from __future__ import annotations

import math

from talaria.services.instance_agent.scheduler.admission import Limits, Selection, select
from talaria.services.instance_agent.scheduler.budget import plan_slot, switch_cycle_s
from talaria.services.instance_agent.scheduler.calls import AgentCall, CallTable
from talaria.services.instance_agent.scheduler.chunked_prefill import PrefillPlanner
from talaria.services.instance_agent.scheduler.config import ConfigReader, SharedConfig
from talaria.services.instance_agent.scheduler.costs import charged_kv, first_step_reaching
from talaria.services.instance_agent.scheduler.reports import Reports
from talaria.services.instance_agent.scheduler.rounds import RoundState, Slot
from talaria.services.instance_agent.scheduler.types import Action, Decode, Idle, Prefill, SlotOpened, SwitchModel
from talaria.services.instance_agent.scheduler.work_costs import WorkPricing

_PARK_REASON = {"time": "sp_budget", "batch": "sp_batch"}


class ColdPool(ConfigReader):
    def __init__(self, shared: SharedConfig, calls: CallTable, reports: Reports, pricing: WorkPricing,
                 prefill: PrefillPlanner, rotation: Rotation) -> None:
        self.shared, self.calls, self.reports = shared, calls, reports
        self.pricing, self.prefill, self.rotation = pricing, prefill, rotation
        self.slot: Slot | None = None
        self.round: RoundState | None = None
        self.rounds_done = 0
        self.target: str | None = None  # model the in-flight or next switch opens
        self._max_steps = 1  # decode steps the current next_action may hand out

    def next_action(self, now: float, device_model: str | None, max_steps: int) -> Action:
        self._max_steps = max_steps
        # Each pass either returns or closes a slot; an active model's slot always yields
        # an action (P admits its oldest call when nothing runs), so this ends quickly.
        for _ in range(2 * len(self.rotation.models) + 2):
            if self.slot is None:
                model = self.target or self._pick_model(now, device_model)
                if model is None:
                    return Idle(None)
                if model != device_model:
                    self.target = model
                    return SwitchModel(device_model, model, self.config.staging)
                self.target = None
                self._open_slot(model, now, device_model)
            action = self._slot_action(now)
            if action is not None:
                return action
            self._close_slot(now)
        raise AssertionError("scheduler made no progress: an active slot yielded no action")

    # ---- what the executor did ---------------------------------------------------------

    def prefill_done(self, action: Prefill, now: float, yielded: bool, continuation: bool,
                     predicted_s: float) -> None:
        slot = self.slot
        if slot is not None and yielded:
            slot.protected = min(slot.protected, slot.decodes)
            slot.deadline = min(slot.deadline, now)
            slot.last = "C"
        elif slot is not None:
            if continuation:
                # A chunk spends decode time: it counts as the decode steps it displaces, so
                # protected decode runs out (and a contended slot closes) at the same pace.
                slot.last = "C"
                step = slot.plan.decode_step_s
                slot.decodes += max(1, math.ceil(predicted_s / step - 1e-9)) if step > 0 else 1
            else:
                slot.last = "SP" if action.session_prefill else "P"

    def decode_done(self, ran: int, now: float) -> None:
        slot = self.slot
        if slot is not None:
            slot.decodes += ran
            if slot.free_run:
                slot.free_run = False
                if not slot.extended and slot.decodes > slot.protected:
                    self._extend(slot, now)
            slot.last = "D"

    def switch_done(self, took: float) -> None:
        if self.round is not None:
            self.round.switch_s += took

    def switch_failed(self) -> None:
        self.target = None  # chosen afresh

    def round_remaining_s(self, now: float) -> float:
        """Predicted time left in the current round (0 between rounds)."""
        rnd = self.round
        return max(0.0, rnd.started_at + rnd.predicted_s - now) if rnd is not None else 0.0

    # ---- rounds and slots --------------------------------------------------------------

    def _pick_model(self, now: float, device_model: str | None) -> str | None:
        """Next active model not yet served this round, in rotation order; else a new round."""
        active = self.rotation.active_in_rotation(device_model)
        if self.round is not None:
            for model in active:
                if not self.round.served(model):
                    return model
            self._end_round(now)
        if not active:
            return None
        self.round = RoundState(index=self.rounds_done, started_at=now)
        return active[0]

    def _open_slot(self, model: str, now: float, device_model: str | None) -> None:
        rnd = self.round
        assert rnd is not None  # a slot always opens inside a round
        order = [model] + [m for m in self.rotation.active_in_rotation(model) if m != model]
        loads = {m: self.pricing.load(m) for m in order}
        plan = plan_slot(model, loads, switch_cycle_s(order, device_model, self.pricing.switch_s), self.config)
        self.slot = Slot(model, plan, now, plan.protected_decode, plan.prefill_budget_s, plan.sp_budget_s)
        self.slot.deadline = now + plan.slot_budget_s if self.config.fill_slot else now
        rnd.slots.append(model)
        rnd.predicted_s = plan.predicted_round_s
        self.reports.emit(
            SlotOpened(
                model, rnd.index, plan.protected_decode, plan.decode_step_s,
                plan.prefill_budget_s, plan.sp_budget_s, plan.predicted_round_s, now,
            )
        )  # fmt: skip
        if plan.over_budget:
            self.reports.round_risk(model, "round_over_budget", plan.predicted_round_s, plan.round_cap_s, rnd, now)
        if not plan.tpot_feasible:
            tpot = self.config.tpot_target_s
            self.reports.round_risk(model, "tpot_infeasible", tpot - plan.decode_slack_s, tpot, rnd, now)

    def _slot_action(self, now: float) -> Action | None:
        """P first, then decode; an SP step may follow any decode until protected decode runs out."""
        slot = self.slot
        assert slot is not None
        if not slot.p_done:
            slot.p_done = True
            slot.p_mark = self.calls.seq  # later submissions arrived after P
            selection = self._select_p(slot, now)
            if selection.admitted:
                return self.prefill.start(selection, "P", slot.model, now, slot)
        contended = self._contended(slot)
        if slot.decode_left == 0 and not contended and self.calls.active(slot.model):
            self._extend(slot, now)
        elif slot.extended and contended:
            slot.protected = min(slot.protected, slot.decodes)  # the extension ends: Dfin now
            slot.deadline = min(slot.deadline, now)
        # Slot fill amortises switches: it only applies while another model waits (a lone
        # model's slot closes after protected decode so its queued work gets the next P).
        open_ = slot.decode_left > 0 or (slot.filling(now) and self._others_active(slot.model))
        if slot.at_decode_boundary and open_:
            selection = self._select_sp(slot, now)
            if selection is not None and selection.admitted:
                return self.prefill.start(selection, "SP", slot.model, now, slot)
        decodable, filling = self.prefill.split_running(slot.model)
        if (decodable or filling) and (open_ or self._must_drain(slot)):
            if filling and (not decodable or slot.last != "C"):
                return self.prefill.continue_prefill(filling, slot.model, slot)  # chunks and decodes alternate
            return self._decode(decodable, slot.model, slot, now)
        return None

    def _decode(self, ids: tuple[str, ...], model: str, slot: Slot, now: float) -> Decode:
        """A Decode of up to `max_decode_steps` iterations, cut at the next boundary."""
        k = self._max_steps
        if k == 1:
            return Decode(ids, model)
        calls = [self.calls.held(i) for i in ids]
        k = min(k, min(c.max_tokens - c.generated for c in calls))
        if slot.sp_retry:
            k = 1
        elif not self._contended(slot):
            # Nothing to act on until a submission (the driver stops at the next step
            # boundary then); passing protected decode here is the `_extend` that
            # single steps would have made at its end (done in decode_done).
            slot.free_run = True
        elif slot.decode_left > 0:
            k = min(k, slot.decode_left)
        elif slot.filling(now) and self._others_active(model):
            probe = Decode(ids, model)
            k = first_step_reaching(lambda j: self.pricing.decode_s(probe, j), slot.deadline - now, k)
        return Decode(ids, model, max(1, k))

    def _others_active(self, model: str) -> bool:
        return self.calls.any_active_except(model)

    def _must_drain(self, slot: Slot) -> bool:
        """Dfin runs on past protected decode when the next slot is another model's and the
        engine cannot switch with calls running (`drain_on_switch`)."""
        if not self.config.drain_on_switch:
            return False
        return self.calls.any_active_except(slot.model)

    def _select_p(self, slot: Slot, now: float) -> Selection:
        model = slot.model
        limits = Limits(
            free_slots=self.config.max_batch - len(self.calls.running[model]),
            batch=self.config.max_batch,
            kv_free_bytes=self.pricing.kv_free(model),
            time_s=slot.prefill_left_s,
            at_least_one=True,
        )
        selection = select(self.calls.queued[model], limits, self.pricing.cost, self.pricing.kv)
        slot.prefill_left_s = max(0.0, slot.prefill_left_s - selection.cost_s)
        budget = slot.plan.prefill_budget_s
        if short := selection.left_for("time"):
            self.reports.risk(model, "prefill_shortfall", selection.cost_s, budget, self.round, now, short)
        if full := selection.left_for("max_batch") + selection.left_for("kv_budget"):
            self.reports.risk(model, "capacity", selection.cost_s, budget, self.round, now, full)
        return selection

    def _select_sp(self, slot: Slot, now: float) -> Selection | None:
        if not self.config.sp:
            return None
        model = slot.model
        eligible = [c for c in self.calls.queued[model] if self._sp_eligible(c, slot)]
        if not eligible:
            return None
        limits = Limits(
            free_slots=self.config.max_batch - len(self.calls.running[model]),
            batch=self.config.sp_max_batch,
            kv_free_bytes=self.pricing.kv_free(model),
            time_s=slot.sp_left_s,
        )
        selection = select(eligible, limits, self.pricing.cost, self.pricing.kv, charge=slot.plan.sp_charge_s)
        slot.sp_retry = selection.left_for("batch") > 0
        for call, reason in selection.left:
            self.reports.parked(call, _PARK_REASON.get(reason, reason), self.round, now)
        if selection.admitted:
            slot.sp_left_s -= slot.plan.sp_charge_s(selection.cost_s)
            slot.protected += slot.plan.sp_extension(selection.cost_s)
        return selection

    def _sp_eligible(self, call: AgentCall, slot: Slot) -> bool:
        """Paper §3.4: the active model, a continuation that arrived after P, reusable KV here."""
        return (
            call.seq > slot.p_mark
            and call.continuation
            and call.reusable_tokens > 0
            and charged_kv(call, self.config.hkvr) != "none"
        )

    def _contended(self, slot: Slot) -> bool:
        """Whether work other than this slot's decode and SP candidates is waiting."""
        if self.calls.any_active_except(slot.model):
            return True
        # An SP candidate already parked (it did not fit the SP budget or batch) needs a P:
        # it contends, so an extended slot ends and the next slot's P admits it. (Counting
        # it as SP-served let an extended slot decode on for minutes while it waited.)
        sp = self.config.sp
        return any(
            not (sp and not c.parked and self._sp_eligible(c, slot)) for c in self.calls.queued[slot.model]
        )

    def _extend(self, slot: Slot, now: float) -> None:
        # Nothing to rotate to and nothing waiting for a P: closing would only open an
        # identical slot. Rounds bound model revisit time, which means nothing without
        # contention, so the round ends here and the slot decodes on (SP included) until
        # work for a P or another model arrives; the next slot then opens a new round.
        if self.round is not None:
            self._end_round(now)
        slot.extended = True
        slot.protected = max(slot.protected, slot.decodes) + slot.plan.protected_decode
        slot.sp_left_s = slot.plan.sp_budget_s

    def _close_slot(self, now: float) -> None:
        slot = self.slot
        assert slot is not None
        if self.config.sp and slot.p_done:
            for call in list(self.calls.queued[slot.model]):
                if self._sp_eligible(call, slot):
                    self.reports.parked(call, "slot_closed", self.round, now)
        self.slot = None

    def _end_round(self, now: float) -> None:
        assert self.round is not None
        self.reports.round_ended(self.round, self.config.round_cap_s, now)
        self.round = None
        self.rounds_done += 1


class Rotation:
    """The order a cold instance's rounds visit its models: all of them cyclically after the
    one on the device, and of those the ones with work. It owns the memo of each rotation."""

    def __init__(self, models: tuple[str, ...], calls: CallTable) -> None:
        self.models, self.calls = models, calls
        self._rotations: dict[str | None, tuple[str, ...]] = {}  # by `after`, memoised

    def rotation(self, after: str | None) -> list[str]:
        """All models in cyclic order, starting after `after` and ending with it."""
        return list(self._rotation(after))

    def _rotation(self, after: str | None) -> tuple[str, ...]:
        rot = self._rotations.get(after)
        if rot is None:
            if after is None:
                rot = self.models
            else:
                i = self.models.index(after)
                rot = self.models[i + 1 :] + self.models[: i + 1]
            self._rotations[after] = rot
        return rot

    def active_in_rotation(self, after: str | None) -> list[str]:
        """`rotation(after)` restricted to models with a queued or running call."""
        calls = self.calls
        if not calls.any_active():
            return []
        return [m for m in self._rotation(after) if calls.live(m)]
