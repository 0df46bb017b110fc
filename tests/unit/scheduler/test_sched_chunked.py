"""Chunked prefill: a long prompt is computed in chunks sized from the round budget, so
decodes and short calls interleave with it (issue 11)."""

from __future__ import annotations

import pytest

from talaria.services.instance_agent.scheduler import Decode, Idle, LinearCosts, Prefill, SwitchModel
from talaria.services.instance_agent.scheduler.budget import chunk_tokens
from talaria.shared.prefill_cost import prefill_s

from tests.unit.scheduler.sched_driver import make, ret, work

# 10,000 prompt tokens a second, 10 ms decode steps: Eq. 4's slack at T_TPOT 0.2 s is
# 0.19 s with one model decoding, so a chunk is ~1,900 tokens.
COSTS = LinearCosts(prefill_tok_s=10_000.0, decode_base_s=0.01, switch_staged_s=0.0, switch_host_s=0.0,
                    kv_bytes_per_token=1)


class ChunkDriver:
    """Runs actions on a virtual clock like an engine that computes chunks: it tracks how
    much of each prompt is computed and reports which calls got their first token."""

    def __init__(self, sched, prefill_s=COSTS.prefill_s) -> None:
        self.sched, self.now, self.done_tokens, self.prefill_s = sched, 0.0, {}, prefill_s
        self.first_token_at: dict[str, float] = {}
        self.actions: list = []

    def step(self):
        s = self.sched
        action = s.next_action(self.now)
        self.actions.append(action)
        match action:
            case Idle():
                return action
            case SwitchModel():
                s.on_switch_done(action, self.now, 0.0)
            case Prefill(call_ids=ids, chunk_tokens=chunk, model=m):
                took, firsts = 0.0, []
                for cid in ids:
                    prompt = s.calls.get(cid).prompt_tokens
                    have = self.done_tokens.get(cid, 0)
                    n = prompt - have if chunk == 0 else min(chunk, prompt - have)
                    took += self.prefill_s(m, n, have)
                    self.done_tokens[cid] = have + n
                    if have + n == prompt:
                        firsts.append(cid)
                self.now += took
                for cid in firsts:
                    self.first_token_at[cid] = self.now
                s.on_prefill_done(action, self.now, first_tokens=firsts)
            case Decode(call_ids=ids, model=m):
                self.now += COSTS.decode_step_s(m, len(ids), 0)
                s.on_decode_done(action, self.now)
        return action

    def run_until(self, pred, limit=5_000):
        for _ in range(limit):
            if pred():
                return
            self.step()
        raise AssertionError("condition never held")


def test_a_short_call_and_decodes_interleave_with_a_long_prefill():
    d = ChunkDriver(make(("a",), costs=COSTS, chunked_prefill=True))
    d.sched.submit(work("running", prompt=100, max_tokens=5_000), 0.0)
    d.run_until(lambda: "running" in d.first_token_at)
    d.sched.submit(work("long", prompt=20_000, max_tokens=2), d.now)
    d.run_until(lambda: any(isinstance(a, Prefill) and "long" in a.call_ids for a in d.actions))
    d.sched.submit(work("short", prompt=30, max_tokens=2), d.now)
    d.run_until(lambda: "long" in d.first_token_at)
    # The short call got its first token long before the 2 s prefill finished ...
    assert d.first_token_at["short"] < d.first_token_at["long"] - 1.0
    # ... and the running call kept decoding between the chunks.
    chunks = [i for i, a in enumerate(d.actions) if isinstance(a, Prefill) and a.call_ids == ("long",)]
    assert len(chunks) >= 5
    # After the admitting P, no two chunks run back to back while a call can decode.
    assert all(j > i + 1 for i, j in zip(chunks[1:], chunks[2:]))
    between = [a for a in d.actions[chunks[1]:chunks[-1]] if isinstance(a, Decode) and "running" in a.call_ids]
    assert len(between) >= len(chunks) - 3
    # Each chunk fits the decode slack of Eq. 4 (T_TPOT - t_D = 0.19 s here).
    for i in chunks:
        assert 0 < d.actions[i].chunk_tokens * 1e-4 <= 0.19 + 1e-9


def _first_long_chunk(tpot: float, with_running: bool) -> int:
    d = ChunkDriver(make(("a",), costs=COSTS, chunked_prefill=True, tpot_target_s=tpot, ttft_target_s=2.0))
    if with_running:
        d.sched.submit(work("running", prompt=100, max_tokens=5_000), 0.0)
        d.run_until(lambda: "running" in d.first_token_at)
    d.sched.submit(work("long", prompt=50_000), d.now)
    d.run_until(lambda: any(isinstance(a, Prefill) and "long" in a.call_ids for a in d.actions))
    return d.actions[-1].chunk_tokens


def test_chunk_size_follows_the_round_budget_not_a_constant():
    # Sharing the instance: Eq. 4's slack, T_TPOT - t_D.
    sizes = {tpot: _first_long_chunk(tpot, True) for tpot in (0.1, 0.2, 0.4)}
    assert sizes[0.1] < sizes[0.2] < sizes[0.4]
    assert abs(sizes[0.2] - 1_900) <= 2  # (0.2 - 0.01) s at 10,000 tokens/s
    # Alone: Eq. 5's round cap, gamma * T_TTFT = 1.8 s here (the driver ends a chunk early
    # when a call arrives).
    assert abs(_first_long_chunk(0.2, False) - 18_000) <= 2


def test_a_chunk_alone_runs_in_passes_a_newcomer_would_wait_for():
    # Alone, a chunk spans the round cap (18,000 tokens) but each forward pass only what a
    # shared chunk may take (Eq. 4's slack, 1,900 tokens): a call arriving mid-chunk waits
    # one such pass, which is what the view tells the router it waits behind.
    d = ChunkDriver(make(("a",), costs=COSTS, chunked_prefill=True, tpot_target_s=0.2, ttft_target_s=2.0))
    d.sched.submit(work("long", prompt=50_000), 0.0)
    d.run_until(lambda: any(isinstance(a, Prefill) and "long" in a.call_ids for a in d.actions))
    alone = d.actions[-1]
    assert abs(alone.chunk_tokens - 18_000) <= 2 and abs(alone.pass_tokens - 1_900) <= 2
    # Sharing the instance, the chunk is already that small: one pass.
    d = ChunkDriver(make(("a",), costs=COSTS, chunked_prefill=True, tpot_target_s=0.2, ttft_target_s=2.0))
    d.sched.submit(work("running", prompt=100, max_tokens=5_000), 0.0)
    d.run_until(lambda: "running" in d.first_token_at)
    d.sched.submit(work("long", prompt=50_000), d.now)
    d.run_until(lambda: any(isinstance(a, Prefill) and "long" in a.call_ids for a in d.actions))
    shared = d.actions[-1]
    assert shared.pass_tokens == shared.chunk_tokens


def test_without_chunking_a_prefill_is_whole_and_the_view_counts_prompt_left():
    sched = make(("a",), costs=COSTS)
    sched.submit(work("long", prompt=20_000), 0.0)
    action = sched.next_action(0.0)
    while not isinstance(action, Prefill):
        sched.on_switch_done(action, 0.0, 0.0)
        action = sched.next_action(0.0)
    assert action.chunk_tokens == 0
    # The prefill in flight is still work ahead of any new call: the router must see it.
    assert sched.snapshot(0.0).queued_tokens == 20_000


def test_prefill_ahead_in_seconds_counts_only_what_each_queued_call_computes():
    # A return whose 19,000-token prefix is on device computes 1,000 tokens; one whose prefix
    # is on host restores it (20x cheaper per token here) and computes the rest; a new call
    # computes all. Counting prompt tokens (queued_tokens) charges all three as recomputes.
    sched = make(("a", "b"), costs=COSTS, initial_model="b")
    sched.submit(work("busy", "b", max_tokens=50), 0.0)
    assert isinstance(sched.next_action(0.0), Prefill)  # b's slot is busy: a's calls queue
    sched.submit(ret("dev", prompt=20_000, reuse=19_000), 0.0)
    sched.submit(ret("host", kv="host", prompt=20_000, reuse=19_000), 0.0)
    sched.submit(work("new", prompt=20_000), 0.0)
    assert sched.prefill_ahead_tokens() == 60_000 + 100  # + b's prefill under way
    expected = 1_000 / 10_000 + (19_000 / 200_000 + 1_000 / 10_000) + 20_000 / 10_000 + 100 / 10_000
    assert sched.prefill_ahead_s() == pytest.approx(expected)


def test_the_view_counts_what_a_newcomer_waits_behind():
    # With chunking a newcomer waits for at most one shared-instance chunk of a long prefill
    # (T_TPOT - t_D = 0.19 s, 1,900 tokens here), not for all it has left: the router's
    # queue estimate is that, not the whole remainder.
    d = ChunkDriver(make(("a",), costs=COSTS, chunked_prefill=True, ttft_target_s=2.0))
    d.sched.submit(work("long", prompt=50_000, max_tokens=2), 0.0)
    d.run_until(lambda: d.done_tokens.get("long", 0) > 0)
    assert 50_000 - d.done_tokens["long"] > 1_900
    assert abs(d.sched.snapshot(d.now).queued_tokens - 1_900) <= 2
    d.sched.submit(work("next", prompt=300), d.now)
    assert abs(d.sched.snapshot(d.now).queued_tokens - 2_200) <= 2


def test_chunk_tokens_is_the_most_that_fits():
    assert chunk_tokens(lambda n: n * 0.001, 0.05, 1000) == 50
    assert chunk_tokens(lambda n: n * 0.001, 5.0, 1000) == 1000  # all fits
    assert chunk_tokens(lambda n: n * 1.0, 0.5, 1000) == 1  # always progress


def test_slot_fill_by_switch_bounds_how_long_another_models_call_waits():
    """A slot fills past protected decode for about one switch's worth, not its share of
    the round cap, when fill_by_switch is on (the live agent's setting)."""
    from talaria.services.instance_agent.scheduler import SwitchModel as Switch

    costs = LinearCosts(prefill_tok_s=100_000.0, decode_base_s=0.01, switch_staged_s=0.05, switch_host_s=0.1,
                        kv_bytes_per_token=1)
    waits = {}
    for fill_by_switch in (False, True):
        # drain_on_switch off: the slot's own budget, not its running call, decides when it ends
        d = ChunkDriver(make(("a", "b"), costs=costs, fill_by_switch=fill_by_switch, drain_on_switch=False))
        d.sched.submit(work("a1", "a", prompt=100, max_tokens=300), 0.0)
        d.run_until(lambda: "a1" in d.first_token_at)
        t0 = d.now
        d.sched.submit(work("b1", "b", prompt=100, max_tokens=2), t0)
        d.run_until(lambda: isinstance(d.actions[-1], Switch) and d.actions[-1].to_model == "b")
        waits[fill_by_switch] = d.now - t0
    assert waits[True] < 0.5 < waits[False]


def test_the_view_reports_the_rest_of_a_long_prefill_so_the_router_sees_the_busy_instance():
    d = ChunkDriver(make(("a",), costs=COSTS, chunked_prefill=True, tpot_target_s=0.2, ttft_target_s=2.0))
    d.sched.submit(work("running", prompt=100, max_tokens=5_000), 0.0)
    d.run_until(lambda: "running" in d.first_token_at)
    assert d.sched.prefill_left_s() == 0.0
    d.sched.submit(work("long", prompt=50_000), d.now)
    d.run_until(lambda: any(isinstance(a, Prefill) and "long" in a.call_ids for a in d.actions))
    seen = []
    while "long" not in d.first_token_at:
        left = d.sched.calls.get("long").prefill_left
        # all but the one chunk a newcomer waits behind (queued_prefill_s counts that one)
        assert d.sched.prefill_left_s() == pytest.approx(max(0, left - 1_900) * 1e-4, abs=1e-3)
        seen.append(d.sched.prefill_left_s())
        d.step()
    assert seen[0] > 4.0 and seen == sorted(seen, reverse=True) and d.sched.prefill_left_s() == 0.0


def test_the_chunks_of_a_long_prefill_measure_how_its_cost_grows_with_context():
    # An engine whose every prompt token also costs 1e-9 s per token before it (attention):
    # the scheduler's linear costs do not know it; the chunks it times show it.
    def engine_s(model, n, have):
        return prefill_s(1e-4, 1e-9, n, have)
    d = ChunkDriver(make(("a",), costs=COSTS, chunked_prefill=True, tpot_target_s=0.2, ttft_target_s=2.0),
                    prefill_s=engine_s)
    d.sched.submit(work("running", prompt=100, max_tokens=5_000), 0.0)
    d.run_until(lambda: "running" in d.first_token_at)
    assert d.sched.curve.ctx_s_per_tok2("a") == 0.0  # one short prompt in one step: nothing to learn
    d.sched.submit(work("long", prompt=50_000), d.now)
    d.run_until(lambda: "long" in d.first_token_at)
    assert d.sched.curve.ctx_s_per_tok2("a") == pytest.approx(1e-9, rel=1e-3)


def test_once_measured_a_steps_fixed_cost_sizes_chunks_not_a_rate_inflated_by_short_steps():
    # Short prompts' steps are mostly fixed cost: calibrated on them, the linear rate says a
    # token costs 10x what it does, and would cut a long prompt into chunks where that fixed
    # cost dominates again. Once a chunked prefill measured the fixed cost (0.05 s a chunk)
    # and the rate (1e-4 s a token), a chunk is what fits the budget after the fixed cost.
    sched = make(("a",), costs=COSTS, chunked_prefill=True, tpot_target_s=0.2, ttft_target_s=2.0)
    sched.costs.factors[("prefill", "a")] = 10.0
    long = work("long", prompt=50_000)
    long.prefill_left = 50_000
    budget = sched.prefill.chunk_budget_s("a", None)
    before, _ = sched.prefill.chunk_for("a", [long], None)
    assert before == pytest.approx(budget / 1e-3, abs=1)
    done = 0
    for n in [700, 40, 900, 300, 800, 12, 1000, 500]:
        sched.curve.observe("a", n, done, 0.05 + n * 1e-4)
        done += n
    after, _ = sched.prefill.chunk_for("a", [long], None)
    assert after == pytest.approx((budget - 0.05) / 1e-4, abs=2) and after > 5 * before


def test_a_call_that_waited_through_a_chunk_behind_another_paces_from_there():
    sched = make(("a",), costs=COSTS, chunked_prefill=True, tpot_target_s=0.2, ttft_target_s=2.0)
    sched.submit(work("x", prompt=20_000), 0.0)
    sched.submit(work("y", prompt=20_000), 0.0)
    t = 0.0
    for _ in range(10):  # until one chunk carries both prompts
        action = sched.next_action(t)
        t += 0.1
        if isinstance(action, SwitchModel):
            sched.on_switch_done(action, t, 0.0)
        elif set(action.call_ids) == {"x", "y"}:
            break
        else:
            sched.on_prefill_done(action, t, first_tokens=[])
    assert isinstance(action, Prefill) and set(action.call_ids) == {"x", "y"}
    x, y = sched.calls.get("x"), sched.calls.get("y")
    x_left, y_left, x_paced = x.prefill_left, y.prefill_left, x.paced_from
    # The engine gave the chunk to x alone (its passes go call by call).
    sched.on_prefill_done(action, t, first_tokens=[], prompt_left={"x": x_left - 1_000, "y": y_left})
    assert x.paced_from == x_paced and y.paced_from == (t, y_left)
