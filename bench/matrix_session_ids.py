"""The matrix with and without session ids (issue 41, ask 4; not a test).

    python bench/matrix_session_ids.py [--cells base,prompt=...] [--peers] [--workers 2]
        [--out results/session_inference.md]

Per matrix cell (talaria/sim/matrix.py), talaria with the clients' session ids and without
them (its gateway infers sessions: talaria/sim/anonymous_sessions.py), and with `--peers`
each peer without ids (its router sees every call as its own session). Prints and writes,
per cell, SCT p50/p95 of each run without ids over the same configuration with ids, both
measured in this run, and the continuations talaria's inference did not attribute to their
session (it started a new one: the prompt does not repeat its predecessor's prompt and answer
head), of which restarts (the workload's compaction at the context cap: nothing reused). With
ids given back to exactly those calls the run is the run with ids (tests/unit/sim/
test_sim_anonymous_sessions.py: every continuation attributed, every metric equal). The table replaces the section
`## In the matrix, without session ids` of `--out` (with `--peers`: `## The peers in ...`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.services import configs  # noqa: E402
from talaria.sim import matrix  # noqa: E402
from talaria.sim.cluster import Cluster  # noqa: E402
from talaria.sim.metrics import summarise  # noqa: E402

SECTION = "## In the matrix, without session ids"
PEERS_SECTION = "## The peers in the matrix, without session ids"  # `--peers`: its own section
GOAL = 0.02  # issue 41: talaria without ids within 2 % of talaria with ids in every cell


def task(args: tuple[matrix.Cell, str, str]) -> tuple[str, str, str, dict]:
    cell, policy, ids = args
    run, _, sessions, _ = matrix.run_config(cell, policy, session_ids=ids)
    started = time.perf_counter()
    cluster = Cluster(sessions, run)
    s = summarise(cluster.run())
    out = {k: s[k] for k in ("sct_p50", "sct_p95", "ttft_p95", "complete")}
    out["run_s"] = time.perf_counter() - started
    out["kinds"] = dict(cluster.anonymous.kinds) if cluster.anonymous else {}
    out["merged"] = cluster.anonymous.merged if cluster.anonymous else 0
    calls = [c for x in sessions for c in x.calls]
    out["starts"], out["continuations"] = len(sessions), len(calls) - len(sessions)
    out["restarts"] = sum(1 for c in calls if c.call_index and c.reusable_prefix_tokens == 0)
    return cell.name, policy, ids, out


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=None, help="only cells whose name contains one of these (comma-separated)")
    p.add_argument("--peers", action="store_true", help="also each peer with and without ids")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="the matrix's workload seed (matrix.cells)")
    p.add_argument("--out", type=Path, default=Path("results/session_inference.md"))
    args = p.parse_args()
    only = [c.strip() for c in args.cells.split(",")] if args.cells else None
    grid = [c for c in matrix.cells(args.seed) if not only or any(o in c.name for o in only)]
    if not grid:
        raise SystemExit(f"--cells: no matrix cell matches {args.cells!r}")
    policies = [matrix.OURS, *(configs.PEERS if args.peers else ())]
    tasks = sorted(((c, pol, ids) for c in grid for pol in policies for ids in ("named", "none")),
                   key=lambda t: -(t[0].sessions * t[0].depth * (t[0].instances ** 0.5)))
    res: dict[tuple[str, str, str], dict] = {}
    started = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        for k, (name, pol, ids, out) in enumerate(pool.map(task, tasks, chunksize=1), 1):
            res[(name, pol, ids)] = out
            print(f"  [{k}/{len(tasks)}] {name} / {pol} / ids {ids}: SCT p95 {out['sct_p95']:.1f} s "
                  f"{out['kinds'] or ''} ({out['run_s']:.1f} s)", file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    cmd = "python bench/matrix_session_ids.py" + (f" --cells {args.cells}" if args.cells else "") + \
        (" --peers" if args.peers else "") + (f" --seed {args.seed}" if args.seed else "")
    section = PEERS_SECTION if args.peers else SECTION
    lines = [section, "", f"`{cmd}` ({wall:.0f} s wall, {args.workers} workers). Each configuration without ids "
             "over the same configuration with ids, SCT p50 / p95 (lower is better; the goal: talaria no more "
             f"than {GOAL:.0%} slower in every cell). Not attributed: continuations talaria's gateway started a "
             "new session with (none merged into another session, none forked), of them restarts (compaction "
             "at the context cap: the prompt reuses nothing).", ""]
    head = "| cell | talaria p50 | talaria p95 | continuations | not attributed (restarts) |"
    if args.peers:
        head += "".join(f" {peer} p95 |" for peer in configs.PEERS)
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    misses, r50s, r95s, merged = [], [], [], 0
    for c in grid:
        a, b = res[(c.name, matrix.OURS, "none")], res[(c.name, matrix.OURS, "named")]
        r50, r95 = ratio(a["sct_p50"], b["sct_p50"]), ratio(a["sct_p95"], b["sct_p95"])
        r50s.append(r50)
        r95s.append(r95)
        if max(r50, r95) > 1 + GOAL:
            misses.append(f"{c.name} ({max(r50, r95):.3f})")
        k = a["kinds"]
        merged += a["merged"] + k.get("forked", 0)
        row = (f"| {c.name} | {r50:.3f} | {r95:.3f} | {a['continuations']:,} | "
               f"{k.get('new', 0) - a['starts']} ({a['restarts']}) |")
        for peer in configs.PEERS if args.peers else ():
            row += f" {ratio(res[(c.name, peer, 'none')]['sct_p95'], res[(c.name, peer, 'named')]['sct_p95']):.3f} |"
        lines.append(row)
    geo = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
    lines += ["", f"No more than {GOAL:.0%} slower (p50 and p95): {len(grid) - len(misses)} of {len(grid)} cells"
              + (f"; slower: {', '.join(misses)}." if misses else ".")
              + f" Geomean over the cells: p50 {geo(r50s):.3f}, p95 {geo(r95s):.3f}; range p50 {min(r50s):.3f}-"
              f"{max(r50s):.3f}, p95 {min(r95s):.3f}-{max(r95s):.3f}. Calls merged into another session "
              f"or forked: {merged}.", ""]
    print("\n".join(lines))
    text = args.out.read_text() if args.out.exists() else ""
    head_text, _, rest = text.partition(section)
    tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
    args.out.write_text(head_text.rstrip("\n") + ("\n\n" if head_text.strip() else "") + "\n".join(lines) + tail)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
