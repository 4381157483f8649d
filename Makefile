# The two commands: `make train` and `make test`. Both create .venv when it is missing and
# reinstall only when pyproject.toml changes (stamp files keyed on its hash).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell $(PY) -c "import hashlib;print(hashlib.sha256(open('pyproject.toml','rb').read()).hexdigest()[:16])")
STAMP := $(VENV)/.stamp-$(HASH)
STAMP_TEST := $(VENV)/.stamp-test-$(HASH)
CONFIG ?= configs/tiny_cpu.yaml
ARGS ?=
PYTEST_ARGS ?=

.PHONY: train test test-full-depth install install-test clean

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
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the TPU configs compiled at full depth for their pods (libtpu on this host, ~20 min on 2 cores)
test-full-depth: $(STAMP_TEST)
	JAX_RL_FULL_DEPTH=1 $(BIN)/python -m pytest -m full_depth $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
