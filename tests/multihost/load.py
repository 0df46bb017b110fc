"""Agent sessions against a gateway, and what they saw: calls lost, run twice, longest stall."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

MODELS = ("qwen3-tiny", "qwen3-moe-tiny", "gpt2-tiny")
CLIENT_TIMEOUT_S = 90.0  # longer than any fault: a call without an answer by then is lost
RETRY_BUDGET_S = 60.0


@dataclass
class Call:
    session: str
    index: int
    start: float
    end: float = 0.0
    call_id: str = ""
    status: int = 0  # 0: no HTTP answer
    error: str = ""


@dataclass
class Load:
    url: str
    key: str
    calls: list[Call] = field(default_factory=list)
    stop_at: float = float("inf")  # sessions start no call after this

    async def session(self, http: aiohttp.ClientSession, name: str, rng: random.Random) -> None:
        model, history, i = MODELS[rng.randrange(len(MODELS))], [], 0
        while time.monotonic() < self.stop_at:
            history.append({"role": "user", "content": f"step {i}: run the tool and report " + "x" * rng.randrange(40)})
            answer = await self.call(http, name, i, model, history)
            if answer is None:
                return  # an agent whose call failed for good stops its session
            history.append({"role": "assistant", "content": answer})
            i += 1
            await asyncio.sleep(rng.uniform(0.2, 0.5))  # the tool runs

    async def call(self, http, session: str, index: int, model: str, history: list[dict]) -> str | None:
        """One logical call; 429/502/503 and refused connections are retried with the same
        Idempotency-Key, as an SDK does."""
        c = Call(session, index, time.monotonic())
        self.calls.append(c)
        headers = {"X-Session-Id": session, "Authorization": f"Bearer {self.key}",
                   "Idempotency-Key": uuid.uuid4().hex}
        body = {"model": model, "messages": history, "max_tokens": 4, "temperature": 0}
        give_up = c.start + RETRY_BUDGET_S
        while True:
            retry_after = 0.5
            try:
                async with http.post(f"{self.url}/v1/chat/completions", json=body, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as r:
                    data = await r.json(content_type=None)
                    c.status, c.end = r.status, time.monotonic()
                    if r.status == 200:
                        c.call_id = data["id"].removeprefix("chatcmpl-")
                        return data["choices"][0]["message"]["content"]
                    c.error = (data.get("error") or {}).get("code") or str(r.status)
                    retry_after = float(r.headers.get("Retry-After", "0.5"))
                    if r.status not in (429, 502, 503):
                        return None
            except asyncio.TimeoutError:
                c.end, c.error = time.monotonic(), "no answer"
                return None
            except (aiohttp.ClientConnectionError, ValueError) as exc:
                c.end, c.error = time.monotonic(), type(exc).__name__
            if time.monotonic() + retry_after > give_up:
                return None
            await asyncio.sleep(min(retry_after, 1.0))

    async def run(self, sessions: int, seconds: float, seed: int = 0) -> None:
        self.stop_at = time.monotonic() + seconds
        rng = random.Random(seed)
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(self.session(http, f"mh-{seed}-{k}", random.Random(rng.random()))
                                   for k in range(sessions)))


@dataclass
class Outcome:
    answered: int
    lost: int  # logical calls without a 200
    twice: int  # calls an agent ran to completion more than once
    longest_stall_s: float  # the longest time no call completed while one was waiting
    stall_span: tuple[float, float] = (0.0, 0.0)  # when it began and ended, seconds from the fault's start

    def row(self) -> dict:
        return {"answered": self.answered, "lost": self.lost, "twice": self.twice,
                "longest_stall_s": round(self.longest_stall_s, 2), "stall_span": tuple(round(t, 1) for t in self.stall_span)}


def outcome(calls: list[Call], executions: dict[str, int], fault_at: float = 0.0) -> Outcome:
    ok = [c for c in calls if c.status == 200]
    since, until = stall_span(calls)
    return Outcome(len(ok), len(calls) - len(ok), sum(1 for n in executions.values() if n > 1),
                   until - since, (since - fault_at, until - fault_at) if fault_at else (0.0, 0.0))


def longest_stall(calls: list[Call]) -> float:
    """The longest stretch, with at least one call waiting, in which none was answered."""
    since, until = stall_span(calls)
    return until - since


def stall_span(calls: list[Call]) -> tuple[float, float]:
    """(start, end) of `longest_stall`, on the calls' clock."""
    span, prev = (0.0, 0.0), None
    for end in sorted(c.end for c in calls if c.end):
        waiting = [c.start for c in calls if c.start < end and (not c.end or c.end >= end)]
        if waiting:
            since = min(waiting) if prev is None else max(prev, min(waiting))
            if end - since > span[1] - span[0]:
                span = (since, end)
        prev = end
    return span


async def under_fault(url: str, key: str, fault, executions, seconds: float = 30.0, sessions: int = 6,
                      seed: int = 0) -> tuple[Load, Outcome]:
    """`sessions` agent sessions for `seconds`; `fault()` (blocking: it may sleep through its own
    duration) runs in a thread a quarter of the way in. `executions()`: call_id -> runs."""
    load = Load(url, key)
    task = asyncio.create_task(load.run(sessions, seconds, seed))
    await asyncio.sleep(seconds / 4)  # the fault hits a stack under load
    fault_at = time.monotonic()
    await asyncio.get_running_loop().run_in_executor(None, fault)
    await task
    return load, outcome(load.calls, executions(), fault_at)


def latency_p(calls: list[Call], q: float) -> float:
    done = sorted(c.end - c.start for c in calls if c.status == 200)
    return done[min(len(done) - 1, int(q * len(done)))] if done else float("nan")
