"""End to end: `talaria up` on embedded servers (or the configured ones), an OpenAI client
drives one 3-call agent session; answers, call rows and the session trace are checked."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import anthropic
import asyncpg
import openai
import psutil
import pytest

from talaria.shared.settings import asyncpg_dsn
from talaria.shared.catalog import BUILTIN_MODELS
from talaria.shared.model_text import text_for
from talaria.shared.tokenizer import render_chat
from talaria.shared.tracing import read_spans, session_span_id, session_trace_id
from talaria.embedded import free_port
from tests.integration.harness import wait_rows
from tests.unit.ops.test_operator_cli import _documented_stack_keys

pytestmark = pytest.mark.e2e

SESSION = "e2e-session-1"
TENANT = "default"  # `talaria up` generates a key for tenant `default`
SCOPED = f"{TENANT}:{SESSION}"  # session ids are namespaced by tenant inside the stack


class Stack:
    def __init__(self, data_dir: Path, port: int, *flags: str, agents: int = 2) -> None:
        env = dict(os.environ, TALARIA_SESSION_IDLE_S="3600", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "talaria.cli", "up", "--port", str(port), "--data-dir", str(data_dir),
             "--agents", str(agents), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        while True:
            line = self.lines.get(timeout=timeout)  # queue.Empty fails the test with the output so far
            if line is None:
                raise AssertionError("talaria up exited:\n" + "".join(self.output))
            self.output.append(line)
            if m := re.search(pattern, line):
                return m

    def log_tail(self, n: int = 200) -> str:
        """The stack's last `n` output lines so far (for a failing test's report)."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.output.append(line)
        return "".join(self.output[-n:])


def from_scratch(data_dir: Path, messages: list[dict], max_tokens: int) -> str:
    """The same prompt on a fresh engine in this process: greedy output must match."""
    from talaria.services.instance_agent.engine import Sequence, TorchEngine

    engine = TorchEngine(data_dir, ["qwen3-tiny"])
    ids = text_for(BUILTIN_MODELS["qwen3-tiny"]).encode(render_chat([(m["role"], m["content"]) for m in messages]))
    return engine.generate(Sequence("ref", "ref", "qwen3-tiny", ids, max_tokens)).text


def cli(cwd: Path, *args: str) -> str:
    """A `talaria` operator command as a user runs it: from where `talaria up` runs, no variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALARIA_")}
    out = subprocess.run([sys.executable, "-m", "talaria.cli", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


async def completed_rows(url: str, n: int) -> list:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await wait_rows(conn, "SELECT * FROM calls WHERE session_id=$1 AND outcome='completed' "
                               "ORDER BY call_index", n, SCOPED, timeout=30.0)
    finally:
        await conn.close()


def test_one_agent_session_end_to_end(tmp_path):
    data_dir, port = tmp_path / ".talaria", free_port()  # the default: commands run in tmp_path find it
    stack = Stack(data_dir, port)
    try:
        stack.wait_for(r"ready in", timeout=120)
        printed = stack.wait_for(r"Postgres (\S+)", timeout=10).group(1)
        key = stack.wait_for(r"API key .*: (\S+)", timeout=10).group(1)
        described = json.loads((data_dir / "stack.json").read_text())
        assert set(described) - {"nats_cluster"} == _documented_stack_keys() - {"nats_cluster"}  # docs/operating.md
        password = urlsplit(described["database"]).password
        assert not password or password not in "".join(stack.output)  # passwords are never printed
        assert (data_dir / "stack.json").stat().st_mode & 0o777 == 0o600
        assert described["api_key"] == key == (data_dir / "api_key").read_text().strip()
        db_url = described["database"]
        # Every service's GET /metrics is recorded, and Prometheus is told where.
        assert set(described["metrics"]) == {"gateway", "router-0", "telemetry", "agent-0", "agent-1"}
        scrape_config = (data_dir / "prometheus.yml").read_text()
        assert all(f"'{urlsplit(u).netloc}'" in scrape_config for u in described["metrics"].values())
        anonymous = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.chat.completions.create(model="qwen3-tiny", messages=[{"role": "user", "content": "x"}])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        messages = [{"role": "user", "content": "Fix the failing test in parser.py"}]
        answers = []
        for i in range(3):
            r = client.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=12,
                                               temperature=0, extra_headers={"X-Session-Id": SESSION})
            text = r.choices[0].message.content
            assert text == from_scratch(data_dir, messages, 12)
            n = r.usage.completion_tokens
            assert 1 <= n <= 12 and r.choices[0].finish_reason == ("length" if n == 12 else "stop")
            answers.append(r)
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": f"exit {i}"}]
        # Claude Code needs only ANTHROPIC_BASE_URL and a model name.
        claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=key, max_retries=0)  # x-api-key
        msg = claude.messages.create(model="qwen3-tiny", max_tokens=8, messages=messages[:1],
                                     extra_headers={"X-Claude-Code-Session-Id": "e2e-claude"})
        assert msg.content[0].type == "text" and 1 <= msg.usage.output_tokens <= 8
        assert msg.stop_reason in ("end_turn", "max_tokens")
        prompts = [a.usage.prompt_tokens for a in answers]
        assert prompts == sorted(prompts) and len(set(prompts)) == 3

        for name, url in described["metrics"].items():
            with urllib.request.urlopen(url, timeout=5) as r:  # open like /healthz: no key
                assert r.status == 200 and b"# TYPE talaria_" in r.read(), name
        with urllib.request.urlopen(described["metrics"]["gateway"], timeout=5) as r:
            assert b'talaria_frontend_requests_total{endpoint="chat",model="qwen3-tiny",status="200"} 3.0' in r.read()

        rows = asyncio.run(completed_rows(db_url, 3))
        assert [r["call_index"] for r in rows] == [0, 1, 2]
        assert [r["prompt_tokens"] for r in rows] == prompts
        assert all(r["instance_id"] and r["ttft_s"] is not None for r in rows)
        # Later calls reuse the session's KV wherever the router put them.
        assert rows[2]["kv_source"] in ("device", "host") or rows[2]["instance_id"] != rows[1]["instance_id"]

        # The operator's view: the session as the client named it, the database found through stack.json.
        audited = json.loads(cli(tmp_path, "audit", "session_calls", "--param", f"session_id={SESSION}",
                                 "--format", "json"))
        assert [r["call_index"] for r in audited] == [0, 1, 2]
        cli(tmp_path, "trace", "export", "served.jsonl")  # and counterfactual replay, against this stack
        replayed = json.loads(cli(tmp_path, "replay", "served.jsonl", "--running", "--sessions", "1",
                                  "--token-scale", "1"))
        assert replayed["stats"]["calls_ok"] == 3 and replayed["gaps"].startswith("recorded gaps")

        pids = json.loads((data_dir / "stack.json").read_text())["pids"]
        stack.proc.send_signal(signal.SIGINT)
        assert stack.proc.wait(60) == 0
        assert not [p for p in pids.values() if psutil.pid_exists(p) and
                    psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

        spans = [s for s in read_spans(data_dir / "traces")
                 if s["trace_id"] == f"{session_trace_id(SCOPED):032x}"]
        session_spans = [s for s in spans if s["name"] == "session"]
        call_spans = [s for s in spans if s["name"] == "chat qwen3-tiny"]
        assert len(session_spans) == 1 and session_spans[0]["attributes"]["talaria.session.completed"] == 3
        assert len(call_spans) == 3
        assert {s["parent_id"] for s in call_spans} == {f"{session_span_id(SCOPED):016x}"}
        assert all("talaria.ttft_s" in s["attributes"] and "talaria.prefill_s" in s["attributes"] for s in call_spans)
        executes = [s for s in spans if s["name"] == "execute"]
        assert len(executes) == 3
        timeline = cli(tmp_path, "trace", SESSION)
        assert timeline.startswith(f"session {SESSION} (tenant {TENANT})") and timeline.count("chat qwen3-tiny") == 3
    finally:
        if stack.proc.poll() is None:
            stack.proc.send_signal(signal.SIGINT)
            try:
                stack.proc.wait(60)
            except subprocess.TimeoutExpired:
                stack.proc.kill()
