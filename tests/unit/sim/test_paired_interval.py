"""bench/paired.py: the paired-bootstrap interval of a percentile ratio that the migration
benches use to say whether a cell is established slower than its baseline."""

from __future__ import annotations

import random

from bench.paired import paired_ratio, verdict


def _spread(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.lognormvariate(5.0, 1.0) for _ in range(n)]  # SCTs ~150 s, spread ~10x


def test_a_three_percent_slowdown_of_every_session_is_established_despite_a_10x_spread():
    # each session 3 % slower in the configuration: paired, the ratio is exactly 1.03 in every
    # resample, though the sessions' own spread dwarfs it (an unpaired comparison would not see it)
    strata = [[(x * 1.03, x) for x in _spread(20, seed)] for seed in range(3)]
    for q in (0.5, 0.95):
        point, lo, hi = paired_ratio(strata, q)
        assert 1.0 < lo <= point <= hi
        assert abs(point - 1.03) < 1e-9
        assert verdict(lo, hi) == "slower"


def test_sessions_that_move_both_ways_give_an_interval_that_includes_one():
    # half the sessions 10 % slower, half 10 % faster, at random: no direction is established
    rng = random.Random(7)
    strata = [[(x * rng.choice((0.9, 1.1)), x) for x in _spread(20, seed)] for seed in range(3)]
    for q in (0.5, 0.95):
        point, lo, hi = paired_ratio(strata, q)
        assert lo < 1.0 < hi, (q, lo, point, hi)
        assert verdict(lo, hi) == "not established"


def test_faster_and_deterministic():
    strata = [[(x * 0.9, x) for x in _spread(30, 1)]]
    assert paired_ratio(strata, 0.5) == paired_ratio(strata, 0.5)
    assert verdict(*paired_ratio(strata, 0.5)[1:]) == "faster"


def test_a_session_incomplete_in_both_runs_counts_as_equal():
    inf = float("inf")
    strata = [[(inf, inf)] * 19 + [(1.0, 1.0)]]
    assert paired_ratio(strata, 0.95) == (1.0, 1.0, 1.0)


def test_a_seed_that_repeats_a_run_adds_no_sessions():
    rng = random.Random(3)
    one = [[(x * rng.choice((0.97, 1.05)), x) for x in _spread(20, 0)]]
    assert paired_ratio(one * 3, 0.5) == paired_ratio(one, 0.5)


def test_a_rerun_replaces_the_generated_part_and_keeps_the_reading_below_the_verdict():
    from bench.paired import VERDICT
    from bench.run_record import replace_generated

    page = ("# T\n\n## Simulator\n\nold table\n\n**Verdict: old**\n\nA reading.\n\n### Flatness\n\nkept\n\n"
            "## Simulator: capacity cases\n\nold cap\n\n**Verdict: old cap**\n\n## TTFT\n\nttft\n")
    page = replace_generated(page, "## Simulator", "## Simulator\n\nnew table\n\n**Verdict: new**", VERDICT)
    page = replace_generated(page, "## Simulator: capacity cases", "## Simulator: capacity cases\n\nnew cap\n\n"
                             "**Verdict: new cap**", VERDICT, after="## Simulator")
    assert page == ("# T\n\n## Simulator\n\nnew table\n\n**Verdict: new**\n\nA reading.\n\n### Flatness\n\nkept\n\n"
                    "## Simulator: capacity cases\n\nnew cap\n\n**Verdict: new cap**\n\n## TTFT\n\nttft\n")


def test_resampling_whole_runs_includes_one_where_runs_move_both_ways_and_excludes_it_where_all_slow():
    from bench.paired import run_ratio

    # each run shifts all its sessions together (what sessions sharing instances do), up in
    # some runs and down in others: no direction is established at the run level
    shifts = (1.06, 0.95, 1.05, 0.96, 1.04)
    _, lo, hi = run_ratio([[(x * f, x) for x in _spread(60, seed)] for seed, f in enumerate(shifts)], 0.5)
    assert lo < 1.0 < hi
    # every run 3 % slower: established, though the sessions spread 10x
    _, lo, hi = run_ratio([[(x * 1.03, x) for x in _spread(20, seed)] for seed in range(5)], 0.95)
    assert verdict(lo, hi) == "slower"


def test_one_distinct_run_gives_no_run_level_interval():
    import math

    from bench.paired import run_ratio

    one = [[(x * 1.2, x) for x in _spread(20, 0)]]
    point, lo, hi = run_ratio(one * 3, 0.5)
    assert abs(point - 1.2) < 1e-9 and math.isnan(lo) and math.isnan(hi)
    assert verdict(lo, hi) == "not established"
