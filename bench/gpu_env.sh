# Sourced by the GPU scripts (gpu_bench.sh, gpu_heal.sh): checks that torch sees a CUDA device, unpacks a carried
# bench/.bundle (the assets, and wheels into bench/.cache/site) and installs the project; sets PY to the Python to use.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "$(basename "$0"): no CUDA device visible to torch; run \`make bench\` for the CPU benchmark" >&2
  exit 2
fi
if [ -f bench/.bundle/bundle.json ] && [ ! -f bench/.cache/real_vlm/build_info.json ]; then
  "$PY" -m bench.bundle unpack --site bench/.cache/site
fi
if [ -d bench/.cache/site ]; then
  export PYTHONPATH="$PWD/bench/.cache/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# bench/ imports vlm_retrofit.datamodules, which only an install maps onto datamodules/ (pyproject.toml).
if ! "$PY" -c 'import vlm_retrofit.datamodules' 2>/dev/null; then
  echo "$(basename "$0"): installing the project (editable, no dependencies)"
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || {
    # No editable install: a plain one, found before the source tree (PYTHONSAFEPATH: `-m` does not put the
    # working directory first on sys.path; bench/ is then found at the end of PYTHONPATH).
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target bench/.cache/project .
    export PYTHONSAFEPATH=1 PYTHONPATH="$PWD/bench/.cache/project:${PYTHONPATH:+$PYTHONPATH:}$PWD"; }
fi
