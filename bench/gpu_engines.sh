#!/usr/bin/env bash
# One call on a lent GPU machine (< 10 min; never run yet: no GPU was lent to the sessions that
# wrote it): the torch engine and vLLM side by side on the Qwen3-0.6B shape
# (bench/engine_throughput.py), a float32 and a bf16 checkpoint, each engine computing in the
# type engine/dtypes.py chooses (bf16 on a bf16 GPU for the bf16 checkpoint).
#
#   bash bench/gpu_engines.sh [python]      results: ${OUT:-results/raw}/gpu_engines.md and .log
#
# What the machine needs: a python with CUDA torch, transformers, tokenizers, safetensors and
# jinja2 (this workplace's H200 image has them), plus talaria's two runtime packages it lacks,
# carried as wheels in .whl/ (prepared here, once; .whl is ignored, name it in `carry`):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl msgspec==0.23.0 structlog==26.1.0
# and, for the vLLM rows, `vllm` installed there. vLLM's CUDA wheels are far over the device
# tool's 64 MiB transfer limit, so on this workplace's lent H200 the vLLM rows say "not run"
# and only the torch engine's are measured; on a GPU machine with vllm installed both run.
# Time: two checkpoints written (~20 s each on the host CPU), then per dtype at most 240 s
# (timeout), so < 9 min in all; every row is also printed as it is measured (the .log).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
OUT_DIR=${OUT:-results/raw}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" - <<'PY' 2>&1 | tee "$OUT_DIR/gpu_engines.log"
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
      "bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
for name in ("msgspec", "structlog", "transformers", "vllm"):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(name, "MISSING" + (": the vLLM rows will say not run" if name == "vllm" else ": carry its wheel (.whl)"))
PY
for dtype in float32 bfloat16; do
  timeout 240 "$PY" bench/engine_throughput.py --device cuda --dtype "$dtype" --prompt 2048 --decode 128 \
    --batch 1 16 --reps 2 --data /tmp/gpu-ckpt --out "$OUT_DIR/gpu_engines.md" 2>&1 | tee -a "$OUT_DIR/gpu_engines.log" \
    || echo "dtype $dtype: exit $?" | tee -a "$OUT_DIR/gpu_engines.log"
done
cat "$OUT_DIR/gpu_engines.md" 2>/dev/null || echo "no rows written (see $OUT_DIR/gpu_engines.log)"
