#!/usr/bin/env bash
# The benchmark's training and decode measurements in bf16 on one CUDA GPU (aim: under 8 minutes on an
# H200-class GPU once the assets are built; the first run also builds them, a few minutes on CPU).
# Writes bench/gpu/RESULTS.md, results.json and pareto.png (GPU name and date in the header); the adapters
# go to bench/.cache/runs-gpu (delete it to retrain). Extra arguments go to `python -m bench.run`.
# Usage: bench/gpu_bench.sh [--train-minutes 1.5] [--train-steps 600] [--variants routed_static gate] ...
# Needs `make bench`'s packages (.venv/.bench-installed) and an NVIDIA GPU; nothing is downloaded. On a machine with
# no network, carry the assets instead: `python -m bench.bundle pack --wheels <dir>` where they were built (see
# bench/README.md), then copy bench/.bundle/ here: it is unpacked first, its wheels installed into bench/.cache/site.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_bench: no CUDA device visible to torch; run \`make bench\` for the CPU benchmark" >&2
  exit 2
fi
if [ -f bench/.bundle/bundle.json ] && [ ! -f bench/.cache/real_vlm/build_info.json ]; then
  "$PY" -m bench.bundle unpack --site bench/.cache/site
fi
if [ -d bench/.cache/site ]; then
  export PYTHONPATH="$PWD/bench/.cache/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
mkdir -p bench/gpu
# Variants decayed over a fixed step count get 600 steps (--train-steps), still capped at 1.5 min each.
exec "$PY" -m bench.run --device cuda --dtype bfloat16 --train-minutes 1.5 --train-steps 600 \
  --variants lora_mlp_joint_plain routed_static_lora_mlp_joint gate_b3 recent_weight \
  --caption-samples 35 --text-chunks 12 --runs bench/.cache/runs-gpu --out bench/gpu "$@"
