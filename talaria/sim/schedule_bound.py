"""The schedule bound: a run's own schedule with every weight and KV transfer made free.

Each instance's executed actions (`SimExecutor.log`) are replayed in the order they ran,
each shortened by its transfer seconds (a switch keeps only its fixed phases P1, P3-P5; a
prefill drops its host KV restores; a decode is unchanged). An action starts when the one
before it on its instance ends and its calls have arrived; a call arrives at its session's
previous call's (replayed) completion plus the same gap. By induction over the actions in
the order they started, every replayed action ends no later than it did in the run, so every
session's SCT here is <= its SCT in the run: a true per-session lower bound for that run
(hence for every percentile), which says what memory and transfers cost it.

It bounds this schedule, not every scheduler: the capacity-bound configuration (the same
scheduler on a server with free memory, experiments.capacity_bound_profile) is a different
schedule, and on a workload whose p50 depends on which sessions the rounds favour it can
land on either side of the run it is compared with.
"""

from __future__ import annotations

from talaria.sim.cluster import RunResult
from talaria.sim.metrics import session_scts


def bound_done(result: RunResult) -> dict[str, float]:
    """Replayed completion time of every call of `result` (needs `executor.log` on)."""
    jobs = {j.call_id: j for j in result.jobs}
    actions = []
    for k, inst in enumerate(result.instances):
        if inst.log is None:
            raise ValueError(f"instance {inst.id} ran without an action log")
        actions.extend((a.start, a.end, k, a) for a in inst.log)
    actions.sort(key=lambda x: (x[0], x[1], x[2]))
    free: dict[int, float] = {}  # instance -> replayed end of its last action
    done: dict[str, float] = {}
    for _, _, k, a in actions:
        ready = max((_arrival(jobs[c], done, result.gaps_applied) for c in a.call_ids), default=0.0)
        end = max(free.get(k, 0.0), ready) + max(0.0, a.end - a.start - a.transfer_s)
        free[k] = end
        for c in a.finished:
            done[c] = end
    return done


def _arrival(job, done: dict[str, float], gaps: dict[tuple[str, int], float]) -> float:
    if job.call_index == 0:
        return job.release_t
    prev = f"{job.session}#{job.call_index - 1}"
    return done[prev] + gaps[(job.session, job.call_index)]


def schedule_bound_scts(result: RunResult) -> dict[str, float]:
    """Per-session SCT of the replayed schedule (sessions complete in `result` only)."""
    done = bound_done(result)
    first = {j.session: j.release_t for j in result.jobs if j.call_index == 0}
    last: dict[str, float] = {}
    for j in result.jobs:
        last[j.session] = max(last.get(j.session, 0.0), done[j.call_id])
    return {s: last[s] - first[s] for s in session_scts(result)}
