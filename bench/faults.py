"""Fault injection on a real stack: `talaria up` (embedded NATS + Postgres, two agents), at
least 12 concurrent agent sessions over three models, one fault per phase.

    python bench/faults.py [--sessions 12] [--calls 6] [--faults all] [--out results/faults.md]

Each phase starts fresh sessions, injects its fault ~FAULT_AT_S into the load, lets the
stack heal (the supervisor restarts what died), and then checks what the clients saw
against what Postgres recorded:

- ok: logical calls answered 200 (a client retries 503 / refused connections, as an
  OpenAI client does, within RETRY_BUDGET_S, sending one `Idempotency-Key` per logical call
  with every retry of it, as an SDK reuses its key across retries);
- errors: attempts answered with a clear error (HTTP error with a JSON body, or a refused /
  reset connection) — each retried;
- lost: calls that got no answer within the client's timeout, plus rows still not final
  (submitted / routed / running) after the stack settled;
- twice: completed rows beyond the answers clients received (work that ran twice, or ran
  for a client that had already been given an error), or executions beyond one per call
  counted from the agents' `call completed` log lines (one per execution; the rows record
  a call's first run only);
- rows wrong: completed rows missing for answers received, and `sessions` counters that
  disagree with the `calls` rows;
- recovery: from the fault (restart-after-ctrl-c: from "ready" again) to the end of the last call that failed or was abnormally slow
  (over 3x the pre-fault median latency + 0.5 s) — 0 when no client noticed; in-flight
  wait: the longest wait of a call that was in flight when the fault hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults_report import FAULT_AT_S, MODELS, goals_met, write_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from talaria import running  # noqa: E402
from talaria.embedded import free_port  # noqa: E402
from talaria.services.gateway.auth import client_session, scoped_session  # noqa: E402
from talaria.shared.settings import asyncpg_dsn  # noqa: E402

CLIENT_TIMEOUT_S = 45.0  # an attempt with no answer by then is counted lost
CALL_TIMEOUT_S = 30.0  # the gateway's: calls carry this deadline
RETRY_BUDGET_S = 90.0  # a logical call keeps retrying retryable errors this long
TENANT, API_KEY = "bench", "bench-faults-key-0123456789"  # configured: the same across restarts
SETTLE_S = 60.0  # > telemetry's ack_wait (30 s): a killed projector's batch comes back after it
FAULTS = ("kill-router", "stop-router", "kill-agent", "kill-telemetry", "kill-gateway", "postgres-immediate",
          "nats-pause", "restart-after-ctrl-c", "kill-nats", "slowloris", "big-body", "overload", "disk-full", "disk-full-hard")
FLOOD_TENANT, FLOOD_KEY = "flood", "bench-flood-key-0123456789"  # another tenant: big bodies, overload
HOLD_S = 10.0  # how long the slowloris, overload and disk-full faults last
PAUSES = 3  # stop-router: SIGSTOP / SIGCONT of one of two routers this many times, HOLD_S each


@dataclass
class Attempt:
    session: str
    index: int
    start: float
    end: float = 0.0
    status: int = 0  # HTTP status; 0 = no HTTP answer
    error: str = ""
    replayed: bool = False  # answered by the call an earlier attempt started (Idempotent-Replayed)


@dataclass
class Phase:
    fault: str
    fault_at: float = 0.0
    ready_at: float = 0.0  # restart-after-ctrl-c: when the new stack said ready
    rows_final_s: float = 0.0  # from the end of the load until every row in Postgres was final
    attempts: list[Attempt] = field(default_factory=list)
    ok: int = 0
    gave_up: int = 0  # logical calls that ended in a non-retryable error or ran out of budget
    note: str = ""
    keys: bool = True  # clients send an Idempotency-Key (--no-idempotency-keys: the baseline without)


class UpProcess:
    """`talaria up` as a child process: what an operator runs."""

    def __init__(self, data_dir: Path, port: int, agents: int = 2, extra: tuple[str, ...] = ()) -> None:
        self.data_dir, self.port, self.agents, self.extra = data_dir, port, agents, tuple(extra)
        self.proc: subprocess.Popen | None = None
        self.log = (data_dir / "up.log").open("a")

    def start(self, timeout: float = 240.0) -> float:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TALARIA_CALL_TIMEOUT_S=str(CALL_TIMEOUT_S),
                   TALARIA_API_KEYS=f"{TENANT}:{API_KEY},{FLOOD_TENANT}:{FLOOD_KEY}",
                   TALARIA_LOG_LEVEL="info", PYTHONPATH=str(ROOT))
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "talaria.cli", "up", "--port", str(self.port), "--data-dir", str(self.data_dir),
             "--agents", str(self.agents), *self.extra], stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        while time.monotonic() - t0 < timeout:
            text = (self.data_dir / "up.log").read_text(errors="replace")
            if text.count("talaria: ready in") > self.ready_seen:
                self.ready_seen += 1
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"talaria up exited:\n{text[-3000:]}")
            time.sleep(0.2)  # polling an external process's log for readiness
        raise RuntimeError("talaria up not ready")

    ready_seen = 0

    def info(self) -> dict:
        return json.loads((self.data_dir / "stack.json").read_text())

    def pid(self, name: str) -> int:
        return self.info()["pids"][name]

    def interrupt(self, timeout: float = 60.0) -> None:
        """Ctrl-C: talaria up stops everything it started."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout)


async def one_call(http: aiohttp.ClientSession, url: str, phase: Phase, session: str, index: int,
                   model: str, history: list[dict], key: str) -> bool:
    body = {"model": model, "messages": history, "max_tokens": 4, "temperature": 0}
    give_up = time.monotonic() + RETRY_BUDGET_S
    headers = {"X-Session-Id": session, "Authorization": f"Bearer {key}"}
    if phase.keys:
        headers["Idempotency-Key"] = uuid.uuid4().hex  # one per logical call, sent with each retry
    while True:
        a = Attempt(session, index, time.monotonic())
        phase.attempts.append(a)
        retry_after = 0.5
        try:
            async with http.post(url, json=body, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as r:
                a.status = r.status
                a.replayed = r.headers.get("Idempotent-Replayed") == "true"
                data = await r.json(content_type=None)
                a.end = time.monotonic()
                if r.status == 200:
                    history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
                    return True
                a.error = (data.get("error") or {}).get("code") or str(r.status)
                retry_after = float(r.headers.get("Retry-After", "0.5"))
                if r.status not in (429, 502, 503):
                    return False  # not retryable: the client has its answer
        except asyncio.TimeoutError:
            a.end, a.error = time.monotonic(), "no answer"
            return False
        except (aiohttp.ClientConnectionError, aiohttp.ContentTypeError, ValueError) as exc:
            a.end, a.error = time.monotonic(), type(exc).__name__
        if time.monotonic() + retry_after > give_up:
            return False
        await asyncio.sleep(min(retry_after, 1.0))


async def run_session(http, url: str, key: str, phase: Phase, session: str, calls: int,
                      rng: random.Random) -> None:
    model = MODELS[rng.randrange(len(MODELS))]
    history: list[dict] = []
    for i in range(calls):
        history.append({"role": "user", "content": f"step {i}: run the tool and report " + "x" * rng.randrange(20)})
        if await one_call(http, url, phase, session, i, model, history, key):
            phase.ok += 1
        else:
            phase.gave_up += 1
            return  # an agent whose call failed for good stops its session
        await asyncio.sleep(rng.uniform(0.2, 0.5))  # the tool runs


async def load(up: UpProcess, phase: Phase, sessions: int, calls: int, inject, seed: int) -> None:
    url = f"http://127.0.0.1:{up.port}/v1/chat/completions"
    key = API_KEY
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(run_session(http, url, key, phase, f"{phase.fault}-{seed}-s{k}", calls,
                                                 random.Random(rng.random()))) for k in range(sessions)]
        await asyncio.sleep(FAULT_AT_S)
        # ... at a moment a call is in flight: a call takes ~10 ms against 200-500 ms of tool
        # time, so an instant picked blindly often finds none (and tests nothing in flight).
        while not any(a.end == 0.0 for a in phase.attempts) and not all(t.done() for t in tasks):
            await asyncio.sleep(0.001)
        phase.fault_at = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, inject)
        await asyncio.gather(*tasks)


def injector(up: UpProcess, fault: str, phase: Phase):
    def kill(name: str) -> None:
        os.kill(up.pid(name), signal.SIGKILL)

    def inject() -> None:
        match fault:
            case "kill-router":
                kill("router-0")
            case "stop-router":  # hung past its ownership TTL: its partitions are taken over meanwhile
                phase.note = stop_router(up)
            case "kill-agent":
                kill("agent-0")
            case "kill-telemetry":
                kill("telemetry")
            case "kill-gateway":
                kill("gateway")
            case "postgres-immediate":
                os.kill(up.pid("EmbeddedPostgres"), signal.SIGQUIT)  # = pg_ctl stop -m immediate
            case "kill-nats":  # SIGKILL, not a pause: the supervisor restarts it on its store
                os.kill(up.pid("EmbeddedNats"), signal.SIGKILL)
            case "slowloris":
                phase.note = slowloris(up.port)
            case "big-body":
                phase.note = big_bodies(up.port)
            case "overload":
                phase.note = overload(up.port)
            case "disk-full":
                phase.note = fill_disk(up.data_dir)
            case "disk-full-hard":  # every byte: the broker and Postgres hit ENOSPC too
                phase.note = fill_disk(up.data_dir, leave=0)
            case "nats-pause":
                pid = up.pid("EmbeddedNats")
                os.kill(pid, signal.SIGSTOP)
                time.sleep(5.0)
                os.kill(pid, signal.SIGCONT)
            case "restart-after-ctrl-c":
                t = time.monotonic()
                up.interrupt()
                stopped = time.monotonic() - t
                ready = up.start()
                phase.ready_at = time.monotonic()
                phase.note = f"stopped in {stopped:.1f}s, ready again {ready:.1f}s later"
    return inject


def stop_router(up: UpProcess) -> str:
    pid = up.pid("router-1")
    for _ in range(PAUSES):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(HOLD_S)  # the fault is the pause itself
        os.kill(pid, signal.SIGCONT)
        time.sleep(2.0)  # resumed under load: its stale decisions go out (or not) now
    return f"router-1 stopped {PAUSES}x {HOLD_S:g}s under load"


def executions(data_dir: Path, prefix: str) -> dict[str, int]:
    """call_id -> how many times an agent ran it, for this phase's sessions."""
    return running.executions(sorted((data_dir / "logs").glob("agent-*.log*")), scoped_session(TENANT, prefix))


def slowloris(port: int, per_address: int = 300, addresses: int = 8) -> str:
    """Half-open connections (a header never finished) from `addresses` loopback addresses,
    held HOLD_S: each address over its connection limit is refused, the rest time out."""
    import socket

    socks, refused = [], 0
    for a in range(addresses):
        for _ in range(per_address):
            s = socket.socket()
            try:
                s.bind((f"127.0.0.{10 + a}", 0))
                s.connect(("127.0.0.1", port))
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                socks.append(s)
            except OSError:
                refused += 1
                s.close()
    time.sleep(HOLD_S)
    answered = {"408": 0, "503": 0}
    for s in socks:
        s.settimeout(0.01)
        try:
            head = s.recv(64)
            for code in answered:
                answered[code] += head.startswith(f"HTTP/1.1 {code}".encode())
        except OSError:
            pass
        s.close()
    return (f"{len(socks)} half-open connections from {addresses} addresses for {HOLD_S:g}s: "
            f"{answered['503']} refused 503 (over their address's limit), {answered['408']} cut at the header "
            f"deadline (408), {refused} not connected")


def big_bodies(port: int, n: int = 3, size: int = 7_900_000) -> str:
    """Another tenant's 7.9 MB bodies, all at once (issue 25: they delayed everyone by ~18 s)."""
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    body = json.dumps({"model": "qwen3-tiny", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "go on " * (size // 6)}]}).encode()

    def send(_):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {FLOOD_KEY}",
                                              "Content-Type": "application/json"})
        t = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, time.monotonic() - t
        except urllib.error.HTTPError as exc:
            return exc.code, time.monotonic() - t

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(send, range(n)))
    return f"{n} bodies of {size / 1e6:.1f} MB from another tenant: " + ", ".join(
        f"{code} in {t:.1f}s" for code, t in answers)


def overload(port: int, rate: float = 300.0) -> str:
    """Another tenant's open-loop burst at `rate` calls/s for HOLD_S (issue 25: at 300/s, p99 7.7 s)."""
    import threading
    import urllib.error
    import urllib.request

    codes: dict[int, int] = {}
    lock = threading.Lock()

    def send(i):
        body = json.dumps({"model": "qwen3-tiny", "max_tokens": 4,
                           "messages": [{"role": "user", "content": f"flood {i}"}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {FLOOD_KEY}",
                                              "Content-Type": "application/json", "X-Session-Id": f"flood-{i}"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                code = r.status
        except urllib.error.HTTPError as exc:
            code = exc.code
        except OSError:
            code = 0
        with lock:
            codes[code] = codes.get(code, 0) + 1

    threads, start = [], time.monotonic()
    for i in range(int(rate * HOLD_S)):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the arrival schedule (open loop)
        t = threading.Thread(target=send, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return f"another tenant at {rate:g} calls/s for {HOLD_S:g}s: " + ", ".join(
        f"{n} x {code}" for code, n in sorted(codes.items()))


def fill_disk(data_dir: Path, leave: int | None = None) -> str:
    """Fill the data directory's filesystem to under the gateway's reserve for HOLD_S, then free
    it (the phase's data directory must be on a small filesystem: --data-dir on a tmpfs)."""
    import shutil

    from talaria.services.gateway.admission import default_min_free_bytes

    reserve = default_min_free_bytes(data_dir)
    filler = data_dir / "filler"
    size = max(0, shutil.disk_usage(data_dir).free - (reserve // 2 if leave is None else leave))
    chunk = b"\0" * (1 << 20)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(-(-size >> 20)):
            os.write(fd, chunk)
    except OSError:  # ENOSPC: full, as asked
        pass
    finally:
        os.close(fd)
    free = shutil.disk_usage(data_dir).free
    time.sleep(HOLD_S)
    filler.unlink()
    return f"filled to {free >> 20} MiB free (reserve {reserve >> 20} MiB) for {HOLD_S:g}s, then freed"


async def rows(db_url: str, prefix: str) -> tuple[dict, dict]:
    """Per session (as the client named it): call rows by outcome, and its `sessions` row."""
    like = scoped_session(TENANT, prefix) + "%"  # services see sessions scoped to the key's tenant
    conn = await asyncpg.connect(asyncpg_dsn(db_url))
    try:
        calls = await conn.fetch("SELECT session_id, outcome, count(*) AS n FROM calls WHERE session_id LIKE $1 "
                                 "GROUP BY 1, 2", like)
        sess = await conn.fetch("SELECT session_id, calls, completed, failed FROM sessions WHERE session_id LIKE $1",
                                like)
    finally:
        await conn.close()
    by_session: dict[str, dict[str, int]] = {}
    for r in calls:
        by_session.setdefault(client_session(TENANT, r["session_id"]), {})[r["outcome"]] = r["n"]
    return by_session, {client_session(TENANT, r["session_id"]): dict(r) for r in sess}


async def settle(db_url: str, prefix: str, answered: int) -> tuple[dict, dict]:
    """Wait until every row is final and every answered call has its completed row (telemetry
    projects asynchronously, and a restarted projector catches up), at most SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        by_session, sess = await rows(db_url, prefix)
        open_rows = sum(n for o in by_session.values() for k, n in o.items() if k not in ("completed", "failed"))
        completed = sum(o.get("completed", 0) for o in by_session.values())
        if (open_rows == 0 and completed >= answered) or time.monotonic() > deadline:
            return by_session, sess
        await asyncio.sleep(0.5)  # re-query: the projection publishes no "row written" event


def score(phase: Phase, by_session: dict, sess: dict, runs: dict[str, int] | None = None) -> dict:
    answered: dict[str, int] = {}
    for a in phase.attempts:
        if a.status == 200:
            answered[a.session] = answered.get(a.session, 0) + 1
    errors = [a for a in phase.attempts if a.status != 200 and a.error != "no answer"]
    no_answer = sum(1 for a in phase.attempts if a.error == "no answer")
    open_rows = sum(n for o in by_session.values() for k, n in o.items() if k not in ("completed", "failed"))
    twice = missing = counters = 0
    details = []
    for sid in sorted(set(answered) | set(by_session)):
        done = by_session.get(sid, {}).get("completed", 0)
        twice += max(0, done - answered.get(sid, 0))
        missing += max(0, answered.get(sid, 0) - done)
        row = sess.get(sid)
        total = sum(by_session.get(sid, {}).values())
        failed = by_session.get(sid, {}).get("failed", 0)
        if row is None or (row["calls"], row["completed"], row["failed"]) != (total, done, failed):
            counters += 1
        if done != answered.get(sid, 0) or row is None or (row["calls"], row["completed"], row["failed"]) != (
                total, done, failed):
            details.append({"session": sid, "answered": answered.get(sid, 0), "rows": by_session.get(sid, {}),
                            "sessions_row": None if row is None else [row["calls"], row["completed"], row["failed"]]})
    # Recovery: when the last failed or abnormally slow call (over 3x the pre-fault median + 0.5 s)
    # that ended after the fault ended. A call waiting in the stream for a restarting router
    # counts as disturbed as much as one that got a 503.
    before = sorted(a.end - a.start for a in phase.attempts if a.status == 200 and a.end < phase.fault_at)
    slow = 3 * (before[len(before) // 2] if before else 1.0) + 0.5
    since = phase.ready_at or phase.fault_at  # a full restart: measured from "ready" on
    disturbed = [a.end for a in phase.attempts
                 if a.end >= since and (a.status != 200 or a.end - a.start > slow)]
    recovery = max(disturbed) - since if disturbed else 0.0
    inflight = [a.end - a.start for a in phase.attempts if a.start < phase.fault_at < a.end]
    ran_twice = sum(n - 1 for n in (runs or {}).values())
    return {"fault": phase.fault, "ok": phase.ok, "gave_up": phase.gave_up, "errors": len(errors),
            "error_kinds": sorted({a.error for a in errors}), "lost": no_answer + open_rows,
            "twice": max(twice, ran_twice), "ran_twice": ran_twice, "executions": sum((runs or {}).values()),
            "longest_call_s": max((a.end - a.start for a in phase.attempts if a.end), default=0.0),
            "replayed": sum(1 for a in phase.attempts if a.status == 200 and a.replayed), "keys": phase.keys,
            "rows_wrong": missing + counters, "recovery_s": recovery,
            "inflight_wait_s": max(inflight, default=0.0), "rows_final_s": phase.rows_final_s,
            "note": phase.note, "details": details}


def run(faults: list[str], sessions: int, calls: int, data_dir: Path | None = None, seed: int = 0,
        keys: bool = True) -> list[dict]:
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="talaria-faults-"))
    # stop-router needs router replicas (a hung one's partitions are taken over by the other)
    up = UpProcess(data_dir, free_port(), extra=("--routers", "2") if "stop-router" in faults else ())
    results = []
    try:
        boot = up.start()
        print(f"faults: stack ready in {boot:.1f}s ({data_dir})", file=sys.stderr)
        db_url = up.info()["database"]
        for n, fault in enumerate(faults):
            phase = Phase(fault, keys=keys)
            asyncio.run(load(up, phase, sessions, calls, injector(up, fault, phase), seed + n))
            load_end = time.monotonic()
            by_session, sess = asyncio.run(settle(up.info()["database"] or db_url, f"{fault}-{seed + n}-",
                                                  sum(1 for a in phase.attempts if a.status == 200)))
            phase.rows_final_s = time.monotonic() - load_end
            result = score(phase, by_session, sess, executions(data_dir, f"{fault}-{seed + n}-"))
            results.append(result)
            print("faults: " + json.dumps(result), file=sys.stderr)
            time.sleep(2.0)  # let restarted services finish warming before the next phase's load
    finally:
        if up.proc is not None and up.proc.poll() is None:
            up.interrupt()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--faults", default="all", help=f"comma-separated among {', '.join(FAULTS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", type=Path, help="the stack's data directory (disk-full: on a small tmpfs)")
    ap.add_argument("--out", default="results/faults.md")
    ap.add_argument("--report-only", action="store_true", help="rewrite the Markdown from the saved JSON")
    ap.add_argument("--no-idempotency-keys", action="store_true",
                    help="clients send no Idempotency-Key (the baseline: a retry is a new call)")
    args = ap.parse_args()
    out = ROOT / args.out
    command = f"python bench/faults.py --sessions {args.sessions} --calls {args.calls} --faults {args.faults}" + (
        f" --seed {args.seed}" if args.seed else "") + (" --no-idempotency-keys" if args.no_idempotency_keys else "")
    if args.report_only:
        write_markdown(json.loads(out.with_suffix(".json").read_text()), args.sessions, args.calls, out, command)
        print(out.read_text())
        return 0
    faults = list(FAULTS) if args.faults == "all" else [f.strip() for f in args.faults.split(",")]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        print(f"faults: unknown fault {unknown[0]}; known: {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    data_dir = Path(tempfile.mkdtemp(prefix="talaria-faults-", dir=args.data_dir)) if args.data_dir else None
    results = run(faults, args.sessions, args.calls, data_dir, seed=args.seed, keys=not args.no_idempotency_keys)
    write_markdown(results, args.sessions, args.calls, ROOT / args.out, command)
    (ROOT / args.out).with_suffix(".json").write_text(json.dumps(results, indent=2))
    print((ROOT / args.out).read_text())
    return 0 if all(goals_met(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
