#!/usr/bin/env bash
# The benchmark's training and decode measurements in bf16 on one CUDA GPU, sized to finish in under 8 minutes on
# an H200-class GPU (7.4 min there on 2026-11-30, bench/gpu/RESULTS.md): the shipped LoRA recipe (`lora_mlp_joint_plain`)
# healed for 2.5 min, its cosine decay over that wall clock (~300 steps of 0.46 s there, host-bound; any step time),
# every method measured at the 20 % point (the bar's). With OVERHEAD=1, then the router overhead with skipping off
# at block sizes 1 and 3 (routers at init, ROUNDS paired rounds after one untimed call of each side, default 4;
# ~3 min each) into bench/gpu/overhead.txt.
# Writes bench/gpu/RESULTS.md, results.json and pareto.png (GPU name and date in the header); the adapters go to
# bench/.cache/runs-gpu (delete it to retrain). Extra arguments go to `python -m bench.run`.
# Usage: [OVERHEAD=1 [ROUNDS=4]] bench/gpu_bench.sh [--train-minutes 15] [--targets 0.1 0.2 0.3] [--variants ...]
#        [--batch-size 8 --lr-scale 1.41]   (a host-bound step of 8 costs about what one of 4 does; on CPU, at the same
#        samples, batch 8 at the square-root-scaled rate healed about as much as batch 4: bench/RESULTS.md)
# Needs `make bench`'s packages (.venv/.bench-installed) and an NVIDIA GPU; nothing is downloaded. On a machine with
# no network, carry the assets instead: `python -m bench.bundle pack --wheels <dir>` where they were built (see
# bench/README.md), then copy bench/.bundle/ here: it is unpacked first, its wheels installed into bench/.cache/site.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
mkdir -p bench/gpu
"$PY" -m bench.run --device cuda --dtype bfloat16 --num-workers 4 --train-minutes 2.5 \
  --variants lora_mlp_joint_plain --targets 0.2 --caption-samples 20 --text-chunks 8 \
  --runs bench/.cache/runs-gpu --out bench/gpu "$@"
if [ "${OVERHEAD:-0}" = 1 ]; then
  { date -u "+%Y-%m-%d %H:%M UTC"
    for size in 1 3; do
      "$PY" -m bench.overhead --device cuda --dtype bfloat16 --block-size "$size" --rounds "${ROUNDS:-4}" --new-tokens 16
    done; } 2>&1 | grep -v "Loading weights" | tee bench/gpu/overhead.txt
fi
