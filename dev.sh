#!/usr/bin/env bash
# Talaria's two commands. `./dev.sh up` sets up a virtualenv (first run only) and starts the
# whole stack on embedded NATS + PostgreSQL; `./dev.sh test` runs the test suite.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${TALARIA_VENV:-.venv}
# The CPU wheel first, so the torch range in pyproject.toml never pulls a multi-GB CUDA build.
# Elsewhere: TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

# Mooncake's transfer engine (KV migration, docs/migration.md) loads libibverbs/librdmacm/libnuma:
# installed with apt-get where we are root and have it, else skipped (pages then move over TCP).
system_libs() {
  local have
  have=$(ldconfig -p 2>/dev/null || true)
  case "$have" in *libibverbs.so.1*) case "$have" in *librdmacm.so.1*) case "$have" in *libnuma.so.1*) return ;; esac ;; esac ;; esac
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 0
  local pkgs="libibverbs1 librdmacm1 libnuma1"
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq $pkgs >/dev/null 2>&1 \
    || { timeout 300 apt-get update -qq >/dev/null 2>&1 \
         && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq $pkgs >/dev/null 2>&1; } || true
}

setup() {
  if [ -x "$VENV/bin/talaria" ] && [ "$VENV/.installed" -nt pyproject.toml ]; then
    return
  fi
  echo "dev.sh: creating $VENV and installing Talaria (first run takes a minute or two)" >&2
  system_libs
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q $TORCH_SPEC
  # the distribution was called `talaria` before (a name PyPI gives an unrelated project): drop it
  "$VENV/bin/python" -m pip uninstall -y -q talaria >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q -e ".[test,mooncake]"
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
