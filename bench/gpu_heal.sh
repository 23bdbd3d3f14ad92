#!/usr/bin/env bash
# The LoRA healing at the 20 % point with more samples than the CPU's 20-minute budget holds: `bench.heal` trains the
# bench's VARIANT recipe (default `lora_mlp_span`; `lora_mlp_span_layer` starts from a layer replacement) on one
# CUDA GPU for MINUTES (the rate decays over them), on batches of BATCH at the square-root-scaled rate, for the span
# the bench's search picks on this model (layers 13-18); then `bench.measure` reads its pruned release beside the
# base on the test workloads in bf16 (the table's settings). Sized for one H200-class GPU: ~1 min of setup, MINUTES
# of training, ~2 min of measuring. Writes heal.log, train_info.json, measure.log and measure.json into OUT_DIR
# (default bench/gpu/heal). Setup and assets as for gpu_bench.sh. SEED seeds the training stream and the LoRA
# initialisation. The adapter goes to bench/.cache/runs-gpu-heal/VARIANT (runs-gpu-heal-seedN for another SEED):
# delete that folder to train the same seed again.
# Usage: [VARIANT=lora_mlp_span] [MINUTES=5.5] [BATCH=8] [LR_SCALE=1.41] [SEED=0] bench/gpu_heal.sh [OUT_DIR]
# A second seed: SEED=1 bench/gpu_heal.sh bench/gpu/heal-seed1
# The layer replacement's recipe: VARIANT=lora_mlp_span_layer bench/gpu_heal.sh bench/gpu/heal-layer
set -euo pipefail
out="$(realpath -m "${1:-$(dirname "$0")/gpu/heal}")"  # before gpu_env.sh moves to the repository root
source "$(dirname "$0")/gpu_env.sh"
seed="${SEED:-0}"
variant="${VARIANT:-lora_mlp_span}"
runs=bench/.cache/runs-gpu-heal
[ "$seed" = 0 ] || runs="$runs-seed$seed"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" -m bench.heal "$variant" --removal 13 14 15 16 17 18 --device cuda --train-minutes "${MINUTES:-5.5}" \
  --batch-size "${BATCH:-8}" --lr-scale "${LR_SCALE:-1.41}" --seed "$seed" --num-workers 4 --runs "$runs" \
  2>&1 | grep --line-buffered -v "Loading weights" | tee "$out/heal.log"
cp "$runs/$variant/train_info.json" "$out/"
"$PY" -m bench.measure "$runs/$variant/adapter" --device cuda --dtype bfloat16 --out "$out/measure.json" \
  2>&1 | grep --line-buffered -v "Loading weights" | tee "$out/measure.log"
