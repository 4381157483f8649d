# The two commands: `make train` and `make test`. Both create .venv when it is missing and
# reinstall only when pyproject.toml changes (stamp files keyed on its hash).
# `make test` (what CI runs, .ci/run) runs every test not marked `slow`; `make test-slow` runs the
# `slow` ones (the long end-to-end runs: see docs/testing.md for which and what still covers each
# runtime, correction mode and exact route in `make test`). PYTEST_ARGS go last, e.g.
# `make test PYTEST_ARGS="-m 'slow or not slow'"` runs both.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell $(PY) -c "import hashlib;print(hashlib.sha256(open('pyproject.toml','rb').read()).hexdigest()[:16])")
STAMP := $(VENV)/.stamp-$(HASH)
STAMP_TEST := $(VENV)/.stamp-test-$(HASH)
CONFIG ?= configs/tiny_cpu.yaml
ARGS ?=
PYTEST_ARGS ?=
# make test's worker processes (pytest-xdist, whole test files per worker); TEST_WORKERS=0: one process
TEST_WORKERS ?= 2

.PHONY: train test test-slow test-full-depth docs install install-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps google-jetstream==0.2.2
	rm -f $(VENV)/.stamp-[0-9a-f]*
	touch $@

$(STAMP_TEST): $(STAMP)
	$(BIN)/pip install -q -e ".[test]"
	rm -f $(VENV)/.stamp-test-*
	touch $@

install: $(STAMP)
install-test: $(STAMP_TEST)

train: $(STAMP)
	$(BIN)/jax-rl train $(CONFIG) $(ARGS)

test: $(STAMP_TEST)
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# the long end-to-end tests left out of `make test` (docs/testing.md)
test-slow: $(STAMP_TEST)
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# the TPU configs compiled at full depth for their pods (libtpu on this host, ~20 min on 2 cores)
test-full-depth: $(STAMP_TEST)
	JAX_RL_FULL_DEPTH=1 $(BIN)/python -m pytest -m full_depth $(PYTEST_ARGS)

# every generated file, from its source (docs/extending.md): base.yaml and docs/config.md from the schema,
# docs/performance.md from docs/results/perf/, docs/paper_repro.md (and its figures) from its records
docs: $(STAMP)
	$(BIN)/python -m jax_rl.config --write
	$(BIN)/python bench/perf_reference.py --write
	$(BIN)/python bench/paper_repro.py --doc-only

clean:
	rm -rf $(VENV)
