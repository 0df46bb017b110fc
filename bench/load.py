"""Open-loop load on a real stack (`talaria up`, embedded NATS + Postgres, two agents): short
calls arrive at a fixed rate whatever the answers, as independent clients do. For each rate:
calls admitted (200), shed (429/503 with Retry-After), failed otherwise, and the admitted
calls' latency p50/p99, with admission control on (the default target) and off.

    python bench/load.py [--rates 40,80,160,300] [--seconds 20] [--out results/load.md]
    python bench/load.py --routers 1,2 --rounds 2 [--rates 10,20,40,80] [--out results/routers_load.md]

The second form compares router replicas (`talaria up --routers N`), admission control on:
stacks with each router count take turns (1, 2, 1, 2, ...: the box's other load falls on both
alike), and each rate's CPU seconds per admitted call are read from /proc for every service
and server of the stack (the routers summed).

The sustainable rate: the highest offered rate at which admission control shed nothing and
the admitted p99 stayed under the target. Past it, the shedding curve: what share is refused,
and the admitted calls' p99, which should stay bounded (without admission control it grows
with the queue).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import API_KEY, UpProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from talaria.embedded import free_port  # noqa: E402
from talaria.shared.settings import GatewaySettings  # noqa: E402
from talaria.shared.stats import quantile  # noqa: E402

CLIENT_TIMEOUT_S = 120.0


async def one(http, url: str, results: list, i: int) -> None:
    body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": f"call {i}: go"}],
            "max_tokens": 4, "temperature": 0}
    t0 = time.monotonic()
    try:
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}",
                                                      "X-Session-Id": uuid.uuid4().hex},
                             timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as r:
            await r.read()
            results.append((r.status, time.monotonic() - t0, r.headers.get("Retry-After")))
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        results.append((0, time.monotonic() - t0, type(exc).__name__))


async def offered(port: int, rate: float, seconds: float) -> dict:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    results: list = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        tasks, start = [], time.monotonic()
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule (open loop), not synchronisation
            tasks.append(asyncio.create_task(one(http, url, results, i)))
        await asyncio.gather(*tasks)
    ok = sorted(t for s, t, _ in results if s == 200)
    shed = [r for r in results if r[0] in (429, 503)]
    return {"rate": rate, "calls": len(results), "ok": len(ok), "shed": len(shed),
            "shed_with_retry_after": sum(1 for r in shed if r[2]), "failed": len(results) - len(ok) - len(shed),
            "p50_s": quantile(ok, 0.5) if ok else None, "p99_s": quantile(ok, 0.99) if ok else None,
            "goodput_per_s": len(ok) / seconds}


def run(rates: list[float], seconds: float, target: float) -> list[dict]:
    rows = []
    for admission in (True, False):
        os.environ["TALARIA_ADMISSION_TARGET_QUEUE_S"] = str(target if admission else 0)
        data = Path(tempfile.mkdtemp(prefix="talaria-load-"))
        up = UpProcess(data, free_port())
        try:
            up.start()
            asyncio.run(offered(up.port, 5, 4))  # warm: models loaded, sessions seen
            for rate in rates:
                row = {"admission": admission, **asyncio.run(offered(up.port, rate, seconds))}
                print("load: " + json.dumps(row), file=sys.stderr)
                rows.append(row)
                time.sleep(3)  # let the queue of the last rate drain before the next
        finally:
            if up.proc is not None and up.proc.poll() is None:
                up.interrupt()
    return rows


def _stats() -> dict[int, list[str]]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                pass
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each process and its live children (Postgres's backends) so
    far, by service (router-0, router-1 -> router; agents together)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = _stats()
    out: dict[str, float] = {}
    for name, pid in pids.items():
        family = [pid] + [p for p, f in stats.items() if int(f[1]) == pid]
        used = sum(int(stats[p][11]) + int(stats[p][12]) for p in family if p in stats) / tick
        group = "router" if name.startswith("router") else "agents" if name.startswith(("agent", "hot-")) else \
            name.replace("Embedded", "").lower()
        out[group] = out.get(group, 0.0) + used
    return out


def peer_lag(metrics: dict[str, str]) -> dict | None:
    """Routers' `talaria_router_peer_placement_lag_seconds`, summed: mean and bucket quantiles."""
    import urllib.request

    buckets: dict[float, float] = {}
    total = count = 0.0
    for name, url in metrics.items():
        if not name.startswith("router"):
            continue
        with urllib.request.urlopen(url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("talaria_router_peer_placement_lag_seconds_bucket"):
                    le = float(line.split('le="', 1)[1].split('"', 1)[0])
                    buckets[le] = buckets.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
                elif line.startswith("talaria_router_peer_placement_lag_seconds_sum"):
                    total += float(line.rsplit(" ", 1)[1])
                elif line.startswith("talaria_router_peer_placement_lag_seconds_count"):
                    count += float(line.rsplit(" ", 1)[1])
    if not count:
        return None

    def q(f):  # the upper bound of the bucket holding quantile f
        return next(le for le, n in sorted(buckets.items()) if n >= f * count)
    return {"count": count, "mean_s": total / count, "p50_le_s": q(0.5), "p95_le_s": q(0.95)}


def run_routers(counts: list[int], rounds: int, rates: list[float], seconds: float, target: float) -> list[dict]:
    rows = []
    os.environ["TALARIA_ADMISSION_TARGET_QUEUE_S"] = str(target)
    for rnd in range(rounds):
        for n in counts:
            data = Path(tempfile.mkdtemp(prefix="talaria-load-"))
            up = UpProcess(data, free_port(), extra=("--routers", str(n)))
            try:
                up.start()
                pids = up.info()["pids"]
                asyncio.run(offered(up.port, 5, 4))  # warm: models loaded, sessions seen
                for rate in rates:
                    before, t0 = cpu_seconds(pids), time.monotonic()
                    row = {"routers": n, "round": rnd, **asyncio.run(offered(up.port, rate, seconds))}
                    wall = time.monotonic() - t0
                    after = cpu_seconds(pids)
                    used = {k: after[k] - before.get(k, 0.0) for k in after}
                    row["cpu_ms_per_call"] = {k: 1000 * v / max(1, row["ok"]) for k, v in used.items()}
                    row["cpu_share"] = {k: v / wall for k, v in used.items()}  # of one core
                    print("load: " + json.dumps(row), file=sys.stderr)
                    rows.append(row)
                    time.sleep(3)  # let the queue of the last rate drain before the next
                if n > 1:
                    rows[-1]["peer_lag"] = peer_lag(up.info()["metrics"])
            finally:
                if up.proc is not None and up.proc.poll() is None:
                    up.interrupt()
    return rows


def routers_markdown(rows: list[dict], command: str, target: float, seconds: float) -> str:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    counts = sorted({r["routers"] for r in rows})
    rates = sorted({r["rate"] for r in rows})
    services = sorted({k for r in rows for k in r["cpu_ms_per_call"]})

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    lines = [
        "# One router against two (router replicas under load)", "",
        f"`{command}` — `talaria up --agents 2 --routers N` on embedded NATS + PostgreSQL; open-loop short "
        f"calls (qwen3-tiny, 4 tokens, each its own session) at a fixed rate for {seconds:g} s each, admission "
        f"target {target:g} s. Stacks with one and two routers took turns in the same run. **A shared 2-core "
        "box**: the load generator, NATS, Postgres, both agents' engines and every service share two cores "
        "with other jobs, so absolute figures are the box's, and only the ratio between the two router "
        "counts (same run, alternating) means anything.", "",
    ]
    for n in counts:
        mine = [r for r in rows if r["routers"] == n]
        calm = [rate for rate in rates if all(r["shed"] == 0 and r["failed"] == 0 and (r["p99_s"] or 0) <= target
                                              for r in mine if r["rate"] == rate)]
        lines.append(f"- {n} router(s): sustainable rate (every round: nothing shed, admitted p99 <= {target:g} s) "
                     f"**{max(calm) if calm else 'below the lowest rate tried'}** calls/s")
    lines += ["", "| routers | offered /s | ok (mean of rounds) | shed | failed | admitted p50 s | admitted p99 s "
              "| goodput /s | " + " | ".join(f"{s} CPU ms/call" for s in services) + " |",
              "|---" * (8 + len(services)) + "|"]
    for n in counts:
        for rate in rates:
            rs = [r for r in rows if r["routers"] == n and r["rate"] == rate]
            cpu = [mean([r["cpu_ms_per_call"].get(s) for r in rs]) for s in services]
            lines.append(f"| {n} | {rate:g} | {mean([r['ok'] for r in rs]):.0f} | {mean([r['shed'] for r in rs]):.0f} "
                         f"| {mean([r['failed'] for r in rs]):.0f} | {f(mean([r['p50_s'] for r in rs]))} "
                         f"| {f(mean([r['p99_s'] for r in rs]))} | {mean([r['goodput_per_s'] for r in rs]):.1f} | "
                         + " | ".join(f(c) for c in cpu) + " |")
    lines += ["", "CPU share of one core per service at each rate (mean of rounds):", "",
              "| routers | offered /s | " + " | ".join(services) + " |", "|---" * (2 + len(services)) + "|"]
    for n in counts:
        for rate in rates:
            rs = [r for r in rows if r["routers"] == n and r["rate"] == rate]
            lines.append(f"| {n} | {rate:g} | " + " | ".join(
                f(mean([r["cpu_share"].get(s) for r in rs])) for s in services) + " |")
    lags = [r["peer_lag"] for r in rows if r.get("peer_lag")]
    if lags:
        lines += ["", "A placement's lag to the other router (decision to the peer folding its routed call; "
                  "`talaria_router_peer_placement_lag_seconds`, whole run of each stack):", ""]
        for lag in lags:
            lines.append(f"- {lag['count']:.0f} placements: mean {1000 * lag['mean_s']:.1f} ms, p50 <= "
                         f"{1000 * lag['p50_le_s']:.1f} ms, p95 <= {1000 * lag['p95_le_s']:.1f} ms")
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], command: str, target: float, seconds: float) -> str:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    on = [r for r in rows if r["admission"]]
    calm = [r["rate"] for r in on if r["shed"] == 0 and r["failed"] == 0 and (r["p99_s"] or 0) <= target]
    lines = [
        "# Load shedding (admission control)", "",
        f"`{command}` — `talaria up --agents 2` on embedded NATS + PostgreSQL; open-loop short calls "
        f"(qwen3-tiny, 4 tokens, each its own session) at a fixed rate for {seconds:g} s each; admission "
        f"target {target:g} s (`TALARIA_ADMISSION_TARGET_QUEUE_S`), and off (0). Shared 2-core CPU machine.", "",
        f"Sustainable rate (nothing shed, admitted p99 <= {target:g} s): "
        f"**{max(calm) if calm else 'below the lowest rate tried'}** calls/s.", "",
        "| admission | offered /s | calls | ok | shed (429/503) | with Retry-After | failed | admitted p50 s "
        "| admitted p99 s | goodput /s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {'on' if r['admission'] else 'off'} | {r['rate']:g} | {r['calls']} | {r['ok']} | {r['shed']} "
                     f"| {r['shed_with_retry_after']} | {r['failed']} | {f(r['p50_s'])} | {f(r['p99_s'])} "
                     f"| {r['goodput_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="40,80,160,300")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--target", type=float, default=GatewaySettings.admission_target_queue_s)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None, help="also write the raw rows here (results/ keeps the report only)")
    ap.add_argument("--routers", default=None, help="compare router counts, e.g. 1,2 (admission on)")
    ap.add_argument("--rounds", type=int, default=1, help="with --routers: alternate the counts this many times")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if args.routers:
        counts = [int(n) for n in args.routers.split(",")]
        rows = run_routers(counts, args.rounds, rates, args.seconds, args.target)
        command = (f"python bench/load.py --routers {args.routers} --rounds {args.rounds} --rates {args.rates} "
                   f"--seconds {args.seconds:g}")
        out = ROOT / (args.out or "results/routers_load.md")
        out.write_text(routers_markdown(rows, command, args.target, args.seconds))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        print(out.read_text())
        return 0
    args.out = args.out or "results/load.md"
    rows = run(rates, args.seconds, args.target)
    command = f"python bench/load.py --rates {args.rates} --seconds {args.seconds:g}"
    out = ROOT / args.out
    out.write_text(markdown(rows, command, args.target, args.seconds))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
