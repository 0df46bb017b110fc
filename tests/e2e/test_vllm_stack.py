"""End to end on vLLM: `talaria up` with TALARIA_ENGINE=vllm (one agent serving two models, each
its own resident vLLM engine), driven through the OpenAI and Anthropic SDKs: a session's calls,
streamed and not, rounds that switch between the two models, a stream cancelled mid-way (its
row says `cancelled`, the agent serves on), and every answer equal to the model's greedy
tokens computed by the torch engine in this process.

Skipped without vLLM; `.ci/vllm_stage.sh` runs it in its vLLM venv.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import subprocess
import os
import sys
import queue
import threading

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (run by .ci/vllm_stage.sh in its own venv)", allow_module_level=True)

import anthropic  # noqa: E402
import asyncpg  # noqa: E402
import openai  # noqa: E402

from talaria.embedded import free_port  # noqa: E402
from talaria.shared.settings import asyncpg_dsn  # noqa: E402
from tests.e2e.test_stack import Stack  # noqa: E402
from tests.integration.harness import wait_rows  # noqa: E402

pytestmark = pytest.mark.e2e

A, B = "qwen3-tiny", "gpt2-tiny"
TENANT = "default"


class VllmStack(Stack):
    def __init__(self, data_dir, port) -> None:  # noqa: D107 - as Stack, on the vllm engine
        env = dict(os.environ, TALARIA_SESSION_IDLE_S="3600", PYTHONUNBUFFERED="1", TALARIA_ENGINE="vllm",
                   TALARIA_VLLM_MAX_MODEL_LEN="8192")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "talaria.cli", "up", "--port", str(port), "--data-dir", str(data_dir),
             "--agents", "1", "--models", f"{A},{B}", "--ready-timeout", "900"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines, self.output = queue.Queue(), []
        threading.Thread(target=self._pump, daemon=True).start()


def greedy(data_dir, model: str, prompt_ids: list[int], n: int) -> list[int]:
    from talaria.services.instance_agent.engine import Sequence, TorchEngine

    engine = TorchEngine(data_dir, [model], hkvr=False, staging=False)
    try:
        return engine.generate(Sequence("ref", "ref", model, prompt_ids, n)).token_ids
    finally:
        engine.close()


async def rows(url: str, where: str, n: int, *args) -> list:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await wait_rows(conn, f"SELECT * FROM calls WHERE {where} ORDER BY submitted_at", n, *args,
                               timeout=60.0)
    finally:
        await conn.close()


def test_a_session_is_served_through_vllm_with_rounds_across_two_models(tmp_path):
    data_dir, port = tmp_path / "data", free_port()
    stack = VllmStack(data_dir, port)
    try:
        stack.wait_for(r"ready in", timeout=900)
        key = stack.wait_for(r"API key .*: (\S+)", timeout=10).group(1)
        db = json.loads((data_dir / "stack.json").read_text())["database"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=300)
        # A system prompt of several vLLM blocks (128 tokens on CPU): reuse is in whole blocks.
        system = "You are a careful coding agent. Read the code before you edit it, run the tests " * 25
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": "Fix the failing test in parser.py"}]
        # Rounds: the session alternates models; each answer is that model's greedy output.
        for i, model in enumerate([A, B, A, B]):
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                               extra_headers={"X-Session-Id": "vllm-e2e"})
            assert 1 <= r.usage.completion_tokens <= 8
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "tool", "content": f"exit {i}"}]
        done = asyncio.run(rows(db, "session_id=$1 AND outcome='completed'", 4, f"{TENANT}:vllm-e2e"))
        assert [r["model"] for r in done] == [A, B, A, B]
        assert done[2]["kv_source"] == "device"  # A's engine kept the session's KV across B's slot
        assert done[2]["cached_tokens"] >= 256

        # Streamed, and equal to the torch engine's greedy tokens for the same prompt.
        stream = client.completions.create(model=A, prompt="def parse(s):", max_tokens=10, temperature=0,
                                           stream=True, extra_headers={"X-Session-Id": "vllm-stream"})
        text = "".join(c.choices[0].text for c in stream)
        [row] = asyncio.run(rows(db, "session_id=$1 AND outcome='completed'", 1, f"{TENANT}:vllm-stream"))
        from talaria.shared.catalog import BUILTIN_MODELS
        from talaria.shared.model_text import text_for

        tx = text_for(BUILTIN_MODELS[A])
        want = greedy(data_dir, A, tx.encode("def parse(s):", chat=False), 10)
        assert row["output_tokens"] == len(want)
        dec = tx.decoder()
        assert text == "".join(dec.push(t) for t in want if t not in tx.eos_ids) + dec.flush()

        # Anthropic, streamed.
        claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=key, max_retries=0, timeout=300)
        with claude.messages.stream(model=B, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                    extra_headers={"X-Claude-Code-Session-Id": "vllm-claude"}) as s:
            final = s.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens") and 1 <= final.usage.output_tokens <= 8

        # Cancellation: a long stream closed after its first chunk ends as `cancelled`. Long for
        # sure: EOS is forbidden, so only the cancel can end it before 6,000 tokens (vLLM decodes
        # qwen3-tiny at ~500 tok/s here; a call that can stop early may finish before the
        # gateway sees the client leave).
        no_eos = {str(t): -100 for t in tx.eos_ids}
        stream = client.chat.completions.create(model=A, messages=messages[:2], max_tokens=6000, temperature=0,
                                                stream=True, logit_bias=no_eos,
                                                extra_headers={"X-Session-Id": "vllm-cancel"})
        next(iter(stream))
        stream.close()
        [cancelled] = asyncio.run(rows(db, "session_id=$1 AND outcome='cancelled'", 1, f"{TENANT}:vllm-cancel"))
        assert cancelled["output_tokens"] is None or cancelled["output_tokens"] < 6000
        r = client.chat.completions.create(model=A, messages=messages[:2], max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")  # the agent serves on

        stack.proc.send_signal(signal.SIGINT)
        assert stack.proc.wait(120) == 0
    except BaseException:
        print("talaria up, last lines:\n" + stack.log_tail())  # shown with the failure
        raise
    finally:
        if stack.proc.poll() is None:
            stack.proc.send_signal(signal.SIGINT)
            try:
                stack.proc.wait(120)
            except subprocess.TimeoutExpired:
                stack.proc.kill()
