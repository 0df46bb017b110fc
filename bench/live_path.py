"""The live call path on a running stack (issue 11): returns, head-of-line blocking and the
router's queue estimate, idle KV under pressure, cancellation, big bodies, readiness.

    python bench/live_path.py SCENARIO [--out results/live_path.md]
    SCENARIO: returns | hol | kv | cancel | bodies | ready | all

Each scenario starts its own stack on embedded servers and prints one Markdown table.
  returns  fresh call vs the same session's immediate return: TTFT and slot wait, p50/p95,
           on an idle 2-agent stack and with 8 background sessions calling in a loop
  hol      a long prompt, then short calls of the same model: their TTFT; and for every
           call the router's queue estimate (decision row) against the measured queue
  kv       20 idle sessions of 6,000-byte prompts, then 20 new 300-byte calls: how many fail
  cancel   64 HTTP streams dropped after their first chunk: tokens generated after the drop
  bodies   normal calls' latency idle and while 8 clients send 3.7 MB bodies
  ready    /healthz and /readyz with no agent serving, then with one
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import live  # noqa: E402
from live import call_rows, connect, http_headers, live_stack, ms, nats_call, p50, pct, text_of_bytes  # noqa: E402

MODEL = "qwen3-tiny"


def ok(reply) -> bool:
    return type(reply).__name__ == "CallResult"


# ---- returns ---------------------------------------------------------------------------------

async def _pairs(stack, n: int, tag: str, out: dict[str, list[float]], models: list[str]) -> None:
    nc = await connect(stack)
    for i in range(n):
        sid = f"ret-{tag}-{i}"
        first = text_of_bytes(600, i)
        model = models[i % len(models)]
        r1, _, _ = await nats_call(nc, model, sid, first, max_tokens=8)
        if not ok(r1):
            out["errors"].append(1)
            continue
        r2, _, _ = await nats_call(nc, model, sid, [("user", first), ("assistant", r1.text),
                                                      ("user", f"tool result {i}: ok")], max_tokens=8)
        if not ok(r2):
            out["errors"].append(1)
            continue
        step = r1.timings.decode_s / max(1, r1.usage.completion_tokens - 1)
        out["fresh_ttft"].append(r1.timings.ttft_s)
        out["return_ttft"].append(r2.timings.ttft_s)
        out["fresh_wait"].append(r1.timings.slot_wait_s)
        out["return_wait"].append(r2.timings.slot_wait_s)
        out["decode_step"].append(step)
        out["return_kv"].append(r2.kv_source)
    await nc.close()


async def _background(stack, k: int, stop: asyncio.Event) -> None:
    nc = await connect(stack)
    msgs = [("user", text_of_bytes(800, 100 + k))]
    while not stop.is_set():
        try:
            r, _, _ = await nats_call(nc, MODEL, f"bg-{k}", msgs, max_tokens=24, timeout=60)
        except Exception:
            continue
        if ok(r):
            msgs = msgs + [("assistant", r.text), ("user", "next step")]
            if len(msgs) > 12:
                msgs = [("user", text_of_bytes(800, 100 + k + len(msgs)))]
        await asyncio.sleep(0.4)  # the agent's tool time between calls
    await nc.close()


def returns(args) -> str:
    rows = []
    with live_stack(agents=2) as stack:
        for label, load in (("idle", 0), ("8 sessions", 8)):
            out: dict[str, list] = {k: [] for k in ("fresh_ttft", "return_ttft", "fresh_wait", "return_wait",
                                                    "decode_step", "return_kv", "errors")}

            async def go():
                stop = asyncio.Event()
                bg = [asyncio.create_task(_background(stack, k, stop)) for k in range(load)]
                await asyncio.sleep(2.0 if load else 0)  # let the load settle
                await _pairs(stack, args.pairs, label.replace(" ", ""), out, args.models.split(","))
                stop.set()
                await asyncio.gather(*bg, return_exceptions=True)

            asyncio.run(go())
            over = sum(1 for w, s in zip(out["return_wait"], out["decode_step"]) if w > max(s, 0.005) + 0.02)
            rows.append(f"| {label} | {len(out['fresh_ttft'])} | {ms(p50(out['fresh_ttft']))} / "
                        f"{ms(pct(out['fresh_ttft'], .95))} | {ms(p50(out['return_ttft']))} / "
                        f"{ms(pct(out['return_ttft'], .95))} | {ms(p50(out['return_wait']))} / "
                        f"{ms(pct(out['return_wait'], .95))} | {ms(max(out['return_wait'], default=float('nan')))} | "
                        f"{ms(p50(out['decode_step']))} | {over} | "
                        f"{sum(1 for k in out['return_kv'] if k == 'device')}/{len(out['return_kv'])} | "
                        f"{len(out['errors'])} |")
    head = ("| load | pairs | fresh TTFT p50 / p95 (ms) | return TTFT p50 / p95 (ms) | return slot wait p50 / p95 (ms)"
            " | return wait max (ms) | decode step p50 (ms) | returns waiting > 1 step + 20 ms | return KV on device"
            " | errors |\n|---|---|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows)


# ---- head-of-line blocking and the queue estimate ---------------------------------------------

async def _audit(stack, name: str) -> list[dict]:
    """Rows of an operator audit query; [] where this checkout does not have it."""
    from talaria.audit import audits, query

    if name not in audits():
        return []
    return await query(stack.database_url, name, {})


def hol(args) -> str:
    with live_stack(agents=args.agents) as stack:
        async def go():
            nc = await connect(stack)
            await nats_call(nc, MODEL, "warm", "warm up", max_tokens=2)
            # Past the warm-up call's lease (tau = 1 s): a live lease makes round admission
            # refuse a prompt whose own prefill exceeds the budget.
            await asyncio.sleep(1.5)
            long_task = asyncio.create_task(
                nats_call(nc, MODEL, "long", text_of_bytes(args.long_bytes), max_tokens=4, timeout=600,
                          call_id="hol-long"))
            await asyncio.sleep(0.5)  # the long prefill is under way
            shorts = []
            for i in range(args.shorts):
                r, lat, _ = await nats_call(nc, MODEL, f"short-{i}", f"34 token question number {i:03d}.",
                                            max_tokens=4, timeout=600, call_id=f"hol-short-{i}")
                shorts.append((r, lat))
                await asyncio.sleep(0.2)
            long_r, long_lat, _ = await long_task
            await nc.close()
            return long_r, long_lat, shorts

        long_r, long_lat, shorts = asyncio.run(go())
        if not ok(long_r):
            print(f"  long call failed: {long_r}", file=sys.stderr)
        ids = ["hol-long"] + [f"hol-short-{i}" for i in range(args.shorts)]
        rows = asyncio.run(call_rows(stack, ids))
        audit = asyncio.run(_audit(stack, "queue_estimate"))
    long_inst = rows.get("hol-long", {}).get("instance_id")
    ttfts = [r.timings.ttft_s for r, _ in shorts if ok(r)]
    same = [r.timings.ttft_s for r, _ in shorts if ok(r) and r.instance_id == long_inst]
    # The operator audit (ops/audit/queue_estimate.sql) gives estimated vs measured per call.
    errs = []
    for row in audit:
        if row["call_id"] in ids:
            errs.append(float(row["error_s"]))
            print(f"  {row['call_id']}: {row['instance_id']} queue estimated {row['queue_est_s']} s "
                  f"(+{row['reserved_s']} s reserved), measured {row['queue_measured_s']} s", file=sys.stderr)
    abs_err = [abs(e) for e in errs]
    lines = [
        f"| figure ({args.agents} agent(s)) | value |", "|---|---|",
        f"| long prompt tokens / prefill (s) | {rows.get('hol-long', {}).get('prompt_tokens')} / "
        f"{(rows.get('hol-long', {}).get('prefill_s') or float('nan')):.2f} |",
        f"| short calls | {len(ttfts)} ok of {len(shorts)}; {len(same)} on the long call's instance |",
        f"| short TTFT p50 / p95 / max (ms) | {ms(p50(ttfts))} / {ms(pct(ttfts, .95))} / "
        f"{ms(max(ttfts, default=float('nan')))} |",
        f"| short TTFT on the long call's instance, max (ms) | {ms(max(same, default=float('nan')))} |",
        f"| queue estimate error (estimated - measured), p50 / p95 abs (ms) | {ms(p50(errs))} / {ms(pct(abs_err, .95))} |",
        f"| queue estimate error, max abs (ms) | {ms(max(abs_err, default=float('nan')))} |",
    ]
    return "\n".join(lines)


# ---- idle KV under pressure -------------------------------------------------------------------

def kv(args) -> str:
    with live_stack(agents=2) as stack:
        async def go():
            nc = await connect(stack)
            fill = [await nats_call(nc, MODEL, f"fill-{i}", text_of_bytes(6000, i), max_tokens=4, timeout=120)
                    for i in range(args.fill)]
            await asyncio.sleep(1.5)  # idle: the snapshots now show the sessions' KV at rest
            new = [await nats_call(nc, MODEL, f"new-{i}", text_of_bytes(300, 50 + i), max_tokens=4, timeout=120)
                   for i in range(args.new)]
            await nc.close()
            return fill, new

        fill, new = asyncio.run(go())
    for r, _, _ in fill:
        if not ok(r):
            print(f"  fill failed: {r.status} {r.message}", file=sys.stderr)
    codes = {}
    for r, _, _ in new:
        key = "ok" if ok(r) else f"{r.status} {r.message[:40]}"
        codes[key] = codes.get(key, 0) + 1
    return ("| idle sessions filled (ok) | new calls | outcomes of the new calls |\n|---|---|---|\n"
            f"| {sum(ok(r) for r, _, _ in fill)}/{len(fill)} | {len(new)} | "
            + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())) + " |")


# ---- cancellation -----------------------------------------------------------------------------

def cancel(args) -> str:
    import aiohttp

    with live_stack(agents=2) as stack:
        async def one(session: aiohttp.ClientSession, i: int) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"stream {i}"}],
                    "max_tokens": args.cancel_tokens, "temperature": 0, "stream": True}
            async with session.post(stack.gateway_url + "/v1/chat/completions", json=body,
                                    headers=http_headers({"X-Session-Id": f"cancel-{i}"})) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {") and b'"content": "' in line and b'"content": ""' not in line:
                        break  # first real chunk: drop the connection
            # leaving the context closes the connection

        async def go():
            t0 = time.time()
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(*(one(s, i) for i in range(args.streams)))
            dropped = time.time()
            rows = await _cancel_rows(stack, "%cancel-%", args.streams)  # session ids may carry a tenant prefix
            return t0, dropped, rows

        t0, dropped, rows = asyncio.run(go())
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    tokens = sum(r["output_tokens"] or 0 for r in rows)
    busy = max((float(r["fin"]) for r in rows if r["fin"] is not None), default=dropped) - dropped
    return ("| streams | max_tokens | tokens generated in all | rows by outcome | agent busy after the last drop (s) |\n"
            "|---|---|---|---|---|\n"
            f"| {args.streams} | {args.cancel_tokens} | {tokens} | "
            + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())) + f" | {busy:.2f} |")


async def _cancel_rows(stack, like: str, n: int, timeout: float = 120.0):
    import asyncpg

    from talaria.shared.settings import asyncpg_dsn

    conn = await asyncpg.connect(asyncpg_dsn(stack.database_url))
    try:
        deadline = time.monotonic() + timeout
        while True:
            rows = await conn.fetch(
                "SELECT outcome, output_tokens, extract(epoch from coalesce(completed_at, started_at)) AS fin"
                " FROM calls WHERE session_id LIKE $1", like)
            if (sum(r["outcome"] not in ("submitted", "routed", "running") for r in rows) >= n
                    or time.monotonic() > deadline):
                return rows
            await asyncio.sleep(0.5)  # telemetry projects asynchronously; poll
    finally:
        await conn.close()


# ---- big bodies -------------------------------------------------------------------------------

def bodies(args) -> str:
    import aiohttp

    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 3_700_000}],
                      "max_tokens": 4}).encode()

    with live_stack(agents=2) as stack:
        url = stack.gateway_url + "/v1/chat/completions"

        async def normal(s, n: int) -> list[float]:
            lat = []
            for i in range(n):
                t = time.perf_counter()
                async with s.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                                             "max_tokens": 1, "temperature": 0},
                                  headers=http_headers({"X-Session-Id": f"norm-{i}"})) as r:
                    await r.read()
                lat.append(time.perf_counter() - t)
            return lat

        async def flood(s, stop: asyncio.Event, statuses: list[int]) -> None:
            while not stop.is_set():
                async with s.post(url, data=big, headers=http_headers({"Content-Type": "application/json"})) as r:
                    await r.read()
                    statuses.append(r.status)

        async def go():
            async with aiohttp.ClientSession() as s:
                await normal(s, 3)  # warm up
                idle = await normal(s, args.normal)
                stop, statuses = asyncio.Event(), []
                async with aiohttp.ClientSession() as s2:
                    fl = [asyncio.create_task(flood(s2, stop, statuses)) for _ in range(8)]
                    await asyncio.sleep(1.0)
                    loaded = await normal(s, args.normal)
                    stop.set()
                    await asyncio.gather(*fl, return_exceptions=True)
            return idle, loaded, statuses

        idle, loaded, statuses = asyncio.run(go())
    st = {}
    for c in statuses:
        st[c] = st.get(c, 0) + 1
    return ("| normal calls | idle p50 / p95 (ms) | with 8 x 3.7 MB clients p50 / p95 (ms) | ratio of p50s | big bodies answered |\n"
            "|---|---|---|---|---|\n"
            f"| {len(idle)} | {ms(p50(idle))} / {ms(pct(idle, .95))} | {ms(p50(loaded))} / {ms(pct(loaded, .95))} | "
            f"{p50(loaded) / p50(idle):.2f}x | " + ", ".join(f"{k}: {v}" for k, v in sorted(st.items())) + " |")


# ---- readiness --------------------------------------------------------------------------------

def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=http_headers()), timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.load(e)
        except Exception:
            return e.code, {}


def ready(args) -> str:
    lines = ["| stack | /healthz | /readyz | /v1/models |", "|---|---|---|---|"]
    for agents in (0, 1):
        with live_stack(agents=agents) as stack:
            cells = []
            for path in ("/healthz", "/readyz", "/v1/models"):
                code, body = _get(stack.gateway_url + path)
                extra = f" ({len(body.get('data', []))} models)" if path == "/v1/models" else ""
                cells.append(f"{code}{extra}")
            lines.append(f"| {agents} agent(s) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SCENARIOS = {"returns": returns, "hol": hol, "kv": kv, "cancel": cancel, "bodies": bodies, "ready": ready}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=[*SCENARIOS, "all"])
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--models", default=MODEL, help="returns: pairs cycle through these models")
    p.add_argument("--long-bytes", type=int, default=28_000)
    p.add_argument("--agents", type=int, default=2, help="hol: agents in the stack (1: all calls share it)")
    p.add_argument("--shorts", type=int, default=10)
    p.add_argument("--fill", type=int, default=20)
    p.add_argument("--new", type=int, default=20)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--cancel-tokens", type=int, default=200)
    p.add_argument("--normal", type=int, default=30)
    p.add_argument("--out", default=None, help="append the tables to this Markdown file")
    args = p.parse_args()
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for name in names:
        t0 = time.time()
        text = f"### {name}\n\n" + SCENARIOS[name](args) + "\n"
        print(text, flush=True)
        print(f"({name}: {time.time() - t0:.0f} s)", file=sys.stderr)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
