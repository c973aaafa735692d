# Two commands from a fresh clone: `make demo` and `make test`. Each builds .venv on first use
# (torch first, then the project with the dev and demo extras); a stamp file makes later calls
# skip straight to the command. The stamp depends on pyproject.toml, so a changed dependency
# list reinstalls.
#
#   make demo [DEMO_ARGS="--steps 50"]
#   make test [PYTEST_ARGS="tests/unit -q"]      # default: the whole suite, as .ci/run runs it
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu   # the CPU build of torch
#
# torch: pip resolves TORCH_SPEC first, on its own, so nothing later can pull another build.
# From PyPI on Linux x86-64 that is a CUDA build (several GB of nvidia-* wheels), GPU or not;
# TORCH_INDEX_URL points pip at another index for torch only (e.g. PyTorch's CPU index).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=
DEMO_ARGS ?=
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.staleflow-installed
# Runs a command inside the virtualenv (its bin/ first on PATH), as `source activate` would.
IN_VENV := PATH="$(abspath $(VENV))/bin:$$PATH" VIRTUAL_ENV="$(abspath $(VENV))"

.PHONY: install demo test clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade --progress-bar off pip
	$(PIP) install --progress-bar off $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) '$(TORCH_SPEC)'
	$(PIP) install --progress-bar off -e '.[dev,demo]'
	touch $@

demo: $(STAMP)
	$(IN_VENV) staleflow demo $(DEMO_ARGS)

test: $(STAMP)
	$(IN_VENV) .ci/pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
