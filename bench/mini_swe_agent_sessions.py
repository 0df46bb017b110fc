"""mini-swe-agent (through litellm, no session header) against a live gateway (not a test).

Run with a Python that has mini-swe-agent (a throwaway venv: `pip install mini-swe-agent`),
against `talaria up` serving a checkpoint that answers every chat with one `bash` tool call
(the steps and what it showed are in docs/api.md, "mini-swe-agent through litellm"):

    python bench/mini_swe_agent_sessions.py http://127.0.0.1:PORT/v1 API_KEY MODEL [--agents 2] [--steps 5]

Each agent runs its own task in a scratch directory, concurrently; the calls table then shows
one inferred session per agent.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")  # a model litellm has no price for

import minisweagent  # noqa: E402
import yaml  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402


def run(base: str, key: str, model: str, task: str, steps: int, cwd: str) -> None:
    cfg = yaml.safe_load((Path(minisweagent.__file__).parent / "config" / "mini.yaml").read_text())["agent"]
    agent = DefaultAgent(
        LitellmModel(model_name=f"openai/{model}",
                     model_kwargs={"api_base": base, "api_key": key, "max_tokens": 16, "temperature": 0}),
        LocalEnvironment(cwd=cwd), **{**cfg, "step_limit": steps, "max_consecutive_format_errors": 0, "cost_limit": 0})
    try:
        result = agent.run(task)
    except Exception as exc:  # the agent's own limits end it by raising
        result = f"{type(exc).__name__}: {str(exc)[:200]}"
    print(f"{task!r}: {agent.n_calls} calls, {result}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("key")
    p.add_argument("model")
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    tasks = [f"Task {i}: list the files here and count them." for i in range(args.agents)]
    with tempfile.TemporaryDirectory() as cwd:
        threads = [threading.Thread(target=run, args=(args.base, args.key, args.model, t, args.steps, cwd))
                   for t in tasks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
