"""Time from `talaria up` to the first served token, on embedded servers (not a test).

    python bench/startup.py [--agents 2] [--reps 3]

Starts the stack in a fresh data directory (so weights are written and Postgres is
initialised as on a first run), waits for nothing but the gateway's HTTP port, then sends
one streaming chat call in a retry loop and stops the clock at its first content token.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.embedded import free_port  # noqa: E402

KEY = "bench-startup-key-0123456789"  # configured, so `talaria up` does not generate one
BODY = json.dumps({"model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                   "temperature": 0, "stream": True}).encode()


def first_token(port: int, deadline: float) -> float:
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=BODY,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                for line in r:
                    if line.startswith(b"data: {") and b'"content": "' in line and b'"content": ""' not in line:
                        return time.monotonic()
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.1)  # not up yet: poll again
    raise TimeoutError("no token within the deadline")


def one(agents: int) -> tuple[float, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "talaria.cli", "up", "--port", str(port), "--data-dir", tmp,
                                 "--agents", str(agents)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "TALARIA_API_KEYS": f"bench:{KEY}"})
        ready = None
        try:
            tok = first_token(port, t0 + 180)
            for line in proc.stdout:
                if "ready in" in line:
                    ready = float(line.split("ready in ")[1].split("s")[0])
                    break
            return ready or float("nan"), tok - t0
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    runs = [one(args.agents) for _ in range(args.reps)]
    for ready, tok in runs:
        print(f"ready {ready:.1f} s, first token {tok:.1f} s")
    print(f"median: ready {statistics.median(r for r, _ in runs):.1f} s, "
          f"first served token {statistics.median(t for _, t in runs):.1f} s after `talaria up`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
