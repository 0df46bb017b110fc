"""`talaria replay`: drive a normalised session trace against a live stack over NATS.

Closed loop, as in the paper's replay: a session's next call is released when the
previous one completes plus its gap (from the chosen gap model). Token counts are
scaled to fit the tiny models (the scale is recorded in the report); each prompt is
the previous prompt + the previous answer + new filler text, so session prefixes are
really reusable. Metrics come from the `calls` rows telemetry projected into Postgres.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import nats

from talaria.shared.subjects import Deployment
from talaria.shared.bus import servers
from talaria.shared.catalog import BUILTIN_MODELS, Catalogue
from talaria.shared.messages import CallRequest, CallResult, ErrorReply, REPLY_DECODER
from talaria.shared.wire import encode
from talaria.shared.nats_auth import client_options
from talaria.shared.settings import asyncpg_dsn
from talaria.shared.stats import quantile
from talaria.traces import GapModel, Session

FILLER = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789\n"


@dataclass
class ReplayConfig:
    token_scale: float = 1 / 64
    max_prompt_tokens: int = 3000
    max_output_tokens: int = 64
    call_timeout_s: float = 300.0
    models: tuple[str, ...] = ("qwen3-tiny", "qwen3-moe-tiny", "gpt2-tiny")


@dataclass
class ReplayStats:
    calls_sent: int = 0
    calls_ok: int = 0
    calls_failed: int = 0
    sessions_done: int = 0
    sessions_truncated: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def filler(n: int, seed: str) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(FILLER) for _ in range(max(0, n)))


def model_map(sessions: list[Session], models: tuple[str, ...]) -> dict[str, str]:
    """Trace models onto served ones, in order of first appearance (recorded in the report)."""
    mapping: dict[str, str] = {}
    for s in sessions:
        if s.model not in mapping:
            mapping[s.model] = models[len(mapping) % len(models)]
    return mapping


class Replayer:
    def __init__(self, nats_url: str, cfg: ReplayConfig, gaps: GapModel, run_id: str,
                 api_key: str | None = None, deployment: Deployment = Deployment(),
                 catalogue: Catalogue = BUILTIN_MODELS) -> None:
        self.nats_url, self.cfg, self.gaps, self.run_id = nats_url, cfg, gaps, run_id
        self.deployment = deployment  # the deployment the stack serves (TALARIA_DEPLOYMENT)
        self.catalogue = catalogue  # its models, for their context lengths (CommonSettings.catalogue)
        self.api_key = api_key
        self.stats = ReplayStats()
        self.total_calls = 0

    async def run(self, sessions: list[Session], progress=True) -> ReplayStats:
        self.total_calls = sum(len(s.calls) for s in sessions)
        mapping = model_map(sessions, self.cfg.models)
        self.nc = await nats.connect(servers(self.nats_url), **client_options(self.nats_url))
        ticker = asyncio.create_task(self._progress(len(sessions))) if progress else None
        try:
            await asyncio.gather(*(self._session(s, mapping[s.model]) for s in sessions))
        finally:
            if ticker is not None:
                ticker.cancel()
                self._print_progress(len(sessions), final=True)
            await self.nc.close()
        return self.stats

    def session_id(self, s: Session) -> str:
        return f"{self.run_id}-{s.id}"

    async def _session(self, s: Session, model: str) -> None:
        limit = min(self.cfg.max_prompt_tokens, self.catalogue[model].context_length - self.cfg.max_output_tokens - 2)
        context = ""
        for call in s.calls:
            await asyncio.sleep(self.gaps.gap(call))  # the workload's own think/tool time
            want = max(1, math.ceil(call.prompt_tokens * self.cfg.token_scale))
            new = max(1, want - len(context) - 1)  # byte tokenizer: 1 ASCII char = 1 token (+BOS)
            prompt = context + filler(new, f"{s.id}:{call.call_index}")
            if len(prompt) + 1 > limit:
                self.stats.sessions_truncated += 1
                break
            max_tokens = max(1, min(self.cfg.max_output_tokens, math.ceil(call.output_tokens * self.cfg.token_scale)))
            reply = await self._call(self.session_id(s), model, prompt, max_tokens)
            if isinstance(reply, CallResult):
                self.stats.calls_ok += 1
                context = prompt + reply.text
            else:
                self.stats.calls_failed += 1
                self.stats.errors[reply.code] = self.stats.errors.get(reply.code, 0) + 1
                break  # the agent would not go on without an answer
        self.stats.sessions_done += 1

    async def _call(self, session_id: str, model: str, prompt: str, max_tokens: int):
        req = CallRequest(model=model, prompt=prompt, session_id=session_id, max_tokens=max_tokens,
                          temperature=0.0, call_id=uuid.uuid4().hex, api_key=self.api_key)
        self.stats.calls_sent += 1
        try:
            msg = await self.nc.request(self.deployment.api_call, encode(req), timeout=self.cfg.call_timeout_s)
        except Exception as exc:
            return ErrorReply(504, "replay_timeout", str(exc))
        return REPLY_DECODER.decode(msg.data)

    async def _progress(self, sessions: int) -> None:
        while True:
            self._print_progress(sessions)
            await asyncio.sleep(1.0)

    def _print_progress(self, sessions: int, final: bool = False) -> None:
        st = self.stats
        done = st.calls_ok + st.calls_failed
        width = 30
        filled = int(width * done / max(1, self.total_calls))
        end = "\n" if final else ""
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total_calls} calls, "
              f"{st.sessions_done}/{sessions} sessions, {st.calls_failed} failed", end=end, file=sys.stderr,
              flush=True)


async def metrics_from_db(database_url: str, run_id: str, expect_calls: int, timeout_s: float = 60.0) -> dict:
    """SCT and TTFT by the paper's definitions, from the projected `calls` rows of this run."""
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            rows = await conn.fetch(
                "SELECT session_id, call_index, instance_id, outcome, kv_source, ttft_s,"
                " extract(epoch FROM submitted_at) AS sub, extract(epoch FROM completed_at) AS done"
                " FROM calls WHERE session_id ~ ('(^|:)' || $1 || '-')"  # `tenant:` scopes session ids
                " ORDER BY session_id, call_index", run_id)
            final = [r for r in rows if r["outcome"] in ("completed", "failed")]
            if len(final) >= expect_calls or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)  # telemetry projects asynchronously
    finally:
        await conn.close()
    return summarise_rows(rows)


def summarise_rows(rows) -> dict:
    by_session: dict[str, list] = {}
    for r in rows:
        by_session.setdefault(r["session_id"], []).append(r)
    scts, returns, same = [], 0, 0
    for calls in by_session.values():
        done = [float(c["done"]) for c in calls if c["done"] is not None]
        if done:
            scts.append(max(done) - min(float(c["sub"]) for c in calls))
        for prev, cur in zip(calls, calls[1:]):
            returns += 1
            same += prev["instance_id"] == cur["instance_id"]
    ttfts = [float(r["ttft_s"]) for r in rows if r["ttft_s"] is not None]
    kv: dict[str, int] = {}
    for r in rows:
        kv[r["kv_source"] or "none"] = kv.get(r["kv_source"] or "none", 0) + 1
    return {
        "sessions": len(by_session), "calls": len(rows),
        "completed": sum(r["outcome"] == "completed" for r in rows),
        "sct_p50": quantile(scts, 0.50), "sct_p95": quantile(scts, 0.95),
        "ttft_p50": quantile(ttfts, 0.50), "ttft_p95": quantile(ttfts, 0.95),
        "same_instance_returns": same / returns if returns else math.nan,
        "kv_source": kv,
    }


def write_report(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
