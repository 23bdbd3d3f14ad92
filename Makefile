# Set-up and entry points; every target creates .venv with the pinned stack first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m vlm_retrofit fit

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
