"""Event-stream bytes per call: what one agent call costs the JetStream log, by subject.

    python bench/stream_bytes.py [--sessions 4] [--calls 5] [--out results/stream_bytes.md]

Starts the stack as `talaria up` does (embedded NATS and Postgres), runs sessions whose
prompts grow call by call like an agent's (each call repeats the last one plus a tool
result), then reads every message of the event stream and sums its bytes (payload plus
headers) per subject. The figure to watch is bytes per call and how much of it is the
prompt: a prompt stored once costs ~4-6 bytes per token as JSON ids.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
from pathlib import Path

import msgspec
import nats
from talaria.shared.subjects import Deployment

DEP = Deployment()  # the default deployment's subject names

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from talaria.shared import subjects  # noqa: E402
from talaria.shared.nats_auth import SERVICE_INBOX, client_options  # noqa: E402
from talaria.shared.messages import CallRequest, ChatMessage, REPLY_DECODER  # noqa: E402
from talaria.shared.settings import Settings  # noqa: E402
from talaria.stack import Stack  # noqa: E402


async def drive(nats_url: str, api_key: str | None, sessions: int, calls: int) -> int:
    nc = await nats.connect(nats_url, **client_options(nats_url))
    sent = 0

    async def session(s: int) -> None:
        nonlocal sent
        history = [ChatMessage("user", f"session {s}: list the files " + "x" * 200)]
        for _ in range(calls):
            req = CallRequest(model="qwen3-tiny", session_id=f"bytes-{s}", messages=history, max_tokens=8,
                              temperature=0, api_key=api_key)
            msg = await nc.request(DEP.api_call, msgspec.json.encode(req), timeout=120)
            reply = REPLY_DECODER.decode(msg.data)
            text = getattr(reply, "text", "") or ""
            history = [*history, ChatMessage("assistant", text), ChatMessage("user", "tool output " + "y" * 300)]
            sent += 1

    await asyncio.gather(*(session(s) for s in range(sessions)))
    await nc.close()
    return sent


async def stream_bytes(nats_url: str) -> dict[str, list[int]]:
    """subject family -> [messages, bytes]; read with the telemetry service's credentials."""
    nc = await nats.connect(nats_url, inbox_prefix=SERVICE_INBOX)
    js = nc.jetstream()
    info = await js.stream_info(DEP.events_stream)
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    sub = await js.pull_subscribe(DEP.events_wildcard, stream=DEP.events_stream)  # ephemeral
    seen = 0
    while seen < info.state.messages:
        for msg in await sub.fetch(256, timeout=5):
            family = ".".join(msg.subject.split(".")[2:4])  # <prefix>.evt.call.routed.agent-0 -> call.routed
            size = len(msg.data or b"") + sum(len(k) + len(v) for k, v in (msg.headers or {}).items())
            out[family][0] += 1
            out[family][1] += size
            seen += 1
    await nc.close()
    return dict(out)


def _as_user(stack: Stack, role: str) -> str:
    """The stack's NATS URL with one service's generated credentials (the stream is not public)."""
    user = stack.nats_users.get(role)
    if user is None:
        return stack.nats_url
    scheme, _, rest = stack.nats_url.partition("://")
    return f"{scheme}://{user.name}:{user.password}@{rest}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "results" / "stream_bytes.md"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="talaria-bytes-") as tmp:
        stack = Stack(Settings.from_env().with_(data_dir=Path(tmp), http_port=0), agents=1)
        stack.start(progress=lambda m: print(f"stack: {m}", file=sys.stderr))
        try:
            calls = asyncio.run(drive(stack.client_nats_url, stack.api_key, args.sessions, args.calls))
            fams = asyncio.run(stream_bytes(_as_user(stack, "telemetry")))
        finally:
            stack.stop()
    total = sum(b for _, b in fams.values())
    lines = [f"# Event-stream bytes per call\n",
             f"`python bench/stream_bytes.py --sessions {args.sessions} --calls {args.calls}`: {calls} calls, "
             f"prompts growing ~500 bytes a call.\n",
             "| subject | messages | bytes | bytes per call |", "|---|---:|---:|---:|"]
    for fam, (n, b) in sorted(fams.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {fam} | {n} | {b:,} | {b / calls:,.0f} |")
    lines.append(f"| **all** | {sum(n for n, _ in fams.values())} | {total:,} | **{total / calls:,.0f}** |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
