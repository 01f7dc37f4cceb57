# The README's two commands: `make demo` (the main job) and `make test` (the suite; `make campaign`
# adds the long crash-point campaigns, and .ci/run runs both).
# Both create .venv on first use and install zstore with its test extras — torch first, as the
# CPU build 2.13.0 when no torch is importable, so pip never pulls a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install demo test test-obstore campaign bench clean

$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,torchrl]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/zstore demo

# One pytest worker per core (pytest-xdist; TEST_WORKERS=0 runs in one process): each worker
# starts its own moto S3 server; the Ray tests share one worker (xdist_group "ray").
TEST_WORKERS ?= auto
XDIST = -n $(TEST_WORKERS) --dist loadgroup

test: install
	$(PY) -m pytest $(XDIST)

# Every S3 test again, the campaigns' crash points on S3 included, through the obstore
# transport (the `s3fast` extra; .ci/run runs this).
test-obstore: install
	ZSTORE_S3_CLIENT=obstore $(PY) -m pytest $(XDIST) -m s3

# The long campaigns left out of `make test`: every crash point (S3 included), the slow S3 and
# Ray-on-S3 variants of tests that `make test` runs locally, then long fuzz / property runs.
campaign: install
	$(PY) -m pytest $(XDIST) -m campaign
	ZSTORE_FUZZ_EXAMPLES=400 ZSTORE_PROPERTY_EXAMPLES=200 $(PY) -m pytest $(XDIST) \
		tests/test_fuzz.py tests/test_properties.py

bench: install
	$(PY) benchmarks/bench_storage.py

clean:
	rm -rf $(VENV) .pytest_cache
