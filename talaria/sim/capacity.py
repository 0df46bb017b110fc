"""`talaria sim capacity`: the fewest instances each deployment needs to hold an SCT p95 SLO.

    talaria sim capacity --trace T --profile P [--catalogue N|FILE] [--gaps G] --slo-p95 S
        [--policies all|a,b,...] [--max-instances M] [--seed N] --json J

Per deployment of services/configs.py (`all`: talaria and `configs.peer_deployments()`), the
least instance count at which every call completes and SCT p95 <= S (seconds, or `Kx` of
the trace's zero-wait SCT p95). How the search runs is `capacity`'s docstring; the JSON it
writes is in docs/capacity.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from talaria.services import configs
from talaria.shared.stats import quantile
from talaria.sim.catalogue import CatalogueError, by_popularity, resolve
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.deployment import place
from talaria.sim.instance_bound import instances_lower_bound
from talaria.sim.matrix import demand_s
from talaria.sim.metrics import oracle_sct, summarise
from talaria.sim.profiles import PROFILES, ServerProfile, get_profile
from talaria.sim.result_json import write_json
from talaria.traces.format import Session, TraceFormatError
from talaria.traces.gaps import GapModel, default_gap_spec, parse_gap_model
from talaria.traces.load import load_trace

OURS = "talaria"
DEFAULT_MAX_INSTANCES = 64  # [asm] beyond one pool per model of a 50-model catalogue


@dataclass(frozen=True)
class Point:
    """One run of one deployment at one instance count."""

    instances: int
    sct_p50: float
    sct_p95: float
    rejected: int
    complete: bool  # every call of every session completed
    run_s: float = 0.0
    # Returns that recomputed their context (a move or a loss: one that stayed finds its KV on
    # device or host) and those that pulled it from another instance instead (issue 40).
    recomputes: int = 0
    migrations: int = 0
    # Each session's SCT (inf: incomplete), for a paired comparison of two deployments on the
    # same sessions (bench/migration_capacity.py); not in the JSON.
    scts: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    def meets(self, slo_p95_s: float) -> bool:
        return self.complete and self.sct_p95 <= slo_p95_s

    def as_dict(self) -> dict:
        return {"instances": self.instances, "sct_p50": self.sct_p50, "sct_p95": self.sct_p95,
                "rejected": self.rejected, "complete": self.complete, "run_s": round(self.run_s, 2),
                "recomputes": self.recomputes, "migrations": self.migrations}


def least_instances(run: Callable[[int], Point], slo_p95_s: float, start: int, max_instances: int,
                    guess: int | None = None) -> tuple[int | None, list[Point]]:
    """(least instance count meeting the SLO or None within `max_instances`, every run in
    order). Counts below `start` are known to miss (a lower bound). From `guess` (default
    `start`; another deployment's answer is a good one): while runs miss, double upwards;
    while they meet, step down by 1, 2, 4, ... (not below `start`); then bisect between the
    last miss and the first meet. Assumes more instances never raise SCT p95; each count runs
    at most once."""
    if start > max_instances:
        return None, []
    runs: dict[int, Point] = {}

    def at(n: int) -> bool:
        if n not in runs:
            runs[n] = run(n)
        return runs[n].meets(slo_p95_s)

    hi = min(max(start, guess or start), max_instances)
    lo = start - 1  # the largest count known to miss
    if at(hi):
        step = 1
        while hi - step > lo:  # gallop down to a miss or the lower bound
            if not at(hi - step):
                lo = hi - step
                break
            hi, step = hi - step, 2 * step
    else:
        while not at(hi):
            if hi >= max_instances:
                return None, list(runs.values())
            lo, hi = hi, min(2 * hi, max_instances)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if at(mid) else (mid, hi)
    return hi, list(runs.values())


def parse_slo(text: str, bound_p95_s: float) -> float:
    """`--slo-p95`: seconds (`900`, `900s`) or `Kx` of the zero-wait SCT p95 bound."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) if t.endswith(("x", "s")) else float(t)
    except ValueError:
        raise ValueError(f"{text!r}: expected seconds (e.g. 900) or a multiple of the zero-wait bound (e.g. 2x)") \
            from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r}: must be positive")
    return value * bound_p95_s if t.endswith("x") else value


def parse_policies(text: str) -> list[str]:
    """`--policies`: `all` (talaria and every peer deployment) or names."""
    if text.strip() == "all":
        return [OURS, *configs.peer_deployments()]
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in configs.CONFIGS]
    if unknown or not names:
        raise ValueError(f"unknown configuration(s) {unknown or [text]}; known: {', '.join(configs.names())}")
    return list(dict.fromkeys(names))


def zero_wait_p95(sessions: list[Session], server: ServerProfile, gaps: GapModel) -> float:
    return quantile([oracle_sct(s, server, gaps) for s in sessions], 0.95)


class Runner:
    """Runs one deployment at N instances on the trace, as `sim run --config NAME` does."""

    def __init__(self, sessions: list[Session], server: ServerProfile, gaps: GapModel, slo_p95_s: float) -> None:
        self.sessions, self.server, self.gaps, self.slo = sessions, server, gaps, slo_p95_s
        self.models = sorted({s.model for s in sessions})
        self.count = 0

    def __call__(self, name: str, n: int) -> Point:
        cfg = configs.get(name)
        sched = cfg.sim_scheduler()
        demand = {m: d for m, d in demand_s(self.sessions, self.server, sched.max_batch).items() if m in self.models}
        placed = place(cfg, demand, n, len(demand))
        config = RunConfig(self.server, n, cfg.policy, placed.policy_config, sched, self.gaps, label=f"{name}@{n}",
                           pinned=placed.pinned, hot_pools=placed.online, hot_pools_z=cfg.hot_pools_z,
                           stop_above_p95_s=self.slo)
        started = time.perf_counter()
        s = summarise(simulate(self.sessions, config))
        kv = s["kv_sources"]
        p = Point(n, s["sct_p50"], s["sct_p95"], s["rejected"], bool(s["complete"]), time.perf_counter() - started,
                  kv.get("recompute", 0), kv.get("migrated", 0),
                  {e["session"]: math.inf if e["sct"] is None else e["sct"] for e in s["per_session"]})
        self.count += 1
        print(f"  capacity [{self.count}] {name} @ {n} instances: SCT p50 {p.sct_p50:.0f} s p95 {p.sct_p95:.0f} s, "
              f"rejected {p.rejected}, recomputes {p.recomputes}, migrations {p.migrations}, "
              f"{'complete' if p.complete else 'INCOMPLETE'}, "
              f"{'meets' if p.meets(self.slo) else 'misses'} the SLO ({p.run_s:.1f} s)", file=sys.stderr, flush=True)
        return p


def capacity(sessions: list[Session], server: ServerProfile, gaps: GapModel, slo: str, policies: list[str],
             max_instances: int) -> dict:
    """The `sim capacity` result (module doc; docs/capacity.md).

        talaria sim capacity --trace T --profile P [--catalogue N|FILE] [--gaps G] --slo-p95 S
            [--policies all|a,b,...] [--max-instances M] [--seed N] --json J

    Per deployment (a configuration of services/configs.py, deployed as `sim run --config NAME`
    deploys it), the least instance count at which every call completes and SCT p95 <= S. `S`
    is seconds or `Kx`: K times the trace's zero-wait SCT p95 (metrics.oracle_sct per session:
    gaps plus each call alone, no queue, no switch; results/matrix_bound.md's bound).
    `--policies all` is `talaria` and every peer deployment of the registry (`configs.peer_deployments`,
    read at run time). The search (`least_instances`) starts at the instance lower bound
    (instance_bound.py) for the first deployment and at the previous one's answer for the next,
    doubles up while runs miss, steps down while they meet, then bisects; it assumes more
    instances never hurt, and records every run so the assumption can be checked. A run stops
    once the SLO is out of reach (RunConfig.stop_above_p95_s): the same verdict, in seconds. Where talaria and a
    peer both run, talaria also runs at the best peer's point (the issue's comparison there).
    A progress line per run goes to stderr; docs/capacity.md has the JSON it writes.
    """
    bound = zero_wait_p95(sessions, server, gaps)
    slo_s = parse_slo(slo, bound)
    max_batch = configs.get(OURS).sim_scheduler().max_batch
    lower = instances_lower_bound(sessions, server, slo_s, max_batch, gaps)
    print(f"capacity: {len(sessions)} sessions, {len(server.models)} models; zero-wait SCT p95 {bound:.0f} s, "
          f"SLO p95 {slo_s:.0f} s; instance lower bound {lower if lower is not None else 'none (SLO below zero wait)'}",
          file=sys.stderr, flush=True)
    runner = Runner(sessions, server, gaps, slo_s)
    out = {"slo_p95_s": slo_s, "bound_p95_s": bound, "instances_lower_bound": lower, "max_instances": max_instances,
           "sessions": len(sessions), "models": len({s.model for s in sessions}), "policies": {}}
    runs: dict[str, list[Point]] = {}
    guess = None
    for name in policies:  # each from the last answer: deployments tend to need similar counts
        k, runs[name] = (None, []) if lower is None else least_instances(
            lambda n: runner(name, n), slo_s, max(1, lower), max_instances, guess)
        out["policies"][name] = {"instances": k}
        guess = k or guess
    peers = [p for p in policies if p != OURS and out["policies"][p]["instances"] is not None]
    if OURS in runs and peers:  # talaria at the best peer's point too (docstring)
        best = min(out["policies"][p]["instances"] for p in peers)
        if all(r.instances != best for r in runs[OURS]):
            runs[OURS].append(runner(OURS, best))
    for name, entry in out["policies"].items():
        ordered = sorted(runs[name], key=lambda r: r.instances)
        # the search's assumption, checked on its own runs: no count meets the SLO below one that misses
        entry["monotone"] = not any(a.meets(slo_s) and not b.meets(slo_s)
                                    for k, a in enumerate(ordered) for b in ordered[k + 1:])
        if not entry["monotone"]:
            print(f"capacity: {name}: a larger count missed the SLO where a smaller one met it; "
                  "its answer assumes otherwise (see its runs)", file=sys.stderr, flush=True)
        at_k = [r for r in runs[name] if r.instances == entry["instances"]]
        entry["sct_p50"] = at_k[0].sct_p50 if at_k else None
        entry["sct_p95"] = at_k[0].sct_p95 if at_k else None
        entry["runs"] = [r.as_dict() for r in sorted(runs[name], key=lambda r: r.instances)]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="normalised JSONL trace (bench/capacity.py trace writes one)")
    p.add_argument("--profile", default="paper-tp8", choices=sorted(PROFILES))
    p.add_argument("--catalogue", default=None, metavar="N|FILE",
                   help="N models calibrated like the matrix's, or a catalogue file (docs/capacity.md); the "
                        "trace's models map onto them by popularity when the names differ")
    p.add_argument("--gaps", default=None,
                   help="as `sim run --gaps` (default: paper, or recorded for an exported trace)")
    p.add_argument("--slo-p95", required=True, help="SCT p95 target: seconds, or Kx of the zero-wait SCT p95 bound")
    p.add_argument("--policies", default="all", help="all (talaria + every peer deployment of services/configs.py) or NAME,NAME,...")
    p.add_argument("--max-instances", type=int, default=DEFAULT_MAX_INSTANCES)
    p.add_argument("--seed", type=int, default=0, help="the gap model's seed")
    p.add_argument("--json", required=True, help="where to write the result")


def load_inputs(trace: str, profile: str, catalogue: str | None, gaps: str | None,
                seed: int) -> tuple[list[Session], ServerProfile, GapModel]:
    """(sessions on the served models, server, gap model) of `sim run`/`sim capacity`'s flags;
    ValueError with a one-line message naming the flag otherwise."""
    try:
        sessions = load_trace(trace)
    except (TraceFormatError, OSError) as exc:
        raise ValueError(f"--trace: {exc}") from None
    if not sessions:
        raise ValueError(f"--trace: {trace} has no sessions")
    try:
        gap_model = parse_gap_model(gaps or default_gap_spec(sessions), seed)
    except ValueError as exc:
        raise ValueError(f"--gaps: {exc}") from None
    server = get_profile(profile)
    if catalogue:
        try:
            server = resolve(catalogue, server)
        except CatalogueError as exc:
            raise ValueError(str(exc)) from None
        sessions = by_popularity(sessions, list(server.models))
    unknown = sorted({s.model for s in sessions} - set(server.models))
    if unknown:
        raise ValueError(f"profile {server.name!r} has no model(s) {unknown}; give --catalogue N or FILE")
    return sessions, server, gap_model


def run_from_args(args) -> int:
    try:
        sessions, server, gaps = load_inputs(args.trace, args.profile, args.catalogue, args.gaps, args.seed)
        policies = parse_policies(args.policies)
        parse_slo(args.slo_p95, 1.0)  # a bad value fails before any run
        if args.max_instances < 1:
            raise ValueError(f"--max-instances {args.max_instances}: expected a positive integer")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = capacity(sessions, server, gaps, args.slo_p95, policies, args.max_instances)
    command = " ".join(["talaria sim capacity", f"--trace {args.trace}", f"--profile {args.profile}",
                        *([f"--catalogue {args.catalogue}"] if args.catalogue else []),
                        *([f"--gaps {args.gaps}"] if args.gaps else []), f"--slo-p95 {args.slo_p95}",
                        f"--policies {args.policies}", f"--max-instances {args.max_instances}",
                        f"--seed {args.seed}", f"--json {args.json}"])
    result.update(trace=args.trace, profile=args.profile, catalogue=args.catalogue, gaps=gaps.describe(),
                  command=command, wall_s=round(time.perf_counter() - started, 1))
    lb = result["instances_lower_bound"]
    print(f"SLO SCT p95 {result['slo_p95_s']:.0f} s ({result['slo_p95_s'] / result['bound_p95_s']:.2f}x the zero-wait "
          f"bound {result['bound_p95_s']:.0f} s); instance lower bound: {lb if lb is not None else 'none'}")
    for name, e in result["policies"].items():
        k = e["instances"]
        print(f"  {name:<24} {'> ' + str(args.max_instances) if k is None else k:>6} instances"
              + (f"  (SCT p50 {e['sct_p50']:.0f} s, p95 {e['sct_p95']:.0f} s)" if k is not None else ""))
    print(f"{sum(len(e['runs']) for e in result['policies'].values())} runs in {result['wall_s']:.0f} s")
    write_json(result, Path(args.json))
    return 0
