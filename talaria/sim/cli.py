"""`talaria sim ...`: run one simulation, the experiments, or the trace converter.

    talaria sim run --trace T.jsonl[.xz]|fixed-replay --profile paper-tp8 --config NAME [--set KNOB=VALUE] \
        [--instances N] [--policy NAME --deploy shared|as-deployed --ablation A --tau S] \
        [--gaps paper|recorded[:cap]|rescaled:F[:cap]] [--model-map auto|A=B,...] [--seed N] [--json OUT] \
        [--bound] [--no-session-ids] [--catalogue N|FILE]
    talaria sim capacity --trace T --slo-p95 S|Kx --json J [...]   (capacity.py, docs/capacity.md)

`--config NAME` runs a named configuration (services/configs.py) as it is deployed; `--policy`,
`--deploy`, `--pools`, `--ablation`, `--tau` are the older spellings of the same choices.
`--bound` prints the capacity-aware bound beside the run (experiments.capacity_aware_bound):
how far the policy is from what the hardware allows on this traffic.

A raw WEKA kv-cache-tester file is converted on the way in (traces/weka.py).
    talaria sim experiments fixed-replay|router|tau-sweep|scale|all|report [--out results/] [--json P]
    talaria sim convert WEKA.jsonl.xz OUT.jsonl [--subagents separate|drop] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from talaria.services import configs
from talaria.shared.ablations import ABLATIONS, mechanisms
from talaria.sim.result_json import write_json
from talaria.sim import experiments
from talaria.sim.cluster import RunConfig, simulate
from talaria.sim.metrics import summarise
from talaria.sim.profiles import PROFILES, get_profile
from talaria.sim.workloads import fixed_replay, on_model
from talaria.traces.format import Session, TraceFormatError
from talaria.traces.load import load_trace
from talaria.traces.gaps import default_gap_spec, parse_gap_model
from talaria.traces.weka import convert_file
from talaria.sim.deployment import TALARIA_POOLS, Placement, place
from talaria.sim.matrix import demand_s
from talaria.sim.anonymous_sessions import without_ids
from talaria.sim import capacity
from talaria.sim.catalogue import CatalogueError, by_popularity, resolve as resolve_catalogue


def _run(args) -> int:
    if args.trace == "fixed-replay":
        sessions = fixed_replay()
    else:
        try:
            sessions = load_trace(args.trace)
        except (TraceFormatError, OSError) as exc:  # a missing or unreadable file: one line
            print(f"error: --trace: {exc}", file=sys.stderr)
            return 2
    try:
        gaps = parse_gap_model(args.gaps or default_gap_spec(sessions), args.seed)
    except ValueError as exc:
        print(f"error: --gaps: {exc}", file=sys.stderr)
        return 2
    server = get_profile(args.profile)
    if args.catalogue:
        try:
            server = resolve_catalogue(args.catalogue, server)
        except CatalogueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        sessions = by_popularity(sessions, list(server.models))
    try:
        sessions = map_models(sessions, args.model_map, sorted(server.models))
    except ValueError as exc:
        print(f"error: --model-map: {exc}", file=sys.stderr)
        return 2
    unknown = sorted({s.model for s in sessions} - set(server.models))
    if unknown:
        print(f"error: profile {server.name!r} has no model(s) {unknown}; known: {sorted(server.models)}; "
              "map them with --model-map auto or --model-map TRACE=SERVED,...", file=sys.stderr)
        return 2
    try:
        name, cfg = configuration(args)
    except configs.ConfigurationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sched = cfg.sim_scheduler()
    placed = Placement(cfg.router)
    if cfg.pools != "shared":
        # deployment.place: pools sized by the trace's offered demand of the models it names
        demand = {m: d for m, d in demand_s(sessions, server, sched.max_batch).items()
                  if any(x.model == m for x in sessions)}
        placed = place(cfg, demand, args.instances, len(demand))
    config = RunConfig(
        server, args.instances, cfg.policy, placed.policy_config,
        sched, gaps,
        label=name, progress=True, pinned=placed.pinned, log_actions=args.bound, hot_pools=placed.online,
        hot_pools_z=cfg.hot_pools_z,
        session_ids=without_ids(cfg.policy) if args.no_session_ids else "named",
    )
    result = simulate(sessions, config)
    summary = summarise(result)
    print(
        f"{summary['calls']} calls, {summary['sessions']} sessions ({summary['gap_model']}): "
        f"SCT p50 {summary['sct_p50']:.2f} s p95 {summary['sct_p95']:.2f} s, TTFT p50 "
        f"{summary['ttft_p50']:.2f} s p95 {summary['ttft_p95']:.2f} s, oracle SCT p50 "
        f"{summary['oracle']['sct_p50']:.2f} s; simulated in {summary['sim_wall_s']:.2f} s"
    )
    if args.bound:
        bound, _ = experiments.capacity_aware_bound(sessions, config, result)
        summary["bound"] = bound
        print(f"capacity-aware bound: SCT p50 {bound['sct_p50']:.2f} s p95 {bound['sct_p95']:.2f} s "
              f"(schedule bound {bound['schedule']['sct_p50']:.2f} / {bound['schedule']['sct_p95']:.2f} s, "
              f"free-memory run {bound['free_memory_run']['sct_p50']:.2f} / "
              f"{bound['free_memory_run']['sct_p95']:.2f} s); this run is "
              f"{summary['sct_p50'] / bound['sct_p50']:.2f}x / {summary['sct_p95'] / bound['sct_p95']:.2f}x the bound")
    if args.json:
        write_json(summary, Path(args.json))
    return 0


def configuration(args) -> tuple[str, configs.Configuration]:
    """(label, configuration) of a `sim run`: `--config NAME` with `--set knob=value`; the older
    flags are aliases (`--policy NAME`: that configuration over shared instances unless `--deploy
    as-deployed`; `--ablation`, `--tau`, `--adaptive-lease`, `--pools`: knobs)."""
    name = args.config or args.policy or "least-loaded"
    overrides: dict[str, object] = {}
    if args.ablation:
        overrides.update(mechanisms(args.ablation))
    if args.tau is not None:
        overrides["lease_timeout_s"] = args.tau
    if args.adaptive_lease:
        overrides["adaptive_lease"] = True
    deploy = args.deploy or (None if args.config else "shared")
    if deploy == "shared":
        overrides["pools"] = "shared"
    elif deploy == "as-deployed":
        talaria = configs.get(name).policy == "talaria"
        overrides["pools"] = (args.pools or "online") if talaria else "per-model"
    elif args.pools:  # with --config: talaria's pools where the models fit
        overrides["pools"] = args.pools
    overrides.update(configs.parse_set(args.set))
    return name, configs.get(name, **overrides)


def map_models(sessions: list[Session], spec: str | None, served: list[str]) -> list[Session]:
    """Replay a trace's models as served ones. `auto`: trace models the profile lacks, most
    calls first, onto the profile's models in turn (one model per session is kept);
    `A=B,C=D`: explicit. None: unchanged."""
    if not spec:
        return sessions
    if spec == "auto":
        calls = Counter(s.model for s in sessions for _ in s.calls)
        missing = [m for m, _ in calls.most_common() if m not in served]
        mapping = {m: served[k % len(served)] for k, m in enumerate(missing)}
    else:
        mapping = {}
        for pair in spec.split(","):
            src, sep, dst = pair.partition("=")
            if not sep or not src.strip() or not dst.strip():
                raise ValueError(f"{pair!r} is not TRACE_MODEL=SERVED_MODEL (or use 'auto')")
            if dst.strip() not in served:
                raise ValueError(f"{dst.strip()!r} is not served by this profile; known: {served}")
            mapping[src.strip()] = dst.strip()
    return [on_model(s, mapping[s.model], s.calls[0].gap_before_s, suffix=False) if s.model in mapping else s
            for s in sessions]


def _convert(args) -> int:
    try:
        summary = convert_file(args.src, args.dst, args.subagents, args.limit)
    except (TraceFormatError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary.as_dict(), indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="talaria sim", description="Discrete-event simulator")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate one configuration")
    run.add_argument("--trace", default="fixed-replay", help="normalised JSONL trace or 'fixed-replay'")
    run.add_argument("--profile", default="paper-tp8", choices=sorted(PROFILES))
    run.add_argument("--config", default=None, choices=configs.names(), metavar="NAME",
                     help="a named configuration (services/configs.py): router policy and knobs, scheduler, "
                          "pools as it is deployed")
    run.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                     help="override one knob of the configuration by name (repeatable)")
    run.add_argument("--policy", default=None,
                     help="alias: configuration NAME over shared instances (default least-loaded)")
    run.add_argument("--instances", type=int, default=1)
    run.add_argument("--ablation", choices=list(ABLATIONS), default=None,
                     help="which of Talaria's mechanisms run (shared/ablations.py)")
    run.add_argument("--tau", type=float, default=None, help="lease timeout (s; the configuration's: 1)")
    run.add_argument("--adaptive-lease", action="store_true")
    run.add_argument("--gaps", default=None,
                     help="paper | recorded[:cap] | rescaled:F[:cap] (default: recorded for a trace "
                          "`talaria trace export` wrote, paper for any other)")
    run.add_argument("--catalogue", default=None, metavar="N|FILE",
                     help="serve N models calibrated like the matrix's, or a catalogue file (docs/capacity.md); "
                          "the trace's models map onto them by popularity when the names differ")
    run.add_argument("--model-map", default=None,
                     help="replay trace models as served ones: 'auto' or TRACE=SERVED,... (default: none)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--deploy", choices=("shared", "as-deployed"), default=None,
                     help="shared: every instance may serve every model (cold pools); as-deployed: per-model "
                          "hot pools split by the trace's demand where the models fit the instances, else "
                          "serverless on-demand loading for a peer; talaria runs its own pools (--pools) where "
                          "the models fit, else its cold pool (talaria/sim/deployment.py)")
    run.add_argument("--pools", choices=TALARIA_POOLS, default=None,
                     help="talaria under --deploy as-deployed: online = hot pools from an even split that its "
                          "router resizes from measured demand (services/router/hot_pools.py; the matrix's "
                          "configuration); forecast = the peers' split of the trace's demand, as an operator "
                          "would pin it (talaria up --hot)")
    run.add_argument("--no-session-ids", action="store_true",
                     help="the clients name no session: talaria infers them from the prompts, a peer's router "
                          "sees each call as its own session (talaria/sim/anonymous_sessions.py)")
    run.add_argument("--json", default=None)
    run.add_argument("--bound", action="store_true",
                     help="also print the capacity-aware bound (schedule bound and free-memory run)")
    run.set_defaults(func=_run)
    cap = sub.add_parser("capacity", help="the fewest instances each deployment holds an SCT p95 SLO with")
    capacity.add_arguments(cap)
    cap.set_defaults(func=capacity.run_from_args)
    exp = sub.add_parser("experiments", help="run the paper's experiments")
    experiments.add_arguments(exp)
    exp.set_defaults(func=experiments.run_from_args)
    conv = sub.add_parser("convert", help="WEKA traces -> normalised JSONL (streaming)")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--subagents", choices=("separate", "drop"), default="separate")
    conv.add_argument("--limit", type=int, default=None, help="stop after N traces")
    conv.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
