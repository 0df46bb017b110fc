"""The `talaria` command: up, migrate, audit, trace, sim, replay."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from talaria.shared.ablations import ABLATIONS
from talaria.shared.settings import Settings, SettingsError, redact_url


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="NAME",
                   help="the named configuration to run (services/configs.py; default: TALARIA_CONFIG, else talaria)")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                   help="override one knob of the configuration by name (repeatable; TALARIA_CONFIG_SET)")
    p.add_argument("--policy", default=None, metavar="NAME", help="older spelling of --config")
    p.add_argument("--ablation", choices=list(ABLATIONS), default=None,
                   help="which of Talaria's mechanisms run (shared/ablations.py; default: TALARIA_ABLATION, "
                        "else the configuration's); round-only: the paper's baseline")


def _apply_config(settings: Settings, args: argparse.Namespace) -> Settings:
    """The settings with the command line's configuration choices; a SettingsError on a bad one."""
    from talaria.services import configs

    changes: dict[str, object] = {}
    if args.config or args.policy:
        changes.update(config=args.config or args.policy, policy="")
    if args.set:
        changes["config_set"] = (*settings.common.config_set, *args.set)
    if args.ablation:
        changes["ablation"] = args.ablation
    settings = settings.with_(**changes)
    # the whole stack's choice, checked here so that a bad name stops `up` before anything starts
    configs.selected(settings.common, policy=settings.router.policy, ablation=settings.agent.ablation)
    return settings


def config_name(settings: Settings) -> str:
    return settings.common.config or settings.router.policy or "talaria"


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from talaria.embedded import EmbeddedServerError
    from talaria.stack import Stack, StackError

    changes: dict[str, object] = {}
    if args.port is not None:
        changes["http_port"] = args.port
    if args.data_dir is not None:
        changes["data_dir"] = Path(args.data_dir)
    models = [m.strip() for m in (args.models or "").split(",") if m.strip()] + list(args.model)
    if models:
        changes["models"] = tuple(models)
    try:
        settings = _apply_config(settings.with_(**changes), args)
    except SettingsError as exc:
        print(f"talaria: {exc}", file=sys.stderr)
        return 2
    catalogue = settings.common.catalogue()  # `--hot` may name a checkpoint among the models
    unknown = [m for m in args.hot if m not in catalogue]
    if unknown:
        print(f"talaria: --hot {unknown[0]}: unknown model; known: {', '.join(sorted(catalogue))}", file=sys.stderr)
        return 2
    if not 1 <= args.nats_cluster <= 5:
        print(f"talaria: --nats-cluster {args.nats_cluster}: 1 to 5 servers", file=sys.stderr)
        return 2
    if not 1 <= args.routers <= settings.router.router_partitions:
        print(f"talaria: --routers {args.routers}: 1 to {settings.router.router_partitions} (TALARIA_ROUTER_PARTITIONS: "
              "each router needs a partition of the sessions)", file=sys.stderr)
        return 2
    stack = Stack(settings, agents=args.agents, hot=tuple(args.hot), nats_cluster=args.nats_cluster,
                  routers=args.routers)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    # Ctrl-C, `kill`, and a closed terminal (SIGHUP) all stop everything this run started.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)  # once: a second Ctrl-C must not skip the cleanup
    t0 = time.monotonic()
    try:
        stack.start(timeout=args.ready_timeout, progress=lambda m: print(f"talaria: {m}", flush=True))
        print(f"talaria: ready in {time.monotonic() - t0:.1f}s — gateway {stack.gateway_url} "
              f"(config {config_name(settings)}, {args.agents} cold agents, {len(args.hot)} hot)", flush=True)
        print(f"talaria: metrics (GET /metrics) {', '.join(f'{n} {u}' for n, u in sorted(stack.metrics.items()))}; "
              f"Prometheus config {settings.common.data_dir / 'prometheus.yml'}", flush=True)
        print(f"talaria: NATS {redact_url(stack.nats_url)}  Postgres {redact_url(stack.database_url)}  "
              f"(credentials in {settings.common.data_dir / 'stack.json'}, mode 0600)", flush=True)
        auth = ""
        if stack.api_key:
            print(f"talaria: API key (tenant `default`, this run only; also in "
                  f"{settings.common.data_dir / 'api_key'}): {stack.api_key}", flush=True)
            auth = f"-H 'Authorization: Bearer {stack.api_key}' "
        print(f"talaria: try  curl -s {stack.gateway_url}/v1/chat/completions {auth}-H 'X-Session-Id: demo' "
              "-H 'Content-Type: application/json' -d '{\"model\":\"qwen3-tiny\",\"messages\":"
              "[{\"role\":\"user\",\"content\":\"hello\"}],\"max_tokens\":16,\"temperature\":0}'", flush=True)
        print("talaria: Ctrl-C stops everything; a service that exits is restarted", flush=True)
        while True:  # supervise: restart what exits, with backoff; the rest keeps serving
            stack.supervise(progress=lambda m: print(f"talaria: {m}", file=sys.stderr, flush=True))
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("talaria: stopping", flush=True)
        return 0
    except (StackError, OSError, subprocess.CalledProcessError, EmbeddedServerError) as exc:
        print(f"talaria: {exc}", file=sys.stderr)  # one line, never a traceback or a server's log
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not orphan children
        stack.stop()
        print("talaria: stopped", flush=True)


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from talaria.shared.db.connection import upgrade

    if not settings.common.database_url:
        print("talaria migrate: set TALARIA_DATABASE_URL", file=sys.stderr)
        return 2
    admin = settings.cli.database_admin_url
    if admin:  # first set up the application role of TALARIA_DATABASE_URL (README: Security)
        import asyncio
        from urllib.parse import urlsplit

        from talaria.shared.db.roles import ensure_app_role

        app = urlsplit(settings.common.database_url)
        if not app.username or not app.password:
            print("talaria migrate: TALARIA_DATABASE_URL must name the application role and its password",
                  file=sys.stderr)
            return 2
        asyncio.run(ensure_app_role(admin, app.username, app.password))
    upgrade(settings.common.database_url)  # as the application role: it owns the schema
    print("talaria: schema is at head")
    return 0


def cmd_nats_config(args: argparse.Namespace, settings: Settings) -> int:
    """The embedded server's users and permissions, for an operator's NATS (README: Security)."""
    from talaria.shared.nats_auth import authorization_block, generate_users
    from talaria.stack import write_private

    from talaria.services.gateway.auth import KeyStore

    agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    # One NATS API client user per tenant of the configured API keys (none configured: one shared).
    tenants = sorted(set(KeyStore.from_settings(settings.gateway).tenants.values()))
    users = generate_users(agents, tenants)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_private(out / "auth.conf", json.dumps({"authorization": authorization_block(users, settings.common.deployment.name)},
                                                indent=1))
    for key, user in users.items():
        env = {**user.env(), "TALARIA_DEPLOYMENT": settings.common.deployment.name}
        write_private(out / f"{key}.env", "".join(f"{k}={v}\n" for k, v in env.items()))
    print(f"talaria: wrote {out / 'auth.conf'} (include it from nats-server.conf) and "
          f"{', '.join(f'{k}.env' for k in users)}: one per service, mode 0600")
    return 0


def cmd_trace(args: argparse.Namespace, settings: Settings) -> int:
    from talaria.timeline import print_timeline

    directory = Path(args.traces_dir) if args.traces_dir else settings.common.traces_path
    return print_timeline(directory, args.session)


def cmd_trace_export(argv: list[str]) -> int:
    from talaria.trace_export import export, parse_since

    p = argparse.ArgumentParser(prog="talaria trace export",
                                description="the served calls as a normalised trace the simulator replays")
    p.add_argument("out", help="output JSONL (replay: talaria sim run --trace OUT --policy P)")
    p.add_argument("--since", default=None, help="ISO-8601 time or a duration back from now (30m, 2h, 1d)")
    args = p.parse_args(argv)
    try:
        settings = Settings.from_env()
        since = parse_since(args.since) if args.since else None
    except (SettingsError, ValueError) as exc:
        print(f"talaria trace export: {exc}", file=sys.stderr)
        return 2
    if not settings.common.database_url:
        print("talaria trace export: set TALARIA_DATABASE_URL (`talaria up` prints it)", file=sys.stderr)
        return 2
    summary = export(settings.common.database_url, Path(args.out), since)
    print(f"talaria: exported {summary['calls']} calls in {summary['sessions']} sessions to {summary['out']}")
    return 0


def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    from talaria.audit import run_audit

    return run_audit(settings, None if args.list else args.query, args.param, args.format)


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio
    import dataclasses
    import tempfile
    import uuid

    from talaria.replay import ReplayConfig, Replayer, metrics_from_db, write_report
    from talaria.stack import Stack, StackError
    from talaria.traces import TraceFormatError, load_trace, parse_gap_model

    try:
        sessions = load_trace(args.trace)[: args.sessions or None]
        gaps = parse_gap_model(args.gaps, seed=args.seed)
    except (OSError, TraceFormatError, ValueError) as exc:
        print(f"talaria replay: {exc}", file=sys.stderr)
        return 2
    cfg = ReplayConfig(token_scale=args.token_scale, max_prompt_tokens=args.max_prompt)
    stack = None
    try:
        if args.nats:
            if not args.database:
                print("talaria replay: --nats needs --database too", file=sys.stderr)
                return 2
            nats_url, db_url, api_key = args.nats, args.database, settings.cli.api_key
        else:
            data_dir = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="talaria-replay-"))
            try:
                run_settings = _apply_config(settings.with_(data_dir=data_dir, http_port=0), args)
            except SettingsError as exc:
                print(f"talaria replay: {exc}", file=sys.stderr)
                return 2
            stack = Stack(run_settings, agents=args.agents).start(progress=lambda m: print(f"talaria: {m}",
                                                                                        file=sys.stderr))
            nats_url, db_url, api_key = stack.client_nats_url, stack.database_url, stack.api_key
        run_id = f"replay-{uuid.uuid4().hex[:8]}"
        print(f"talaria replay: {len(sessions)} sessions, {sum(len(s.calls) for s in sessions)} calls, "
              f"{gaps.describe()}, token scale {cfg.token_scale:g}", file=sys.stderr)
        t0 = time.monotonic()
        stats = asyncio.run(Replayer(nats_url, cfg, gaps, run_id, api_key, settings.common.deployment,
                                     settings.common.catalogue()).run(sessions))
        metrics = asyncio.run(metrics_from_db(db_url, run_id, stats.calls_sent))
        result = {"run_id": run_id, "policy": args.config or args.policy or config_name(settings),
                  "gaps": gaps.describe(), "ablation": args.ablation or settings.agent.ablation or "talaria",
                  "replay": dataclasses.asdict(cfg), "stats": dataclasses.asdict(stats),
                  "wall_s": time.monotonic() - t0, **metrics}
        print(json.dumps(result, indent=2, default=str))
        if args.json:
            write_report(Path(args.json), result)
        return 0 if stats.calls_failed == 0 else 1
    except StackError as exc:
        print(f"talaria replay: {exc}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()


def cmd_sim(argv: list[str]) -> int:
    from talaria.sim.cli import main as sim_main

    return sim_main(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="talaria", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the whole stack (embedded NATS/Postgres unless URLs are set)")
    up.add_argument("--agents", type=int, default=2, help="instance agents to start (default 2)")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="embedded NATS as an N-node JetStream cluster, streams replicated N times (3: one "
                         "node may die without a stall of more than a few seconds; default 1)")
    up.add_argument("--routers", type=int, default=1, metavar="N",
                    help="N router replicas splitting the sessions by partition (ownership in a JetStream KV "
                         "bucket; a dead router's partitions are taken over within its TTL; default 1)")
    up.add_argument("--hot", action="append", default=[], metavar="MODEL",
                    help="add a hot-pool agent pinned to MODEL (repeatable); --agents are the cold pool")
    up.add_argument("--port", type=int, default=None, help="gateway HTTP port (default 8000; 0 = any free)")
    up.add_argument("--data-dir", default=None, help="data directory (default .talaria)")
    up.add_argument("--ready-timeout", type=float, default=120.0,
                    help="seconds to wait for every service (default 120; TALARIA_ENGINE=vllm starts "
                         "two vLLM processes per model, allow minutes)")
    up.add_argument("--models", default=None, help="comma-separated models each agent serves")
    up.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                    help="serve the Hugging Face checkpoint in DIR as NAME (repeatable; with --models: added)")
    _config_flags(up)
    sub.add_parser("migrate", help="apply database migrations to TALARIA_DATABASE_URL")
    nc = sub.add_parser("nats-config", help="write per-service NATS users and permissions for an external NATS")
    nc.add_argument("out", help="directory for auth.conf (include it in nats-server.conf) and one .env per service")
    nc.add_argument("--agents", default="agent-0,agent-1", help="comma-separated instance ids "
                    "(NATS API client users: one per tenant of TALARIA_API_KEYS / TALARIA_API_KEYS_FILE)")
    tr = sub.add_parser("trace", help="print a session's timeline from exported spans; "
                        "`talaria trace export OUT.jsonl` writes the served calls as a replayable trace")
    tr.add_argument("session", nargs="?", help="session id (default: list sessions)")
    tr.add_argument("--traces-dir", default=None)
    au = sub.add_parser("audit", help="run an operator's SQL audit from ops/audit/")
    au.add_argument("query", nargs="?", help="audit name (default: list them)")
    au.add_argument("--list", action="store_true", help="list the audits and what each answers")
    au.add_argument("--param", action="append", default=[], help="name=value for the query")
    au.add_argument("--format", choices=["table", "json"], default="table")
    rp = sub.add_parser("replay", help="replay a normalised trace against a live stack over NATS")
    rp.add_argument("trace", help="normalised trace (JSONL; `talaria sim convert` makes one)")
    rp.add_argument("--sessions", type=int, default=0, help="replay only the first N sessions")
    rp.add_argument("--gaps", default="paper", help="recorded[:cap] | rescaled:F[:cap] | paper[:cap]")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--token-scale", type=float, default=1 / 64, help="trace tokens -> tiny-model tokens")
    rp.add_argument("--max-prompt", type=int, default=3000, help="stop a session whose prompt grows past this")
    rp.add_argument("--agents", type=int, default=2)
    rp.add_argument("--data-dir", default=None)
    rp.add_argument("--nats", default=None, help="replay against this running stack instead of starting one")
    rp.add_argument("--database", default=None, help="its Postgres (for the metrics)")
    rp.add_argument("--json", default=None, help="write the metrics here")
    _config_flags(rp)
    sub.add_parser("sim", help="trace replay in the discrete-event simulator (see `talaria sim -h`)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader left (`talaria audit --list | head`): not an error of ours; point stdout
        # at devnull so the interpreter's final flush does not raise again (Python's signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sim":
        return cmd_sim(argv[1:])
    if argv[:2] == ["trace", "export"]:
        return cmd_trace_export(argv[2:])
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"talaria: configuration error: {exc}", file=sys.stderr)
        return 2
    from talaria.services.router.policy.registry import UnknownPolicyError

    handlers = {"up": cmd_up, "migrate": cmd_migrate, "nats-config": cmd_nats_config, "trace": cmd_trace, "audit": cmd_audit,
                "replay": cmd_replay}
    try:
        return handlers[args.command](args, settings)
    except UnknownPolicyError as exc:
        print(f"talaria: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
