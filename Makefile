# Two entry points for a fresh machine: `make run` (serve the app on the embedded reference model)
# and `make test` (install and run the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the PyTorch CPU wheel (pip finds 2.13.0 on this machine's disk). On a GPU machine run
# `make TORCH_SPEC=torch run` so pip installs the CUDA build instead.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install run test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) -m app.cli serve serve_configs/prod.yaml

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
