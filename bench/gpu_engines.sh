#!/usr/bin/env bash
# One call on a lent GPU machine (< 10 min): the torch engine and vLLM side by side on the
# Qwen3-0.6B shape (bench/engine_throughput.py), bf16 checkpoint for vLLM's native path and
# float32 for the torch engine's. Needs a python with torch (CUDA) and, for the vLLM rows,
# `vllm` already installed (the device machine reaches no registry: vLLM's CUDA wheels are
# too large to carry). An engine that cannot start is reported as not run; the other runs.
#   bash bench/gpu_engines.sh [python]        results under ${OUT:-results/raw}/gpu_engines.md
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
OUT_DIR=${OUT:-results/raw}
mkdir -p "$OUT_DIR"
"$PY" - <<'PY'
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
try:
    import vllm
    print("vllm", vllm.__version__)
except ImportError:
    print("vllm not installed: the vLLM rows will say so")
PY
for dtype in float32 bfloat16; do
  timeout 240 "$PY" bench/engine_throughput.py --device cuda --dtype "$dtype" --prompt 2048 --decode 128 \
    --batch 1 16 --reps 2 --data "$OUT_DIR/ckpt" --out "$OUT_DIR/gpu_engines.md" || echo "dtype $dtype: exit $?"
done
cat "$OUT_DIR/gpu_engines.md"
