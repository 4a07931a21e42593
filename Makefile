# One venv for everything. It sees the system's packages, so a machine that already has torch
# keeps it; otherwise torch is installed pinned (an unpinned torch pulls a multi-GB CUDA build).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo lint test test-fast bench clean

$(STAMP): pyproject.toml setup.py snapforensics/snapshot/_native.c
	$(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# The browser test drives the Debian package's Chromium: installed when missing, if we can
# (root and apt); otherwise tests/test_browser.py skips.
setup: $(STAMP)
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get \
		>/dev/null 2>&1 && apt-get update -q >/dev/null && \
		apt-get install -y -q chromium >/dev/null; } || \
		echo "chromium not installed: tests/test_browser.py will be skipped"

demo: setup
	$(BIN)/snapforensics demo

# ruff over the whole tree, mypy over analysis/ and snapshot/ (config in pyproject.toml)
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_load.py

clean:
	rm -rf $(VENV) snapforensics-out .pytest_cache .recordings
