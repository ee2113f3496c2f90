# Two commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlflow-installed
# Keep JIT-compiled torch extensions (DeepSpeed ops, later) inside the venv: paid once per machine.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch-extensions
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test clean

install: $(STAMP)

# torch first, pinned: an unpinned torch requirement can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: install
	$(VENV)/bin/rlflow demo-assets demo_assets
	$(VENV)/bin/rlflow run configs/demo.yaml $(ARGS)

test: install
	$(PY) -m pytest --durations=15 $(PYTEST_ARGS)

clean:
	rm -rf runs .rlflow demo_assets
