"""Agents in the simulator: 503s are retried after Retry-After up to a bound, a session that
gives up never completes (no metric improves by dropping work), and every call carries the
gateway's block hashes so prefix-aware baselines see real prefixes."""

import math

import pytest

from talaria.services.router.policy.base import PolicyConfig
from talaria.shared.tokenizer import block_hashes
from talaria.sim.agents import INDEXED_BLOCKS, PromptHashes, RetryPolicy
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.executor import instance_config
from talaria.sim.metrics import summarise
from talaria.sim.profiles import PAPER_TP8
from talaria.sim.workloads import synthetic_catalogue
from talaria.traces.gaps import GapModel


def test_retry_policy_honours_retry_after_then_backs_off_and_gives_up():
    p = RetryPolicy(max_retries=3)
    assert p.wait_s(1, 2.5) == 2.5  # Retry-After as sent
    assert p.wait_s(1, None) == 0.5 and p.wait_s(3, None) == 2.0  # SDK backoff
    assert p.wait_s(2, 600.0) == 1.0  # a Retry-After past the cap is ignored
    assert p.wait_s(4, 1.0) is None  # bound reached: give up
    assert RetryPolicy(backoff_max_s=1.0).wait_s(9, None) == 1.0
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)


def test_prompt_hashes_are_the_gateways_and_continue_the_session():
    h = PromptHashes(seed=3)
    first = h.for_call("s", 0, 1000, 0)
    ids = h._ids["s"]
    assert first == block_hashes(list(ids)) and len(first) == 1000 // 16
    second = h.for_call("s", 1, 1500, 1010)  # reuses 1,010 tokens of the previous context
    assert second[: 1000 // 16] == first  # the shared blocks hash the same
    assert second == block_hashes(list(h._ids["s"]))
    third = h.for_call("s", 2, 800, 0)  # a compaction: nothing reused
    assert third[0] != first[0]
    assert h.for_call("t", 0, 1000, 0)[0] != first[0]  # sessions share no content
    assert len(h.for_call("u", 0, 10**6, 0)) == INDEXED_BLOCKS  # only what the router reads


def _crowd(n=12):
    return synthetic_catalogue(n, ["qwen3-235b"], arrival_rate_s=50.0, seed=1)


def _run(policy_config, retry, sessions):
    return simulate(sessions, RunConfig(PAPER_TP8, 1, "talaria", policy_config, instance_config("talaria"),
                                        GapModel("paper", 10.0, seed=0), retry=retry))


def test_rejected_calls_are_retried_until_they_run_and_the_wait_counts():
    sessions = _crowd()
    tight = PolicyConfig(overload="reject", ttft_target_s=2.0, retry_after_s=1.0)
    r = _run(tight, RetryPolicy(max_retries=10_000), sessions)
    s = summarise(r)
    assert s["rejected"] > 0 and s["retries"] == s["rejected"] and s["gave_up"] == 0
    assert s["complete"] and s["calls"] == sum(len(x.calls) for x in sessions)
    # a retried call's TTFT counts from its first release, so it includes the Retry-After waits
    assert max(j.first_token_t - j.release_t for j in r.jobs) >= 1.0


def test_a_session_that_gives_up_never_completes_and_scores_worse():
    sessions = _crowd()
    tight = PolicyConfig(overload="reject", ttft_target_s=2.0, retry_after_s=1.0)
    patient = summarise(_run(tight, RetryPolicy(max_retries=10_000), sessions))
    quitter = summarise(_run(tight, RetryPolicy(max_retries=0), sessions))
    assert quitter["gave_up"] > 0 and quitter["retries"] == 0
    assert not quitter["complete"] and quitter["sessions_incomplete"] > 0
    assert quitter["calls"] < patient["calls"]
    # dropping work makes the tail worse, never better
    assert quitter["sct_p95"] == math.inf and quitter["ttft_p95"] >= patient["ttft_p95"]


def test_prefix_aware_follows_the_session_with_real_hashes():
    sessions = synthetic_catalogue(24, ["qwen3-235b"], arrival_rate_s=0.5, seed=2)
    cfg = RunConfig(PAPER_TP8, 4, "prefix-aware", PolicyConfig(), instance_config("talaria"),
                    GapModel("paper", 10.0, seed=0))
    s = summarise(simulate(sessions, cfg))
    # with empty hashes it could only balance load; with the gateway's hashes a session's
    # returns find their own prefix where the previous call ran
    assert s["router"]["same_instance_returns"] > 0.9
