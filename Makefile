# Two entry points for a fresh machine: `make run` (serve the app on the embedded reference model)
# and `make test` (install and run the test suite). Both create .venv on first use.
#
# On a GPU machine:
#   make TORCH_SPEC=torch run MODEL=/path/to/checkpoint CONFIG=serve_configs/gpu-1.yaml
# TORCH_SPEC=torch asks for the CUDA build (PyPI's default Linux wheel); it replaces a CPU wheel already
# in .venv. MODEL overrides the config's `args.model`; CONFIG picks the Serve config.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the PyTorch CPU wheel (pip finds 2.13.0 on this machine's disk).
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= serve_configs/prod.yaml
MODEL ?=

# One stamp per torch spec: asking for another spec reinstalls torch even in an existing venv.
TORCH_STAMP := $(VENV)/.torch-$(shell printf '%s' '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9.' '_')
# Is the installed torch what the spec asks for? A pinned spec (torch==X) wants version X; an unpinned one
# (the GPU recipe above) wants a CUDA build. Lets a venv made before the stamps existed keep its wheel.
TORCH_OK := import sys, torch; s = sys.argv[1]; want = s.split("==", 1)[1] if "==" in s else None; \
	sys.exit(0 if (torch.__version__.split("+")[0] == want if want else torch.version.cuda is not None) else 1)

.PHONY: install run test chaos bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(TORCH_STAMP): | $(VENV)/.installed
	$(PY) -c '$(TORCH_OK)' '$(TORCH_SPEC)' 2>/dev/null || \
		{ $(PY) -m pip uninstall -q -y torch && $(PY) -m pip install -q "$(TORCH_SPEC)"; }
	rm -f $(VENV)/.torch-*
	touch $@

install: $(VENV)/.installed $(TORCH_STAMP)

run: install
	$(PY) -m app.cli serve $(CONFIG) $(if $(MODEL),--model $(MODEL))

test: install
	$(PY) -m pytest -q tests

# The chaos suite with its serve-level cases (a local Ray and three engines: minutes), figures written to
# docs/chaos.md. `make test` runs the engine-level chaos cases only.
chaos: install
	$(PY) -m bench.chaos_run

clean:
	rm -rf $(VENV) .pytest_cache
