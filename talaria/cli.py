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
    if args.nats_url is not None:
        changes["nats_url"] = args.nats_url
    models = [m.strip() for m in (args.models or "").split(",") if m.strip()] + list(args.model)
    if models:
        changes["models"] = tuple(models)
    try:  # every flag checked as the environment is, before anything starts
        settings = _apply_config(settings.with_(**changes), args)
        settings.validate()
        catalogue = settings.common.catalogue()  # reads each --model directory; `--hot` may name one
    except SettingsError as exc:
        print(f"talaria: {_flag_error(exc, args)}", file=sys.stderr)
        return 2
    from talaria.roles import HostPlan, RoleError, parse_roles

    credentials = Path(args.nats_credentials) if args.nats_credentials else None
    try:
        plan = HostPlan(parse_roles(args.role))
        plan.check(settings.common.nats_url, args.agents, credentials)
    except RoleError as exc:
        print(f"talaria: {exc}", file=sys.stderr)
        return 2
    if "agent" in plan.roles and (args.agents < 0 or args.agents + len(args.hot) < 1):
        print(f"talaria: --agents {args.agents}: at least one agent (cold, or --hot) must serve", file=sys.stderr)
        return 2
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
    route_tls = None
    if args.nats_route_tls:
        from talaria.embedded import RouteTls

        try:
            route_tls = RouteTls.parse(args.nats_route_tls)
        except ValueError as exc:
            print(f"talaria: --nats-route-tls {exc}", file=sys.stderr)
            return 2
        if args.nats_cluster < 2:
            print("talaria: --nats-route-tls secures a cluster's routes: give --nats-cluster 3", file=sys.stderr)
            return 2
    stack = Stack(settings, agents=plan.agents(args.agents), hot=tuple(args.hot) if "agent" in plan.roles else (),
                  nats_cluster=args.nats_cluster, routers=args.routers, plan=plan, credentials=credentials,
                  agent_prefix=args.agent_prefix, route_tls=route_tls)

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
        where = f"gateway {stack.gateway_url}" if stack.gateway_url else "no gateway on this host"
        print(f"talaria: ready in {time.monotonic() - t0:.1f}s — {where} (roles {','.join(sorted(plan.roles))}, "
              f"config {config_name(settings)}, {stack.agents} cold agents, {len(stack.hot)} hot)", flush=True)
        print(f"talaria: metrics (GET /metrics) {', '.join(f'{n} {u}' for n, u in sorted(stack.metrics.items()))}; "
              f"Prometheus config {settings.common.data_dir / 'prometheus.yml'}", flush=True)
        print(f"talaria: NATS {redact_url(stack.nats_url)}  Postgres {redact_url(stack.database_url) or 'elsewhere'}  "
              f"(credentials in {settings.common.data_dir / 'stack.json'}, mode 0600, which `talaria audit`, "
              "`trace` and `replay --running` read)", flush=True)
        if stack.gateway_url:
            _print_try(stack, args.data_dir)
        print("talaria: Ctrl-C stops everything this host started; a service that exits is restarted", flush=True)
        while True:  # supervise: restart what exits, with backoff; the rest keeps serving
            stack.supervise(progress=lambda m: print(f"talaria: {m}", file=sys.stderr, flush=True))
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("talaria: stopping", flush=True)
        return 0
    except (StackError, OSError, subprocess.CalledProcessError, EmbeddedServerError, RoleError) as exc:
        print(f"talaria: {exc}", file=sys.stderr)  # one line, never a traceback or a server's log
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not orphan children
        stack.stop()
        print("talaria: stopped", flush=True)


def _print_try(stack, data_dir: str | None) -> None:
    auth = ""
    if stack.api_key:
        print(f"talaria: API key (tenant `default`, this run only; also in "
              f"{stack.settings.common.data_dir / 'api_key'}): {stack.api_key}", flush=True)
        auth = f"-H 'Authorization: Bearer {stack.api_key}' "
    print(f"talaria: try  curl -s {stack.gateway_url}/v1/chat/completions {auth}-H 'X-Session-Id: demo' "
          "-H 'Content-Type: application/json' -d '{\"model\":\"qwen3-tiny\",\"messages\":"
          "[{\"role\":\"user\",\"content\":\"hello\"}],\"max_tokens\":16,\"temperature\":0}'", flush=True)
    where = f" --data-dir {data_dir}" if data_dir else ""
    print(f"talaria: then  talaria trace demo{where}   talaria audit session_calls --param session_id=demo{where}",
          flush=True)


def _flag_error(exc: SettingsError, args: argparse.Namespace) -> str:
    """A setting's error named as the user gave it: the flag (`--port 99999`) rather than its
    variable, when the flag set it."""
    flags = {"TALARIA_HTTP_PORT": ("--port", args.port), "TALARIA_DATA_DIR": ("--data-dir", args.data_dir),
             "TALARIA_POLICY": ("--policy", args.policy), "TALARIA_CONFIG": ("--config", args.config)}
    if exc.variable == "TALARIA_MODELS" and (args.model or args.models):
        flag = "--model" if exc.value in args.model else "--models"
        return f"{flag} {exc.value}: expected {exc.expected}"
    flag, given = flags.get(exc.variable, (None, None))
    return f"{flag} {given}: expected {exc.expected}" if given is not None else f"configuration error: {exc}"


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from talaria.shared.db.connection import upgrade

    if not settings.common.database_url:
        print("talaria migrate: set TALARIA_DATABASE_URL", file=sys.stderr)
        return 2
    admin = settings.cli.database_admin_url
    if admin:  # first set up the application role of TALARIA_DATABASE_URL (docs/security.md)
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
    """The embedded server's users and permissions, for an operator's NATS (docs/security.md)."""
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
    if args.cluster_routes:
        _write_cluster_conf(out, args.cluster_routes, settings.common.deployment.name)
    return 0


def _write_cluster_conf(out: Path, routes: str, name: str) -> None:
    """`cluster.conf`: every member's route user and password (routes take no user permissions,
    so a server joining without them would read every subject); `listen` is each member's own."""
    import secrets

    from talaria.shared.nats_auth import cluster_route_urls
    from talaria.stack import write_private

    password = secrets.token_urlsafe(24)
    block = {"name": name, "authorization": {"user": "route", "password": password, "timeout": 2},
             "routes": cluster_route_urls([r.strip() for r in routes.split(",") if r.strip()], "route", password)}
    write_private(out / "cluster.conf", json.dumps({"cluster": block}, indent=1))
    print(f"talaria: wrote {out / 'cluster.conf'}: include it on every member and set its own `cluster.listen`")


def cmd_compose_secrets(args: argparse.Namespace, settings: Settings) -> int:
    """docker-compose.yml's one-shot `secrets` service: generate them once into a volume."""
    from talaria.compose_secrets import write_compose_secrets

    agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    try:
        made = write_compose_secrets(Path(args.out), agents, deployment=settings.common.deployment.name)
    except OSError as exc:
        print(f"talaria compose-secrets: {exc}", file=sys.stderr)
        return 1
    print(f"talaria: {'generated the secrets in' if made else 'kept the secrets already in'} {args.out}")
    return 0


def _traces_dir(args: argparse.Namespace, settings: Settings) -> Path:
    """--traces-dir, else TALARIA_TRACES_DIR, else where the running stack writes them."""
    from talaria.running import StackNotFound, data_dir, find_stack

    if args.traces_dir:
        return Path(args.traces_dir)
    if settings.common.traces_dir:
        return settings.common.traces_dir
    directory = data_dir(settings, args.data_dir)
    try:
        return find_stack(directory).traces_dir
    except StackNotFound:  # a stopped stack's spans stay on disk
        return directory / "traces"


def cmd_trace(args: argparse.Namespace, settings: Settings) -> int:
    from talaria.timeline import print_timeline

    return print_timeline(_traces_dir(args, settings), args.session, args.tenant)


def cmd_trace_export(argv: list[str]) -> int:
    import asyncpg

    from talaria.running import StackNotFound, database_url
    from talaria.trace_export import export, parse_since

    p = argparse.ArgumentParser(prog="talaria trace export",
                                description="the served calls as a normalised trace the simulator replays")
    p.add_argument("out", help="output JSONL (replay: talaria sim run --trace OUT --policy P)")
    p.add_argument("--since", default=None, help="ISO-8601 time or a duration back from now (30m, 2h, 1d)")
    _data_dir_flag(p)
    args = p.parse_args(argv)
    try:
        settings = Settings.from_env()
        since = parse_since(args.since) if args.since else None
        url = database_url(settings, args.data_dir)
    except (SettingsError, ValueError, StackNotFound) as exc:
        print(f"talaria trace export: {exc}", file=sys.stderr)
        return 2
    try:
        summary = export(url, Path(args.out), since)
    except (OSError, asyncpg.PostgresError) as exc:  # unwritable OUT, or a database that is gone
        print(f"talaria trace export: {exc}", file=sys.stderr)
        return 1
    print(f"talaria: exported {summary['calls']} calls in {summary['sessions']} sessions to {summary['out']}")
    return 0


def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    from talaria.audit import run_audit
    from talaria.running import database_url

    return run_audit(lambda: database_url(settings, args.data_dir), None if args.list else args.query,
                     args.param, args.format, args.tenant)


def cmd_drain(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    from talaria.drain import drain
    from talaria.running import StackNotFound, data_dir, find_stack

    if args.timeout_s <= 0:
        print("talaria drain: --timeout-s must be > 0", file=sys.stderr)
        return 2
    try:
        running = find_stack(data_dir(settings, args.data_dir)).check_running()
    except StackNotFound as exc:
        print(f"talaria drain: {exc}", file=sys.stderr)
        return 2
    status, line = asyncio.run(drain(running.nats_admin_url, args.instance, timeout_s=args.timeout_s,
                                     deployment=settings.common.deployment))
    print(line if status == 0 else f"talaria drain: {line}", file=sys.stdout if status == 0 else sys.stderr)
    return status


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio
    import dataclasses
    import tempfile
    import uuid

    import asyncpg
    import nats.errors

    from talaria.replay import ReplayConfig, Replayer, metrics_from_db, write_report
    from talaria.running import StackNotFound, data_dir, find_stack
    from talaria.stack import Stack, StackError
    from talaria.traces import TraceFormatError, load_trace, parse_gap_model
    from talaria.traces.gaps import default_gap_spec

    try:
        sessions = load_trace(args.trace)[: args.sessions or None]
        gaps = parse_gap_model(args.gaps or default_gap_spec(sessions), seed=args.seed)
    except (OSError, TraceFormatError, ValueError) as exc:
        print(f"talaria replay: {exc}", file=sys.stderr)
        return 2
    cfg = ReplayConfig(token_scale=args.token_scale, max_prompt_tokens=args.max_prompt)
    stack = None
    try:
        if args.running:  # the stack `talaria up` runs on --data-dir / TALARIA_DATA_DIR / .talaria
            running = find_stack(data_dir(settings, args.data_dir)).check_running()
            nats_url, db_url = running.nats_client_url, running.database_url
            api_key = settings.cli.api_key or running.api_key
        elif args.nats:
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
    except (StackError, StackNotFound) as exc:
        print(f"talaria replay: {exc}", file=sys.stderr)
        return 1
    except (OSError, nats.errors.Error, asyncpg.PostgresError) as exc:  # e.g. --running on a stopped stack
        print(f"talaria replay: cannot reach the stack: {exc!r} (is it running?)", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()


def cmd_sim(argv: list[str]) -> int:
    from talaria.sim.cli import main as sim_main

    return sim_main(argv)


def _data_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None,
                   help="the running stack's data directory, as given to `talaria up` (default: "
                        "TALARIA_DATA_DIR, else .talaria); its stack.json names the database")


def _tenant_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenant", default=None,
                   help="the tenant whose session id this is (needed only when several tenants used it)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="talaria", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the whole stack (embedded NATS/Postgres unless URLs are set)")
    up.add_argument("--agents", type=int, default=2, help="instance agents to start (default 2)")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="embedded NATS as an N-node JetStream cluster, streams replicated N times (3: one "
                         "node may die without a stall of more than a few seconds; default 1)")
    up.add_argument("--nats-route-tls", default=None, metavar="CERT,KEY,CA",
                    help="the cluster's routes over mutual TLS: each member presents CERT (KEY) and accepts "
                         "only peers whose certificate CA signed (routes always need the generated route password)")
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
    up.add_argument("--role", default="all", metavar="ROLES",
                    help="what this host runs: all (default), or a comma-separated subset of control (router, "
                         "telemetry, Postgres, migrations), gateway, agent; every role but all joins an existing "
                         "NATS (docs/deployment.md)")
    up.add_argument("--nats-url", default=None, metavar="URL",
                    help="the NATS cluster to join (every member, comma-separated; default TALARIA_NATS_URL)")
    up.add_argument("--nats-credentials", default=None, metavar="DIR",
                    help="a `talaria nats-config` directory: each service connects as its own NATS user")
    up.add_argument("--agent-prefix", default="agent", metavar="NAME",
                    help="instance ids NAME-0, NAME-1, ... (unique across agent hosts; default agent)")
    _config_flags(up)
    sub.add_parser("migrate", help="apply database migrations to TALARIA_DATABASE_URL")
    nc = sub.add_parser("nats-config", help="write per-service NATS users and permissions for an external NATS")
    nc.add_argument("out", help="directory for auth.conf (include it in nats-server.conf) and one .env per service")
    nc.add_argument("--agents", default="agent-0,agent-1", help="comma-separated instance ids "
                    "(NATS API client users: one per tenant of TALARIA_API_KEYS / TALARIA_API_KEYS_FILE)")
    nc.add_argument("--cluster-routes", default=None, metavar="HOST:PORT,...",
                    help="also write cluster.conf: the members' routes with a generated route user and password")
    cs = sub.add_parser("compose-secrets", help="generate a docker-compose deployment's secrets once (its `secrets` "
                        "service runs this): per-service NATS users, route, database and Grafana passwords, an API key")
    cs.add_argument("out", help="directory (the secrets volume); kept as it is when already complete")
    cs.add_argument("--agents", default="agent-0,agent-1", help="comma-separated instance ids")
    tr = sub.add_parser("trace", help="print a session's timeline from exported spans; "
                        "`talaria trace export OUT.jsonl` writes the served calls as a replayable trace")
    tr.add_argument("session", nargs="?", help="session id as the client sent it (default: list sessions)")
    tr.add_argument("--traces-dir", default=None, help="span files (default: the running stack's)")
    _data_dir_flag(tr)
    _tenant_flag(tr)
    au = sub.add_parser("audit", help="run an operator's SQL audit from ops/audit/")
    au.add_argument("query", nargs="?", help="audit name (default: list them)")
    au.add_argument("--list", action="store_true", help="list the audits and what each answers")
    au.add_argument("--param", action="append", default=[],
                    help="name=value for the query (session_id: as the client sent it)")
    au.add_argument("--format", choices=["table", "json"], default="table")
    _data_dir_flag(au)
    _tenant_flag(au)
    dr = sub.add_parser("drain", help="take an instance out of service; returns once nothing runs there and "
                        "its sessions' KV has moved (exit 3: some could not; docs/operating.md)")
    dr.add_argument("instance", help="the instance id (the calls table's instance_id)")
    dr.add_argument("--timeout-s", type=float, default=600.0, help="give up (exit 1) after this long")
    _data_dir_flag(dr)
    rp = sub.add_parser("replay", help="replay a normalised trace against a live stack over NATS")
    rp.add_argument("trace", help="normalised trace (JSONL; `talaria sim convert` makes one)")
    rp.add_argument("--sessions", type=int, default=0, help="replay only the first N sessions")
    rp.add_argument("--gaps", default=None, help="recorded[:cap] | rescaled:F[:cap] | paper[:cap] (default: "
                    "recorded for a trace `talaria trace export` wrote, paper for any other)")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--token-scale", type=float, default=1 / 64, help="trace tokens -> tiny-model tokens")
    rp.add_argument("--max-prompt", type=int, default=3000, help="stop a session whose prompt grows past this")
    rp.add_argument("--agents", type=int, default=2)
    rp.add_argument("--data-dir", default=None,
                    help="the stack's data directory (default: a fresh temporary one; with --running: "
                         "TALARIA_DATA_DIR, else .talaria)")
    rp.add_argument("--running", action="store_true",
                    help="replay against the stack `talaria up` runs on the data directory (its stack.json)")
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
    from talaria.running import AmbiguousSession, StackNotFound
    from talaria.services.router.policy.registry import UnknownPolicyError

    handlers = {"up": cmd_up, "migrate": cmd_migrate, "nats-config": cmd_nats_config, "compose-secrets": cmd_compose_secrets, "trace": cmd_trace, "audit": cmd_audit, "drain": cmd_drain,
                "replay": cmd_replay}
    try:
        return handlers[args.command](args, settings)
    except (UnknownPolicyError, StackNotFound, AmbiguousSession) as exc:
        print(f"talaria {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
