#!/usr/bin/env bash
# A few bf16-mixed training steps on CUDA with a tiny offline backbone; prints the step time.
# Usage: bench/gpu_check.sh [--family qwen2_vl] [--steps 30] [--batch-size 8] [--hidden 256] [--layers 8]
# Needs the project's environment (`make setup`) and an NVIDIA GPU; nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
  echo "gpu_check: nvidia-smi not found" >&2
fi
exec "$PY" bench/gpu_check.py "$@"
