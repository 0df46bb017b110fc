"""A rolling restart under load (issue 40): drain-then-stop agent-0, the supervisor restarts
it, then drain-then-stop agent-1, while agent sessions keep coming at a steady rate.

    python bench/drain_restart.py [--sessions 36] [--calls 6] [--rate 0.8] [--configs talaria,talaria-no-migrate]

Per configuration, a fresh `talaria up --agents 2 --models qwen3-tiny` (embedded NATS and
Postgres, the torch engine's tiny model): sessions start `--rate` per second, each makes
`--calls` chat calls with a tool gap of 1-3 s between them and a tool output of ~100 tokens
appended each time (several sessions in flight, each with context on one agent). Once the
load is warm, `talaria drain agent-0` runs (timed); when it returns, agent-0 gets SIGTERM
(the operator's stop), and `talaria up`'s supervisor starts it again. Once agent-0 says ready
again, the same for agent-1.

Reported per configuration (from the clients, the agents' logs and Postgres):
- lost: logical calls that got no 200 (gave up, no answer) plus rows never final;
- twice: executions beyond one per call (agents' `call completed` lines) or completed rows
  beyond the answers given;
- moved returns: a session's first call after a drain started that ran on another agent
  while its previous call ran on the drained one; by `kv_source` (migrated / device / host /
  recompute / none). Split by the router's decision (lease_decisions.candidates): "forced"
  where the drained agent was not a candidate it could choose (draining, lost, restarting),
  "chosen" where it was priced admissible with the session's KV and the router placed the
  call elsewhere because that priced cheaper (a recompute of a few hundred tokens of the
  tiny model against a queue): context the drain lost is a forced recompute;
- every continuation after the first drain took effect (the router's `instance draining`
  line), by `kv_source`;
- each drain's duration and exit line;
- TTFT (calls.ttft_s) of moved returns vs the other continuations after the drain.
`talaria-no-migrate` is the baseline in the same run: its drains cannot push (no page
server), so every moved return recomputes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults import API_KEY, TENANT, Phase, UpProcess, executions, one_call, settle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from talaria.embedded import free_port  # noqa: E402
from talaria.services.gateway.auth import client_session, scoped_session  # noqa: E402
from talaria.shared.settings import asyncpg_dsn  # noqa: E402
from talaria.shared.stats import quantile  # noqa: E402

MODEL = "qwen3-tiny"
TOOL_WORDS = 80  # words of tool output appended per call (~100 tokens)
WARM_S = 12.0  # load before the first drain: sessions have context on both agents
SERVE_AGAIN_S = 120.0  # a restarted agent must say ready within this, else the second drain is skipped


@dataclass
class Drain:
    instance: str
    started: float  # epoch s
    seconds: float = 0.0
    code: int = -1
    line: str = ""
    stopped: float = 0.0  # epoch s of the SIGTERM
    back: float = 0.0  # epoch s of its first completed call after the restart (0: not seen)


@dataclass
class Run:
    config: str
    drains: list[Drain] = field(default_factory=list)
    phase: Phase | None = None


async def session(http, url: str, phase: Phase, name: str, calls: int, rng: random.Random) -> None:
    # The session's name first: no two sessions share a leading 16-token block, so a return's
    # kv_source speaks of its own context only.
    history: list[dict] = [{"role": "user", "content": f"{rng.getrandbits(64):x} {name}: fix the failing test. "
                            + " ".join(rng.choice(WORDS) for _ in range(TOOL_WORDS))}]
    for i in range(calls):
        if not await one_call(http, url, phase, name, i, MODEL, history, API_KEY):
            phase.gave_up += 1
            return
        phase.ok += 1
        await asyncio.sleep(rng.uniform(1.0, 3.0))  # the tool runs (the workload, not a synchronisation)
        history.append({"role": "user", "content": "Tool output: " + " ".join(
            rng.choice(WORDS) for _ in range(TOOL_WORDS))})


WORDS = ("def", "parse", "return", "assert", "split", "line", "token", "error", "test", "passed", "failed",
         "file", "value", "index", "list", "string", "comma", "expected", "got", "None")


def drain_cmd(data_dir: Path, instance: str) -> tuple[int, str, float]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "talaria.cli", "drain", instance, "--data-dir", str(data_dir),
                        "--timeout-s", "180"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return p.returncode, (p.stdout + p.stderr).strip().splitlines()[-1:][0] if (p.stdout + p.stderr).strip() else "", \
        time.monotonic() - t


def readies(data_dir: Path, instance: str) -> int:
    """How many times the agent's processes said ready (its log; one line per start)."""
    log = data_dir / "logs" / f"{instance}.log"
    return log.read_text(errors="replace").count('"instance agent ready"') if log.exists() else 0


async def ready_again(data_dir: Path, instance: str, before: int, timeout: float) -> float:
    """Epoch s once the restarted agent said ready (0 on timeout). Polls its log (an external
    process announces readiness nowhere else the bench can read); its first snapshot follows
    within a heartbeat, and the router takes it back into service then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if readies(data_dir, instance) > before:
            return time.time()
        await asyncio.sleep(0.2)
    return 0.0


def drain_seen(data_dir: Path, instance: str, after: float) -> float:
    """Epoch s of the router's first `instance draining` line for `instance` after `after`:
    when the drain took effect (`talaria drain` itself takes a moment to start)."""
    from datetime import datetime
    for line in (data_dir / "logs" / "router-0.log").read_text(errors="replace").splitlines():
        if '"instance draining"' not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        at = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
        if entry.get("instance_id") == instance and at >= after:
            return at
    return after


async def operate(up: UpProcess, run: Run, instances: list[str]) -> None:
    """Drain, stop (the supervisor restarts it), wait until it is ready again; each instance in turn."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(WARM_S)  # the workload's warm-up
    for k, inst in enumerate(instances):
        d = Drain(inst, time.time())
        run.drains.append(d)
        d.code, d.line, d.seconds = await loop.run_in_executor(None, drain_cmd, up.data_dir, inst)
        d.stopped = time.time()
        before = readies(up.data_dir, inst)
        os.kill(up.pid(inst), signal.SIGTERM)  # the operator's stop; talaria up starts it again
        d.back = await ready_again(up.data_dir, inst, before, SERVE_AGAIN_S)
        print(f"drain_restart: {run.config}: {inst} drain {d.code} in {d.seconds:.1f}s ({d.line}); "
              f"ready again {d.back - d.stopped:.1f}s after the stop" if d.back else
              f"drain_restart: {run.config}: {inst} not ready again", file=sys.stderr)
        if not d.back:
            return


async def load(up: UpProcess, run: Run, sessions: int, calls: int, rate: float, seed: int) -> None:
    url = f"http://127.0.0.1:{up.port}/v1/chat/completions"
    rng = random.Random(seed)
    run.phase = phase = Phase(f"drain-{run.config}")
    async with aiohttp.ClientSession() as http:
        tasks: list[asyncio.Task] = []
        ops = asyncio.create_task(operate(up, run, ["agent-0", "agent-1"]))
        for k in range(sessions):
            tasks.append(asyncio.create_task(session(http, url, phase, f"{phase.fault}-{seed}-s{k}", calls,
                                                     random.Random(rng.random()))))
            await asyncio.sleep(1.0 / rate)  # a steady arrival rate (the workload)
        await asyncio.gather(*tasks)
        await ops


CALLS_SQL = ("SELECT session_id, call_index, instance_id, kv_source, ttft_s, outcome, cached_tokens, prompt_tokens, "
             "migrated_bytes, extract(epoch FROM submitted_at) AS submitted FROM calls")
DECISIONS_SQL = ("SELECT session_id, call_index, action, chosen_instance, lease_outcome, lease_instance, candidates, "
                 "kv_source, extract(epoch FROM decided_at) AS decided FROM lease_decisions")


async def session_rows(db_url: str, select: str, prefix: str) -> list[dict]:
    """`select`'s rows for the bench's sessions (`prefix`), each with its client-side name."""
    conn = await asyncpg.connect(asyncpg_dsn(db_url))
    try:
        rows = await conn.fetch(select + " WHERE session_id LIKE $1 ORDER BY session_id, call_index",
                                scoped_session(TENANT, prefix) + "%")
    finally:
        await conn.close()
    return [dict(r) | {"session": client_session(TENANT, r["session_id"])} for r in rows]


def holder_admissible(decision: dict | None, holder: str) -> bool:
    """Whether the router's decision priced `holder` as a place it could have sent the call."""
    if decision is None:
        return False
    cands = decision["candidates"]
    cands = json.loads(cands) if isinstance(cands, str) else cands
    return any(c.get("instance_id") == holder and c.get("feasible") and c.get("kv_state") in ("device", "host")
               for c in cands)


def analyse(run: Run, rows: list[dict], by_session: dict, runs: dict[str, int], decisions: list[dict]) -> dict:
    phase = run.phase
    answered = sum(1 for a in phase.attempts if a.status == 200)
    no_answer = sum(1 for a in phase.attempts if a.error == "no answer")
    open_rows = sum(n for o in by_session.values() for k, n in o.items() if k not in ("completed", "failed"))
    completed = sum(o.get("completed", 0) for o in by_session.values())
    done = [r for r in rows if r["outcome"] == "completed"]
    prev = {(r["session"], r["call_index"]): r for r in done}
    out = {"config": run.config, "answered": answered, "gave_up": phase.gave_up,
           "lost": phase.gave_up + no_answer + open_rows,
           "twice": max(sum(n - 1 for n in runs.values()), completed - answered), "drains": []}
    t0 = run.drains[0].started if run.drains else float("inf")
    moved_keys: set = set()
    decided = {(x["session"], x["call_index"]): x for x in decisions}
    for d in run.drains:
        end = next((x.started for x in run.drains if x.started > d.started), float("inf"))
        moved: dict[str, int] = {}
        forced: dict[str, int] = {}  # the drained agent was no choice: what the drain did to the context
        cached = prompt = 0
        seen: set = set()
        # A moved return: a session's first call after this drain started that ran elsewhere
        # while its previous call ran there (a call placed there before the router got the
        # drain, `talaria drain` starting up, is not one: its session moves at its next call).
        for r in done:
            p = prev.get((r["session"], r["call_index"] - 1))
            if r["call_index"] == 0 or r["session"] in seen or not d.started <= r["submitted"] < end or p is None:
                continue
            if p["instance_id"] == d.instance and r["instance_id"] != d.instance:
                seen.add(r["session"])
                moved_keys.add((r["session"], r["call_index"]))
                moved[r["kv_source"]] = moved.get(r["kv_source"], 0) + 1
                if not holder_admissible(decided.get((r["session"], r["call_index"])), d.instance):
                    forced[r["kv_source"]] = forced.get(r["kv_source"], 0) + 1
                cached, prompt = cached + (r["cached_tokens"] or 0), prompt + (r["prompt_tokens"] or 0)
        out["drains"].append({"instance": d.instance, "exit": d.code, "seconds": round(d.seconds, 2), "line": d.line,
                              "ready_again_s": round(d.back - d.stopped, 1) if d.back else None,
                              "moved_returns": moved, "forced_moves": forced, "moved_cached_share": round(cached / prompt, 3) if prompt else None})
    after = [r for r in done if r["call_index"] > 0 and r["submitted"] >= t0]
    out["continuations_after_drain"] = _count(r["kv_source"] for r in after)
    ttft_moved = [r["ttft_s"] for r in after if (r["session"], r["call_index"]) in moved_keys and r["ttft_s"]]
    ttft_rest = [r["ttft_s"] for r in after if (r["session"], r["call_index"]) not in moved_keys and r["ttft_s"]]
    out["ttft_moved_s"] = _stats(ttft_moved)
    out["ttft_other_continuations_s"] = _stats(ttft_rest)
    return out


def _count(values) -> dict[str, int]:
    c: dict[str, int] = {}
    for v in values:
        c[v or "none"] = c.get(v or "none", 0) + 1
    return dict(sorted(c.items()))


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": round(quantile(xs, 0.5), 4), "p90": round(quantile(xs, 0.9), 4),
            "mean": round(statistics.fmean(xs), 4)}


def one_config(config: str, sessions: int, calls: int, rate: float, seed: int) -> dict:
    data_dir = Path(tempfile.mkdtemp(prefix=f"talaria-drain-{config}-"))
    up = UpProcess(data_dir, free_port(), agents=2, extra=("--models", MODEL, "--config", config))
    run = Run(config)
    try:
        boot = up.start()
        print(f"drain_restart: {config}: stack ready in {boot:.1f}s ({data_dir})", file=sys.stderr)
        db_url = up.info()["database"]
        asyncio.run(load(up, run, sessions, calls, rate, seed))
        for d in run.drains:
            d.started = drain_seen(data_dir, d.instance, d.started)
        prefix = f"drain-{config}-{seed}-"
        by_session, _ = asyncio.run(settle(db_url, prefix, sum(1 for a in run.phase.attempts if a.status == 200)))
        rows = asyncio.run(session_rows(db_url, CALLS_SQL, prefix))
        (data_dir / "calls.json").write_text(json.dumps(rows, default=str))  # for a look after the stack is gone
        # the router's decisions (candidates priced, kv_state each) for a look at any recompute
        decisions = asyncio.run(session_rows(db_url, DECISIONS_SQL, prefix))
        (data_dir / "decisions.json").write_text(json.dumps(decisions, default=str))
        result = analyse(run, rows, by_session, executions(data_dir, prefix), decisions)
        print("drain_restart: " + json.dumps(result), file=sys.stderr)
        return result
    finally:
        if up.proc is not None and up.proc.poll() is None:
            up.interrupt()


def markdown(results: list[dict], command: str) -> str:
    lines = ["## Rolling restart under load: drain-then-stop of each agent (bench/drain_restart.py)", "",
             f"    {command}", "",
             "| config | answered | lost | twice | drain | exit | drain s | moved returns by kv_source | "
             "of them forced (drained agent no choice) | prompt tokens found (cached) | ready again s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for d in r["drains"]:
            moved = ", ".join(f"{k} {v}" for k, v in sorted(d["moved_returns"].items())) or "-"
            forced = ", ".join(f"{k} {v}" for k, v in sorted(d["forced_moves"].items())) or "-"
            lines.append(f"| {r['config']} | {r['answered']} | {r['lost']} | {r['twice']} | {d['instance']} | "
                         f"{d['exit']} | {d['seconds']:.1f} | {moved} | {forced} | {d['moved_cached_share']} | "
                         f"{d['ready_again_s']} |")
    lines += ["", "| config | continuations after the first drain by kv_source | TTFT moved p50 / p90 (n) | "
              "TTFT other continuations p50 / p90 (n) | moved / other p50 |", "|---|---|---|---|---|"]
    for r in results:
        m, o = r["ttft_moved_s"], r["ttft_other_continuations_s"]
        cont = ", ".join(f"{k} {v}" for k, v in r["continuations_after_drain"].items())
        ratio = f"{m['p50'] / o['p50']:.2f}x" if m.get("n") and o.get("n") and o["p50"] > 0 else "-"
        lines.append(f"| {r['config']} | {cont} | {_fmt(m)} | {_fmt(o)} | {ratio} |")
    base = next((r for r in results if r["config"] == "talaria-no-migrate"), None)
    mine = next((r for r in results if r["config"] == "talaria"), None)
    if base and mine:
        def moved(r, src, key="moved_returns"):
            return sum(d[key].get(src, 0) for d in r["drains"])
        lines += ["", f"Moved returns recomputed: talaria {moved(mine, 'recompute')} of "
                      f"{sum(sum(d['moved_returns'].values()) for d in mine['drains'])} "
                      f"({moved(mine, 'recompute', 'forced_moves')} forced by a drain), talaria-no-migrate "
                      f"{moved(base, 'recompute')} of {sum(sum(d['moved_returns'].values()) for d in base['drains'])} "
                      f"({moved(base, 'recompute', 'forced_moves')} forced)."]
    return "\n".join(lines) + "\n"


def _fmt(s: dict) -> str:
    return f"{s['p50'] * 1000:.0f} / {s['p90'] * 1000:.0f} ms ({s['n']})" if s.get("n") else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=36)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--rate", type=float, default=0.8, help="sessions started per second")
    ap.add_argument("--configs", default="talaria,talaria-no-migrate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/data/drain_restart.json")
    args = ap.parse_args()
    if args.sessions < 1 or args.calls < 2 or args.rate <= 0:
        print("drain_restart: --sessions >= 1, --calls >= 2 and --rate > 0", file=sys.stderr)
        return 2
    command = (f"python bench/drain_restart.py --sessions {args.sessions} --calls {args.calls} --rate {args.rate:g} "
               f"--configs {args.configs}" + (f" --seed {args.seed}" if args.seed else ""))
    results = [one_config(c.strip(), args.sessions, args.calls, args.rate, args.seed) for c in args.configs.split(",")]
    (ROOT / args.out).write_text(json.dumps({"command": command, "results": results}, indent=2))
    print(markdown(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
