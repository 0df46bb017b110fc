"""The paper's experiments, one function each, plus `all`.

    python -m talaria.sim.experiments fixed-replay|router|tau-sweep|scale|matrix|all|report \
        [--json PATH] [--out results/] [--quick] [--no-report] [--workers N] [--cells SUBSTR,...]

Every simulated instance is the instance agent's own core (`AgentCore`, its RoundScheduler)
on the simulator's executor. Each experiment writes its entry of `<out>/sim_report.json`
(per configuration: SCT and TTFT p50/p95, `oracle`, counters), then the Markdown report with
plots (talaria/sim/report.py; `--no-report` skips it, `report` only rewrites it). `matrix`
(talaria/sim/matrix.py) keeps its own matrix.json, matrix.md and heatmap; `all` leaves it out.
`router` and `scale` run the peers deployed as they are deployed (deployment.py) and talaria
with its own machinery; a policy the registry lacks is skipped and listed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from talaria.services import configs
from talaria.services.router.policy.base import PolicyConfig
from talaria.shared.stats import quantile
from talaria.sim.result_json import write_json
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.deployment import place
from talaria.sim.executor import instance_config
from talaria.sim.metrics import summarise
from talaria.sim.profiles import PAPER_TP8, ROUTER_TP4, catalogue
from talaria.sim.schedule_bound import schedule_bound_scts
from talaria.sim.workloads import fixed_replay, router_testbed, synthetic_catalogue
from talaria.traces.gaps import GapModel
from talaria.sim.matrix import (ABLATIONS, FORECAST_POOLS, PEER_SPLITS, POLICIES, SENSITIVITY, STATIC_SPLITS,
                                parse_seeds, run_matrix)
from talaria.sim.report import write_report
from talaria.sim.matrix_report import write_outputs

CONFIGS = ("talaria", "no-sp", "no-hkvr", "h2d-only", "round-only")
# The faithful peers (services/router/policy/, each citing its source), each deployed as it is
# deployed (deployment.py, `deployed`), then talaria with its own machinery. The model-blind
# routers they replace run as labelled extras ("transplanted": every instance a cold instance
# that time-shares every model, the deployment no one runs; the earlier tables' baselines).
PEERS = configs.PEERS
TRANSPLANTED = ("least-pressure", "session-sticky", "prefix-aware", "kv-cost")
ROUTER_POLICIES = (*PEERS, "talaria", *(f"{p} (transplanted)" for p in TRANSPLANTED))
# The configuration (services/configs.py) of each label that is not itself a configuration's name.
CONFIG_OF = {f"{p} (transplanted)": p for p in TRANSPLANTED}
# Scale: the transplanted extras are left out (least-pressure and kv-cost took 530 s and a
# 300 s cap per run; their last numbers are in the git history of the scale results, now
# the `scale` entry of results/sim_report.json).
# talaria-forecast-pools: talaria given the peers' forecast pool split (the hot-pool ablation).
SCALE_POLICIES = (*PEERS, "talaria", FORECAST_POOLS)
TAUS = (0.0, 0.5, 1.0, 2.0, 5.0)
ROUTER_SEEDS = 8  # gap-model seeds per router-testbed point (see router_exp)
PAPER_GAPS = GapModel("paper", 10.0, seed=0)
# The router's overload mode for every simulated experiment. 'reject' drops a first call
# whose recompute alone exceeds gamma * T_TTFT on every instance (25K-token prompts cost
# ~4.3 s to recompute, and a round already carries other models' work), and the retry cap
# then abandons its session, which shortens that policy's SCTs unfairly. 'queue' routes
# it anyway and lets the instance report the deadline risk, so every policy completes
# every call and SCTs compare like with like.
OVERLOAD = "queue"
FALLBACK = "least-loaded"  # used when a listed baseline is not registered yet


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _available(wanted) -> tuple[list[str], list[str]]:
    names = set(configs.names())
    have = [p for p in wanted if CONFIG_OF.get(p, p) in names]
    missing = [p for p in wanted if CONFIG_OF.get(p, p) not in names]
    if FALLBACK in names and FALLBACK not in have and "least-pressure" not in names:
        have.insert(0, FALLBACK)
    return have, missing


def capacity_bound_profile(server):
    """The free-memory run (half of the capacity-aware bound, see fixed_replay_exp): the same
    server's compute with memory and transfers out of the way — HBM for every model's weights and every session's KV, weights and KV moved at
    no cost, so a switch costs only its fixed phases (~34 ms) and every return finds its KV.
    Rounds still time-share the models, which the oracle (no queueing at all) ignores."""
    return replace(server, name=f"{server.name}-capacity-bound", hbm_per_gpu_bytes=server.hbm_per_gpu_bytes * 1000,
                   host_bytes=server.host_bytes * 1000, h2d_bytes_s=1e18, d2d_bytes_s=1e18, kv_restore_bytes_s=1e18)


def capacity_aware_bound(sessions, config: RunConfig, result) -> tuple[dict, dict]:
    """The capacity-aware bound of a run (`result` of `config`, run with `log_actions`): at
    each percentile the lower of its schedule bound (the run's own schedule with every weight
    and KV transfer free: below the run per session by construction, schedule_bound.py) and
    the same scheduler and policy on a server with free memory (capacity_bound_profile;
    another schedule, so alone it is no bound). Returns (bound, the free-memory run's summary)."""
    sched = list(schedule_bound_scts(result).values())
    free_cfg = replace(config, server=capacity_bound_profile(config.server), label="capacity-bound",
                       log_actions=False, progress=False)
    free_result = simulate(sessions, free_cfg)
    free = summarise(free_result)
    free["switch_phases_s"] = _phase_sums(free_result)
    bound = {
        "schedule": {"sct_p50": quantile(sched, 0.5), "sct_p95": quantile(sched, 0.95)},
        "free_memory_run": {"sct_p50": free["sct_p50"], "sct_p95": free["sct_p95"]},
    }
    for q in ("sct_p50", "sct_p95"):
        bound[q] = min(bound["schedule"][q], free[q])
    return bound, free


def deployed(policy: str, pc: PolicyConfig, sessions, server, instances: int) -> dict:
    """RunConfig fields that deploy experiment label `policy` (its configuration, CONFIG_OF,
    services/configs.py) with the router knobs `pc`, as it is deployed (deployment.place): a
    peer gets per-model pools split by the workload's offered demand where the models fit the
    instances, else serverless on-demand loading; talaria starts its hot pools from an even
    split and resizes them online where the models fit, else every instance is a cold talaria
    agent; a transplanted router routes model-blind over cold instances. Also returns
    `deployment`, a label for the tables."""
    from talaria.sim.matrix import demand_s

    cfg = replace(configs.get(CONFIG_OF.get(policy, policy)), router=pc)
    models = len(server.models)
    static = cfg.pools in STATIC_SPLITS
    demand = demand_s(sessions, server, instance_config().max_batch) if static else {m: 1.0 for m in server.models}
    placed = place(cfg, demand, instances, models)
    hot = "/".join(str(placed.pinned.count(m)) for m in sorted(set(placed.pinned)))
    d = {"policy": cfg.policy, "policy_config": placed.policy_config, "pinned": placed.pinned,
         "hot_pools": placed.online}
    if cfg.pools == "per-model":
        return {**d, "deployment": "serverless (on-demand loading)" if placed.policy_config.serverless
                else f"per-model pools ({hot}, by demand)"}
    if cfg.pools == "forecast" and placed.pinned:
        return {**d, "deployment": f"the peers' per-model pools ({hot}, by demand; ablation)"}
    if placed.online:
        return {**d, "deployment": "online hot pools (even start)"}
    return {**d, "deployment": "cold instances (time-share every model)"
            + (" (transplanted)" if cfg.policy != "talaria" else "")}


def _run_config(server, instances: int, policy: str, pc: PolicyConfig, sessions, gaps, **kw) -> tuple[RunConfig, str]:
    d = deployed(policy, pc, sessions, server, instances)
    cfg = RunConfig(server, instances, d["policy"], d["policy_config"], instance_config(), gaps,
                    pinned=d["pinned"], hot_pools=d["hot_pools"], **kw)
    return cfg, d["deployment"]


def fixed_replay_exp(seed: int = 0) -> dict:
    sessions = fixed_replay()
    gaps = replace(PAPER_GAPS, seed=seed)
    out: dict = {"experiment": "fixed-replay", "configs": {}}
    for name in CONFIGS:
        _log(f"fixed-replay: {name}")
        cfg = RunConfig(PAPER_TP8, 1, FALLBACK, scheduler=instance_config(name), gaps=gaps, label=name,
                        log_actions=name == "talaria")
        result = simulate(sessions, cfg)
        out["configs"][name] = summarise(result)
        out["configs"][name]["switch_phases_s"] = _phase_sums(result)
        if name == "talaria":
            talaria_cfg, talaria_run = cfg, result
    _log("fixed-replay: capacity-bound")
    out["bound"], out["configs"]["capacity-bound"] = capacity_aware_bound(sessions, talaria_cfg, talaria_run)
    t, r = out["configs"]["talaria"], out["configs"]["round-only"]
    paired = [
        (a["sct"], b["sct"]) for a, b in zip(t["per_session"], r["per_session"]) if a["sct"] and b["sct"]
    ]
    out["paired"] = {
        "improved": sum(1 for a, b in paired if a < b),
        "total": len(paired),
        "speedup_p50": r["sct_p50"] / t["sct_p50"],
        "speedup_p95": r["sct_p95"] / t["sct_p95"],
        "talaria_over_oracle_p50": t["sct_p50"] / t["oracle"]["sct_p50"],
        "talaria_over_capacity_bound_p50": t["sct_p50"] / out["bound"]["sct_p50"],
    }
    return out


def _phase_sums(result) -> dict[str, float]:
    """Seconds spent in each switch phase (P1-P5, kv_park, kv_unpark, kv_resume), all instances."""
    sums: dict[str, float] = {}
    for inst in result.instances:
        for sw in inst.switches:
            for k, v in sw.phases.items():
                sums[k] = sums.get(k, 0.0) + v
    return sums


def router_exp(loads=("low", "medium", "high"), tau: float = 1.0, seed: int = 0, seeds: int = ROUTER_SEEDS) -> dict:
    """Each policy at each load, once per gap seed. The entry is seed `seed`'s full summary
    (tables, plots) plus `seeds`: SCT/TTFT of every seed and their means. With 30
    model-sessions, p95 is the 29th of 30 SCTs, so one seed's p95 is one session's luck;
    the goals are judged on the mean over seeds."""
    policies, missing = _available(ROUTER_POLICIES)
    out: dict = {"experiment": "router", "skipped": missing, "seeds": seeds, "loads": {}}
    for load in loads:
        sessions = router_testbed(load)
        out["loads"][load] = {}
        for policy in policies:
            _log(f"router: {load} / {policy} ({seeds} gap seeds)")
            gap_seeds = sorted({seed, *range(seeds)})
            runs = {}
            for k in gap_seeds:
                cfg, how = _run_config(ROUTER_TP4, 2, policy, PolicyConfig(lease_timeout_s=tau, overload=OVERLOAD),
                                       sessions, replace(PAPER_GAPS, seed=k), label=f"{load}/{policy}")
                runs[k] = summarise(simulate(sessions, cfg))
            entry = runs[seed]
            entry["deployment"] = how
            entry["seeds"] = {"gap_seeds": gap_seeds}
            for key in ("sct_p50", "sct_p95", "ttft_p50", "ttft_p95"):
                values = [runs[k][key] for k in gap_seeds]
                entry["seeds"][key] = values
                entry["seeds"][f"{key}_mean"] = sum(values) / len(values)
            out["loads"][load][policy] = entry
    return out


def tau_sweep_exp(load: str = "high", seed: int = 0) -> dict:
    policy = "talaria" if "talaria" in configs.names() else None
    out: dict = {"experiment": "tau-sweep", "load": load, "policy": policy, "points": {}}
    if policy is None:
        out["skipped"] = "the router registry has no 'talaria' policy yet"
        return out
    sessions = router_testbed(load)
    gaps = replace(PAPER_GAPS, seed=seed)
    points = [(f"{t:g}", PolicyConfig(lease_timeout_s=t, overload=OVERLOAD)) for t in TAUS]
    points.append(("adaptive", PolicyConfig(lease_timeout_s=1.0, adaptive_lease=True, overload=OVERLOAD)))
    # With kv_home_admits a return passes admission at its KV home with or without a lease,
    # which is part of what the lease did in the paper; these two points show the sweep's
    # ends under the paper's admission rule.
    for t in (0.0, 1.0):
        points.append((f"{t:g}, paper admission", PolicyConfig(lease_timeout_s=t, kv_home_admits=False,
                                                                overload=OVERLOAD)))
    for label, pc in points:
        _log(f"tau-sweep: tau={label}")
        cfg = RunConfig(ROUTER_TP4, 2, policy, pc, instance_config(), gaps,
                        label=f"tau={label}")
        out["points"][label] = summarise(simulate(sessions, cfg))
    return out


def scale_exp(sessions: int = 10_000, instances: int = 64, models: int = 20,
              arrival_rate_s: float = 0.25, seed: int = 0, progress: bool = True,
              max_wall_s: float | None = None, policies: list[str] | None = None) -> dict:
    """`arrival_rate_s` is sessions per second (Poisson; 0.25 = a session every 4 s, which the
    64-instance cluster sustains; 4.0 overloads it so badly no policy finishes). `max_wall_s`
    caps each policy's run;
    a capped run is reported with `complete: false`, `capped: true` and the calls it finished.
    `policies` runs a subset (default: all of SCALE_POLICIES)."""
    policies, missing = _available(policies or SCALE_POLICIES)
    server = catalogue(PAPER_TP8, models)
    work = synthetic_catalogue(sessions, list(server.models), arrival_rate_s, 1.0, seed)
    out: dict = {
        "experiment": "scale", "skipped": missing, "sessions": sessions, "instances": instances,
        "models": models, "arrival_rate_s": arrival_rate_s, "zipf_s": 1.0, "policies": {},
    }
    for policy in policies:
        _log(f"scale: {policy} ({sessions} sessions, {instances} instances, {models} models)")
        cfg, how = _run_config(server, instances, policy, PolicyConfig(overload=OVERLOAD), work,
                               replace(PAPER_GAPS, seed=seed), label=f"scale/{policy}", progress=progress,
                               max_wall_s=max_wall_s)
        started = time.perf_counter()
        result = simulate(work, cfg)
        summary = summarise(result)
        summary["run_time_s"] = time.perf_counter() - started
        summary["deployment"] = how
        summary["repins"] = result.router.repins
        summary["events"] = result.events
        summary["virtual_s"] = result.virtual_s
        summary["calls_total"] = sum(len(s.calls) for s in work)
        summary["capped"] = max_wall_s is not None and not summary["complete"] and summary["run_time_s"] >= max_wall_s
        summary.pop("per_session")
        summary.pop("ttft_samples")
        summary["switch"].pop("samples")
        out["policies"][policy] = summary
        _log(f"  {policy}: {summary['run_time_s']:.1f} s wall, SCT p50 {summary['sct_p50']:.1f} s")
    return out


EXPERIMENTS = {
    "fixed-replay": fixed_replay_exp,
    "router": router_exp,
    "tau-sweep": tau_sweep_exp,
    "scale": scale_exp,
}


SIM_JSON = "sim_report.json"  # every experiment but the matrix, keyed by name: one file, not one each


def _stored(out_dir: Path, strict: bool = False) -> dict:
    """The experiments already in `out_dir`'s SIM_JSON ({} when none; a broken file stops a
    `strict` reader with a one-line error, and is replaced by a writer)."""
    path = out_dir / SIM_JSON
    if not path.exists():
        return {}
    try:
        found = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        if strict:
            raise SystemExit(f"{path}: not valid JSON ({exc}); re-run the experiments") from None
        return {}
    return found if isinstance(found, dict) else {}


def _merge_scale(old: dict | None, new: dict) -> dict:
    """A run of some policies (`--scale-policies`) adds to the last scale result when both
    ran the same workload, so slow policies can get their own wall cap; else it replaces it."""
    same = ("sessions", "instances", "models", "arrival_rate_s", "zipf_s")
    if not isinstance(old, dict):
        return new
    if any(old.get(k) != new.get(k) for k in same) or not isinstance(old.get("policies"), dict):
        return new
    merged = {**old, "policies": {**old["policies"], **new["policies"]}}
    merged["skipped"] = sorted(set(new.get("skipped", [])) - set(merged["policies"]))
    order = [p for p in SCALE_POLICIES if p in merged["policies"]]
    merged["policies"] = {p: merged["policies"][p] for p in order + [p for p in merged["policies"] if p not in order]}
    return merged


def run(names: list[str], out_dir: Path, json_path: Path | None, quick: bool,
        scale_sessions: int | None = None, scale: dict | None = None, matrix: dict | None = None) -> dict:
    results: dict = {}
    for name in names:
        if name == "matrix":
            results[name] = run_matrix(**(matrix or {}))
            _log(f"matrix: {results[name]['wall_s']:.0f} s wall; {write_outputs(results[name], out_dir)}")
            continue
        if name == "fixed-replay":
            results[name] = fixed_replay_exp()
        elif name == "scale" and quick:
            picked = (scale or {}).get("policies")
            results[name] = _merge_scale(_stored(out_dir).get("scale"), scale_exp(
                sessions=60, instances=4, models=4, arrival_rate_s=0.2, policies=picked))
        elif name == "scale":
            kw = {k: v for k, v in (scale or {}).items() if v is not None}
            if scale_sessions:
                kw["sessions"] = scale_sessions
            results[name] = _merge_scale(_stored(out_dir).get("scale"), scale_exp(**kw))
        else:
            results[name] = EXPERIMENTS[name]()
        stored = _stored(out_dir)
        stored.update({k: results[k] for k in results if k.startswith(name)})
        write_json({k: stored[k] for k in REPORTED if k in stored}, out_dir / SIM_JSON)
    if json_path is not None:
        write_json(results, json_path)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="talaria sim experiments", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", choices=[*EXPERIMENTS, "matrix", "all", "report"],
                        help="one experiment, all of them, or `report` (rewrite the report from the JSONs)")
    parser.add_argument("--json", type=Path, default=None, help="write every result here too")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--quick", action="store_true", help="small scale run (tests, smoke)")
    parser.add_argument("--scale-sessions", type=int, default=None,
                        help="sessions of the scale run (default 10,000)")
    parser.add_argument("--scale-rate", type=float, default=None,
                        help="scale run session arrivals per second (default 0.25: one every 4 s)")
    parser.add_argument("--scale-cap-s", type=float, default=None,
                        help="wall-clock cap per scale policy run (reported as capped)")
    parser.add_argument("--scale-policies", default=None,
                        help="comma-separated subset of the scale policies; merged into an existing "
                             "scale entry of the same workload")
    parser.add_argument("--no-report", action="store_true")
    parser.add_argument("--workers", type=int, default=2, help="matrix: parallel processes (default 2)")
    parser.add_argument("--cells", default=None, help="matrix: only cells whose name contains one of these")
    parser.add_argument("--peer-split", choices=PEER_SPLITS, default="exact",
                        help="matrix: size the peers' pools on the run's own demand (exact, the published "
                             "table) or on another draw of the same workload (history)")
    parser.add_argument("--session-ids", choices=("named", "none"), default="named",
                        help="matrix: the clients name their sessions, or none (talaria infers them, a peer's "
                             "router has no key: talaria/sim/anonymous_sessions.py)")
    parser.add_argument("--seeds", default=None, metavar="A,B,C",
                        help="matrix: run every cell on each of these workload seeds (matrix.json's `matrix` key; "
                             "matrix.md's across-seeds table with confidence intervals); held out: "
                             "1000,2000,3000 (talaria/sim/matrix.py HELD_OUT_SEEDS)")
    parser.add_argument("--ablations", action="store_true",
                        help="matrix: also run talaria without leases and without its instance mechanisms "
                             "(the report's mechanism column)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="matrix: also run our configuration with each remaining constant halved and doubled")
    parser.add_argument("--configs", default="", metavar="NAME,...",
                        help="matrix: also run these named configurations (services/configs.py; "
                             "NAME[knob=value] changes a knob)")


REPORTED = ("fixed-replay", "router", "tau-sweep", "scale", "matrix")


def load_results(out_dir: Path) -> dict:
    """Every experiment in `out_dir` (the report is always written from all of them)."""
    found = {k: v for k, v in _stored(out_dir, strict=True).items() if k in REPORTED}
    path = out_dir / "matrix.json"
    if path.exists():
        try:
            found["matrix"] = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}: not valid JSON ({exc}); re-run the matrix") from None
    return found


def _extra_configs(args) -> tuple[str, ...]:
    """`--configs`: each checked now (a bad name or knob stops before any run), in order, once."""
    wanted = [c.strip() for c in (getattr(args, "configs", "") or "").split(",") if c.strip()]
    for label in wanted:
        try:
            configs.from_label(label)
        except configs.ConfigurationError as exc:
            raise SystemExit(f"--configs: {exc}") from None
    return tuple(dict.fromkeys(c for c in wanted if c not in POLICIES))


def run_from_args(args) -> int:
    if args.experiment != "report":
        names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
        picked = getattr(args, "scale_policies", None)
        unknown = [p for p in (picked or "").split(",") if p.strip() and p.strip() not in SCALE_POLICIES]
        if unknown:
            raise SystemExit(f"--scale-policies: unknown {', '.join(unknown)}; choose from {', '.join(SCALE_POLICIES)}")
        scale = {"arrival_rate_s": getattr(args, "scale_rate", None), "max_wall_s": getattr(args, "scale_cap_s", None),
                 "policies": [p.strip() for p in picked.split(",") if p.strip()] if picked else None}
        matrix = {"workers": getattr(args, "workers", 2),
                  "policies": POLICIES + tuple(a for a in ABLATIONS if a not in POLICIES
                                               and getattr(args, "ablations", False))
                  + (SENSITIVITY if getattr(args, "sensitivity", False) else ()) + _extra_configs(args),
                  "only": [c.strip() for c in args.cells.split(",")] if getattr(args, "cells", None) else None,
                  "peer_split": getattr(args, "peer_split", "exact"),
                  "session_ids": getattr(args, "session_ids", "named")}
        if getattr(args, "seeds", None):
            try:
                matrix["seeds"] = parse_seeds(args.seeds)
            except ValueError as exc:
                raise SystemExit(f"error: {exc}") from None
        run(names, args.out, args.json, args.quick, args.scale_sessions, scale, matrix)
    if not args.no_report:
        path = write_report(load_results(args.out), args.out)
        _log(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
