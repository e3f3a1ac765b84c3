# Every target runs inside .venv; `make test` creates it on a fresh clone and reinstalls only when
# pyproject.toml changed since the last install (the stamp lives in .venv, so deleting .venv resets it).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Two workers, a test file each at a time (module fixtures run once). Measured on 2 cores, cold cache:
# 636 s against ~870 s serially; tests are mostly single-threaded XLA compiles, so two overlap well.
PYTEST_ARGS ?= -n 2 --dist loadfile

export JAX_COMPILATION_CACHE_DIR := $(CURDIR)/.jax_cache
# Tests run on the CPU even where a GPU exists (tests/conftest.py fakes 8 CPU devices); demo and bench don't.
test: export JAX_PLATFORMS := cpu

.PHONY: install test demo bench lint

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[dev]'
	touch $@

# PYTEST_ARGS= (empty) runs serially, e.g. to debug one test.
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m experiments.demo

# Figures depend on the CPU (the small preset's training ratio vs HF: 1.5-1.8x on an AVX-512 VM, 1.02x on an
# AVX2-only EPYC) and on the load: print the machine once here; every script also prints it (load at start
# and end) and records it under "machine" in its JSON.
bench: $(STAMP)
	@$(PY) -c "from c2jax.machine import summary_line; print('machine:', summary_line())"
	@set -e; for script in experiments/bench/*.py; do \
		mod=$$(basename $$script .py); \
		[ "$$mod" = "__init__" ] && continue; \
		echo "== experiments.bench.$$mod"; \
		$(PY) -m experiments.bench.$$mod; \
	done

lint: $(STAMP)
	$(PY) -m ruff check .
