"""Shared helpers for the live-stack benchmarks: start a stack, call it, summarise.

A bench imports `live_stack` (a context manager around `talaria.stack.Stack` on embedded
NATS + Postgres in a temporary directory) and the small client helpers below. Every
figure a bench reports comes from a stack it started itself, so before/after runs of
the same script compare like with like.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402

from talaria.shared.messages import CallRequest, ChatMessage, REPLY_DECODER  # noqa: E402
from talaria.shared.settings import Settings  # noqa: E402
from talaria.embedded import free_port  # noqa: E402


@contextlib.contextmanager
def live_stack(agents: int = 2, **changes):
    """A whole stack (router, telemetry, gateway, `agents` cold agents) on free ports."""
    from talaria.stack import Stack

    with tempfile.TemporaryDirectory(prefix="talaria-bench-") as tmp:
        settings = Settings.from_env({}).with_(data_dir=Path(tmp), http_port=free_port(), **changes)
        stack = Stack(settings, agents=agents, log_to_files=True)
        stack.start(progress=lambda m: print(f"  stack: {m}", file=sys.stderr, flush=True))
        global API_KEY
        API_KEY = getattr(stack, "api_key", None)
        try:
            yield stack
        except BaseException:
            import shutil

            shutil.copytree(Path(tmp) / "logs", Path(tempfile.gettempdir()) / "talaria-bench-failed-logs",
                            dirs_exist_ok=True)
            for log in sorted((Path(tmp) / "logs").glob("*.log")):
                tail = log.read_text(errors="replace").splitlines()[-8:]
                print(f"--- {log.name}\n" + "\n".join(tail), file=sys.stderr)
            raise
        finally:
            stack.stop()


def pct(xs, q: float) -> float:
    """The q-quantile (0..1) of xs, nearest rank; nan when empty."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def p50(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def ms(x: float) -> str:
    return "n/a" if x != x else f"{1000 * x:.1f}"


def text_of_bytes(n: int, seed: int = 0) -> str:
    """n bytes of prompt text (the tokenizer is byte-level: about one token a byte)."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu ".split()
    out, i = [], seed
    while sum(len(w) + 1 for w in out) < n:
        out.append(words[i % len(words)])
        i += 7
    return " ".join(out)[:n]


API_KEY: str | None = None  # the running stack's API key, when it has one (set by live_stack)


def http_headers(extra: dict | None = None) -> dict:
    """Headers for the gateway: the stack's API key, when it has one."""
    return {**({"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}), **(extra or {})}


async def nats_call(nc, model: str, session: str, content, max_tokens: int = 1,
                    timeout: float = 120.0, call_id: str | None = None):
    """One call over the NATS API; returns (reply, client latency in seconds, send time).
    `content`: the user text, or a list of (role, text) messages."""
    msgs = [ChatMessage("user", content)] if isinstance(content, str) else [ChatMessage(r, t) for r, t in content]
    extra = {"api_key": API_KEY} if API_KEY and "api_key" in CallRequest.__struct_fields__ else {}
    req = CallRequest(model=model, session_id=session, max_tokens=max_tokens, temperature=0,
                      messages=msgs, call_id=call_id or uuid.uuid4().hex, **extra)
    t0 = time.time()
    msg = await nc.request("talaria.api.call", msgspec.json.encode(req), timeout=timeout)
    return REPLY_DECODER.decode(msg.data), time.time() - t0, t0


async def connect(stack):
    import nats

    from talaria.shared.nats_auth import client_options

    url = getattr(stack, "client_nats_url", None) or stack.nats_url
    return await nats.connect(url, **client_options(url))


def run(coro):
    return asyncio.run(coro)


async def call_rows(stack, call_ids, timeout: float = 30.0) -> dict[str, dict]:
    """The `calls` rows of `call_ids` once telemetry has projected all of them as finished."""
    import asyncpg

    from talaria.shared.settings import asyncpg_dsn

    conn = await asyncpg.connect(asyncpg_dsn(stack.database_url))
    try:
        deadline = time.monotonic() + timeout
        while True:
            rows = await conn.fetch(
                "SELECT c.*, extract(epoch from submitted_at) AS sub, extract(epoch from routed_at) AS rou,"
                " extract(epoch from started_at) AS sta, extract(epoch from first_token_at) AS fir,"
                " extract(epoch from completed_at) AS com FROM calls c WHERE call_id = ANY($1::text[])"
                " AND outcome NOT IN ('submitted', 'routed', 'running')", list(call_ids))
            if len(rows) >= len(call_ids) or time.monotonic() > deadline:
                return {r["call_id"]: dict(r) for r in rows}
            await asyncio.sleep(0.2)  # telemetry projects asynchronously; poll the table
    finally:
        await conn.close()
