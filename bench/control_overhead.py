"""Control-plane overhead of a live call, hop by hop (issue 11, ask 5).

    python bench/control_overhead.py [--calls 60] [--concurrency 16] [--gap-ms 0] [--out FILE.md]

Overhead = client latency minus the agent's prefill + decode (engine time), for 1-token
calls on an idle one-agent stack, first sequential, then from `--concurrency` sessions at
once. The hops come from the `calls` row timestamps (one machine, one clock):

    client -> gateway submit      submitted_at - client send
    submit -> routed              routed_at - submitted_at          (JetStream + router + its publishes)
    routed -> started             started_at - routed_at            (agent intake + scheduler queue)
    agent not computing           (completed_at - started_at) - prefill_s - decode_s
    completed -> client           client receive - completed_at     (completion publish + reply)

Beside it, measured in the same run: a bare NATS request/reply between two processes (the
platform's floor for message passing here), and the CPU each process of the stack spends
per sequential call. `--gap-ms` paces each session like an agent (its tool time between
calls); on this VM a process woken after an idle gap answers slower, and the bare round trip
shows by how much.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live import call_rows, connect, live_stack, ms, nats_call, p50, pct  # noqa: E402

MODEL = "qwen3-tiny"
HOPS = ("client_to_submit", "submit_to_routed", "routed_to_started", "agent_not_computing", "completed_to_client")


def figures(sent: dict, rows: dict) -> dict[str, list[float]]:
    """Latency, overhead and each hop (ms lists) of the calls sent: call_id -> (send, latency)."""
    out: dict[str, list[float]] = {h: [] for h in ("latency", "overhead", *HOPS)}
    for cid, (t0, lat) in sent.items():
        r = rows.get(cid)
        if r is None or r["sta"] is None:
            continue
        engine = (r["prefill_s"] or 0) + (r["decode_s"] or 0)
        out["latency"].append(lat)
        out["overhead"].append(lat - engine)
        out["client_to_submit"].append(float(r["sub"]) - t0)
        out["submit_to_routed"].append(float(r["rou"]) - float(r["sub"]))
        out["routed_to_started"].append(float(r["sta"]) - float(r["rou"]))
        out["agent_not_computing"].append(float(r["com"]) - float(r["sta"]) - engine)
        out["completed_to_client"].append(t0 + lat - float(r["com"]))
    return out


async def measure(stack, n: int, concurrency: int, gap_s: float = 0.0) -> dict[str, list[float]]:
    nc = await connect(stack)
    sent: dict[str, tuple[float, float]] = {}  # call_id -> (send, latency)
    ids: list[str] = []
    lost: list[str] = []

    async def session(k: int, calls: int) -> None:
        for i in range(calls):
            call_id = f"ovh-{concurrency}-{k}-{i}"
            try:
                reply, lat, t0 = await nats_call(nc, MODEL, f"ovh-{concurrency}-{k}", f"ping {i}",
                                                 call_id=call_id, timeout=20)
            except Exception:  # no reply: counted, not measured
                lost.append(call_id)
                continue
            if type(reply).__name__ == "CallResult":
                sent[call_id] = (t0, lat)
                ids.append(call_id)
            if gap_s:  # the agent's tool time before its next call
                await asyncio.sleep(gap_s)

    await nats_call(nc, MODEL, "warmup", "warm up", max_tokens=2)  # opens the model on the agent
    per = max(1, n // concurrency)
    await asyncio.gather(*(session(k, per) for k in range(concurrency)))
    rows = await call_rows(stack, ids)
    await nc.close()
    out = figures({cid: sent[cid] for cid in ids}, rows)
    out["lost"] = lost
    return out


RESPONDER = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def answer(msg):
        await msg.respond(b"ok")
    await nc.subscribe("bench.echo", cb=answer)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def bare_round_trips(n: int, gap_s: float) -> list[float]:
    """The baseline, measured in the same run: request/reply between two processes over a bare
    NATS server on this machine (2 of the 5 transits a call makes), paced like the calls."""
    import subprocess
    import tempfile

    import nats

    from talaria.embedded import EmbeddedNats

    async def measure_rtt(url: str) -> list[float]:
        nc = await nats.connect(url)
        out = []
        for i in range(n + 5):
            t0 = time.perf_counter()
            await nc.request("bench.echo", b"x", timeout=5)
            if i >= 5:  # the first few warm the connection
                out.append(time.perf_counter() - t0)
            if gap_s:
                await asyncio.sleep(gap_s)
        await nc.close()
        return out

    with tempfile.TemporaryDirectory(prefix="talaria-bare-nats-") as tmp:
        server = EmbeddedNats(Path(tmp)).start()
        responder = subprocess.Popen([sys.executable, "-c", RESPONDER, server.url], stdout=subprocess.PIPE, text=True)
        try:
            responder.stdout.readline()  # "ready"
            return asyncio.run(measure_rtt(server.url))
        finally:
            responder.kill()
            responder.wait()
            server.stop()


def table(results: dict[int, dict[str, list[float]]]) -> str:
    lines = ["| figure (ms) | " + " | ".join(f"c={c} p50 | c={c} p95" for c in results) + " |",
             "|---|" + "---|---|" * len(results)]
    for key in ("latency", "overhead", *HOPS):
        cells = []
        for res in results.values():
            cells += [ms(p50(res[key])), ms(pct(res[key], 0.95))]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    bare = next(iter(results.values())).get("bare_rtt")
    if bare:
        lines.append(f"| baseline: bare NATS request/reply, two processes (2 transits) | {ms(p50(bare))} | "
                     f"{ms(pct(bare, 0.95))} |" + " | |" * (len(results) - 1))
        ratio = p50(next(iter(results.values()))["overhead"]) / p50(bare)
        lines.append(f"| c=1 overhead p50 / bare round trip p50 (a call makes 5 transits: 2.5 round trips) "
                     f"| {ratio:.1f}x | |" + " | |" * (len(results) - 1))
    lines.append("| calls measured / without reply (20 s) | "
                 + " | ".join(f"{len(r['latency'])} | {len(r['lost'])}" for r in results.values()) + " |")
    return "\n".join(lines)


def _processes(stack) -> dict[str, list]:
    """Each process of the stack (services, embedded NATS, Postgres with its backends)."""
    import psutil

    pids = {name: p.pid for name, p in stack.procs.items()}
    pids.update({type(s).__name__.replace("Embedded", "").lower(): s.proc.pid
                 for s in stack.embedded if s.proc is not None})
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            out[name] = [proc, *proc.children(recursive=True)]
    return out


def _cpu_s(procs: dict[str, list]) -> dict[str, float]:
    import psutil

    out = {}
    for name, group in procs.items():
        total = 0.0
        for proc in group:
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system
        out[name] = total
    return out


def cpu_table(per_call_ms: dict[str, float], calls: int) -> str:
    """CPU milliseconds each process spent per call over the sequential run: what the stack
    burns for one call on its shared cores (load-independent, unlike the latencies)."""
    lines = [f"| CPU per call, c=1 ({calls} calls, ms) | " + " | ".join(per_call_ms) + " | all |",
             "|---|" + "---|" * (len(per_call_ms) + 1),
             "| | " + " | ".join(f"{v:.2f}" for v in per_call_ms.values())
             + f" | {sum(per_call_ms.values()):.2f} |"]
    return "\n".join(lines)


def measure_all(args) -> str:
    with live_stack(agents=1) as stack:
        gap = args.gap_ms / 1000
        procs = _processes(stack)
        before = _cpu_s(procs)
        results = {1: asyncio.run(measure(stack, args.calls, 1, gap))}
        after = _cpu_s(procs)
        results[1]["bare_rtt"] = bare_round_trips(40, gap)
        results[args.concurrency] = asyncio.run(measure(stack, args.calls * 2, args.concurrency, gap))
    calls = len(results[1]["latency"]) or 1
    cpu = {name: (after[name] - before[name]) * 1000 / calls for name in before if name in after}
    if gap:  # the paced run's CPU would mostly be the idle stack's own background work
        return table(results)
    return table(results) + "\n\n" + cpu_table(cpu, calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="think time between a session's calls (an agent's tool run); 0: back to back")
    p.add_argument("--out", default=None, help="append the table to this Markdown file")
    args = p.parse_args()
    text = measure_all(args)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
