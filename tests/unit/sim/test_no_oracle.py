"""No output oracle in the simulator: every policy sees the client's max_tokens, never the
call's true length, which only the executing instance learns (as a live engine's EOS)."""

from dataclasses import replace

import pytest

from talaria.shared.events import CallSubmitted
from talaria.sim.cluster import Cluster, RunConfig, simulate
from talaria.sim.profiles import PAPER_TP8
from talaria.sim.metrics import session_scts
from talaria.sim.workloads import agent_sessions
from talaria.traces.caps import CLAUDE_CODE_MAX_TOKENS, GATEWAY_DEFAULT_MAX_TOKENS, KINDS, client_cap, client_kind
from talaria.traces.format import Session, TraceCall, TraceFormatError, parse_line
from talaria.traces.gaps import GapModel

MODELS = ["qwen3-235b", "glm5-nvfp4"]


def _sessions(n=6, seed=1):
    return agent_sessions(n, MODELS, depth=4, prompt=8000, output=200, seed=seed)


class Recorder(Cluster):
    """A cluster that keeps every CallSubmitted its router was given (a probe, not a double)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen: list[CallSubmitted] = []
        handle = self.router.handle

        def spy(event, now):
            if isinstance(event, CallSubmitted):
                self.seen.append(event)
            return handle(event, now)

        self.router.handle = spy


@pytest.mark.parametrize("policy", ["talaria", "least-pressure"])
def test_the_router_sees_the_client_cap_not_the_output(policy):
    sessions = _sessions()
    cluster = Recorder(sessions, RunConfig(PAPER_TP8, 2, policy, gaps=GapModel("recorded", 10.0)))
    result = cluster.run()
    truth = {f"{c.session}#{c.call_index}": c for s in sessions for c in s.calls}
    assert cluster.seen and len(result.jobs) == len(truth)
    for sub in cluster.seen:
        c = truth[sub.call_id]
        assert sub.max_tokens == client_cap(c, PAPER_TP8.model(c.model).max_context)
    # the caps are not the outputs (a 256-token default can equal a long output only by chance)
    assert sum(sub.max_tokens != truth[sub.call_id].output_tokens for sub in cluster.seen) > len(cluster.seen) // 2
    # ... and each call still generated exactly its true output, finishing by EOS below its cap
    for job in result.jobs:
        assert job.output == truth[job.call_id].output_tokens


def test_a_call_ends_at_its_true_length_under_any_cap():
    # least-loaded reads no cost terms: only the instance's schedule could change with the
    # caps, and it must not (a multi-step decode stops at the first call's EOS)
    sessions = _sessions(4, seed=3)
    told = [Session(s.id, tuple(replace(c, max_tokens=c.output_tokens) for c in s.calls)) for s in sessions]
    cfg = RunConfig(PAPER_TP8, 1, "least-loaded", gaps=GapModel("recorded", 10.0))
    capped, exact = simulate(sessions, cfg), simulate(told, cfg)
    assert session_scts(capped) == pytest.approx(session_scts(exact), rel=1e-12)
    assert {j.call_id: j.done_t for j in capped.jobs} == pytest.approx({j.call_id: j.done_t for j in exact.jobs})


def test_client_caps_are_documented_defaults_and_never_below_the_output():
    kinds = {client_kind(f"s{k}") for k in range(60)}
    assert kinds == set(KINDS)
    for k in range(60):
        sid = f"s{k}"
        call = TraceCall(sid, 0, "m", 1000, 0, 50, 0.0)
        cap = client_cap(call, 131_072)
        assert cap == {"claude-code": CLAUDE_CODE_MAX_TOKENS, "gateway-256": GATEWAY_DEFAULT_MAX_TOKENS,
                       "model-max": 131_072 - 1000}[client_kind(sid)]
        long = TraceCall(sid, 0, "m", 1000, 0, 40_000, 0.0)
        assert client_cap(long, 131_072) >= 40_000
    recorded = TraceCall("x", 0, "m", 1000, 0, 50, 0.0, max_tokens=64)
    assert client_cap(recorded, 131_072) == 64


def test_a_trace_s_max_tokens_is_read_and_checked():
    base = dict(session="a", call_index=0, model="m", prompt_tokens=10, reusable_prefix_tokens=0,
                output_tokens=20, gap_before_s=0.0)
    assert parse_line({**base, "max_tokens": 32_000}).max_tokens == 32_000
    assert parse_line(base).max_tokens == 0
    with pytest.raises(TraceFormatError, match="max_tokens"):
        parse_line({**base, "max_tokens": 5})  # below the output it produced
