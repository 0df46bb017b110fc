#!/usr/bin/env bash
# Talaria's two commands. `./dev.sh up` sets up a virtualenv (first run only) and starts the
# whole stack on embedded NATS + PostgreSQL; `./dev.sh test` runs the test suite.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${TALARIA_VENV:-.venv}
# The CPU wheel first, so the torch range in pyproject.toml never pulls a multi-GB CUDA build.
# Elsewhere: TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

setup() {
  if [ -x "$VENV/bin/talaria" ] && [ "$VENV/.installed" -nt pyproject.toml ]; then
    return
  fi
  echo "dev.sh: creating $VENV and installing Talaria (first run takes a minute or two)" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q $TORCH_SPEC
  # the distribution was called `talaria` before (a name PyPI gives an unrelated project): drop it
  "$VENV/bin/python" -m pip uninstall -y -q talaria >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q -e ".[test]"
  echo "dev.sh: installed; put \`talaria\` on your PATH with: source $VENV/bin/activate" >&2
  touch "$VENV/.installed"
}

cmd=${1:-help}
shift || true
case "$cmd" in
  up) setup; exec "$VENV/bin/talaria" up "$@" ;;
  test) setup; exec "$VENV/bin/python" -m pytest "$@" ;;
  setup) setup ;;
  *) echo "usage: ./dev.sh up [talaria up options] | test [pytest options] | setup" >&2; exit 2 ;;
esac
