"""bench/matrix_pools_oracle.py's prefix oracle (issue 35 part 2's bound): it moves toward the
exact split of the sessions arrived so far, and nothing before any has arrived; and how late
the run's busiest model is settled."""

from __future__ import annotations

from bench.matrix_pools_oracle import PrefixOracle, settled_at


def oracle(arrivals):
    pools = PrefixOracle({"i0": "a", "i1": "a", "i2": "b"}, models=("a", "b"))
    pools.arrivals = arrivals
    return pools


def test_the_oracle_moves_an_instance_to_the_model_whose_arrived_sessions_need_it():
    pools = oracle([(0.0, "a", 1.0), (0.5, "b", 10.0), (5.0, "a", 100.0)])
    [move] = pools.plan(1.0, {}, {})
    assert (move.model, move.previous) == ("b", "a")  # a's big session has not arrived at t = 1


def test_the_oracle_keeps_the_split_that_is_exact_for_what_has_arrived():
    pools = oracle([(0.0, "a", 10.0), (0.5, "b", 1.0)])
    assert pools.plan(1.0, {}, {}) == []


def test_the_oracle_does_nothing_before_a_session_has_arrived():
    assert oracle([(5.0, "b", 10.0)]).plan(1.0, {}, {}) == []


def test_settled_after_the_last_arrival_at_which_the_arrived_argmax_is_not_the_runs():
    # arrived argmax: a, b, b; the run's is b (5 > 2): unsettled after the first of three
    assert settled_at([(0.0, "a", 1.0), (1.0, "b", 5.0), (2.0, "a", 1.0)]) == 1 / 3
    assert settled_at([(0.0, "b", 5.0), (1.0, "a", 1.0)]) == 0.0
