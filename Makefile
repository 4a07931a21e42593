# One venv for everything. It sees the system's packages, so a machine that already has torch
# keeps it; otherwise torch is installed pinned (an unpinned torch pulls a multi-GB CUDA build).
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# tests/rules/test_deepspeed_reduce_bucket.py: DeepSpeed is an sdist whose setup.py imports torch,
# so it is built against the venv's pinned torch (no build isolation: an isolated build env
# would pull an unpinned, multi-GB torch); its CPU accelerator JIT-builds one op with ninja
DEEPSPEED := deepspeed==0.19.8
STAMP := $(VENV)/.installed
CSRC := $(wildcard snapforensics/snapshot/*.c snapforensics/snapshot/*.h)

.PHONY: setup demo lint test test-full test-fast test-pythons bench clean fuzz

$(STAMP): pyproject.toml setup.py Makefile $(CSRC)
	$(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -c "import deepspeed" 2>/dev/null || $(BIN)/pip install -q --no-build-isolation $(DEEPSPEED)
	touch $(STAMP)

# The browser tests drive the Debian package's Chromium, the fuzz target needs clang: each
# installed when missing, if we can (root and apt); otherwise the browser tests skip and
# `fuzz` says it did not run.
setup: $(STAMP)
	@command -v chromium >/dev/null 2>&1 && command -v clang-14 >/dev/null 2>&1 || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -q >/dev/null && apt-get install -y -q chromium clang-14 >/dev/null; } \
		|| echo "chromium or clang-14 not installed: browser tests skip, fuzz does not run"

demo: setup
	$(BIN)/snapforensics demo

# ruff over the whole tree, mypy over analysis/ and snapshot/ (config in pyproject.toml)
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# Tests run on every core (pytest-xdist; at most 4 workers: each holds the fixtures' diagnoses);
# recordings stay at two at once over all workers (tests/recordings.py `SLOTS`).
XDIST := -n auto --maxprocesses 4 -p no:benchmark

# what CI runs: every test but the longer proofs marked `full` (README: Tests), and the
# differential sanitizer fuzz target for FUZZ_SECONDS (cfuzz/: a disagreement between the read
# paths or a memory error fails it)
test: lint test-pythons fuzz
	$(BIN)/python -m pytest -q $(XDIST) -m "not full"

FUZZ_SECONDS ?= 60
fuzz: setup
	@if command -v clang-14 >/dev/null 2>&1 || command -v clang >/dev/null 2>&1; then \
		$(MAKE) -s -C cfuzz run SECONDS=$(FUZZ_SECONDS) PY=$(abspath $(BIN))/python \
		> cfuzz/fuzz.log 2>&1 && grep -E "DONE|^stat::(number|average)" cfuzz/fuzz.log || \
		{ tail -60 cfuzz/fuzz.log; exit 1; }; \
	else echo "fuzz: no clang, not run"; fi

# everything: `make test` plus the `full` tests (the forecast's pairs recorded for it alone,
# the framework runs: HF Trainer, accelerate, Fabric, torchtitan's wrapping), with the pinned
# `frameworks` extra installed (torch stays pinned: the extra must not move it)
test-full: lint test-pythons
	$(BIN)/pip install -q -e '.[test,frameworks]' '$(TORCH)'
	$(BIN)/python -m pytest -q $(XDIST)

# The analyzer on the oldest and the newest Python it supports, in venvs without torch: the
# torch-free tier (tests that need torch skip). Interpreters from pyenv when it has them, else
# from uv (`uv python install`).
PYTHONS ?= 3.9 3.13
# what runs there: the loader both ways (C extension and Python path), the cache, the CLI, the
# classifier (PYTHONS_TESTS=tests runs every torch-free test: ~10 min each on 2 busy cores)
PYTHONS_TESTS ?= tests/test_native.py tests/test_cache.py tests/test_cli.py \
	tests/test_classify.py tests/test_older_torch.py
test-pythons:
	@for v in $(PYTHONS); do \
	  py=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v.* 2>/dev/null | sort -V | tail -1); \
	  py=$${py:+$$py/bin/python}; \
	  [ -x "$$py" ] || { uv python install -q $$v && py=$$(uv python find $$v); } || exit 1; \
	  env=.venv-py$$v; \
	  [ -z "$$(find pyproject.toml setup.py $(CSRC) -newer $$env/.installed 2>/dev/null)" ] && [ -f $$env/.installed ] || { \
	    rm -rf $$env && $$py -m venv $$env && \
	    $$env/bin/pip install -q -e . pytest pytest-xdist hypothesis markdown-it-py && \
	    touch $$env/.installed; \
	  } || exit 1; \
	  echo "== Python $$($$env/bin/python -c 'import platform; print(platform.python_version())'), no torch"; \
	  $$env/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" || \
	    { echo "$$env has torch: it must not"; exit 1; }; \
	  $$env/bin/python -m pytest -q -p no:cacheprovider -n 2 -m "not slow" $(PYTHONS_TESTS) || exit 1; \
	done

test-fast: setup
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_load.py

clean:
	rm -rf $(VENV) .venv-py* snapforensics-out .pytest_cache .recordings
