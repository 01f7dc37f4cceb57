# The README's two commands: `make demo` (the main job) and `make test` (the suite; `make campaign`
# adds the long crash-point campaigns, and .ci/run runs both).
# Both create .venv on first use and install zstore with its test extras — torch first, as the
# CPU build 2.13.0 when no torch is importable, so pip never pulls a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install demo test campaign bench clean

$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,torchrl]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/zstore demo

test: install
	$(PY) -m pytest

# The long crash-point campaigns (every kill point, S3 included), left out of `make test`.
campaign: install
	$(PY) -m pytest -m campaign

bench: install
	$(PY) benchmarks/bench_storage.py

clean:
	rm -rf $(VENV) .pytest_cache
