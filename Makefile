# Two commands from a fresh clone: `make demo` and `make test`. Each builds .venv on first use
# (torch first, then the project with the dev and demo extras); a stamp file makes later calls
# skip straight to the command. The stamp depends on pyproject.toml, so a changed dependency
# list reinstalls.
#
#   make demo [DEMO_ARGS="--steps 50"]          # the main job on the embedded default (~4 min)
#   make test [PYTEST_ARGS="tests/unit"]        # the suite less its `slow` tests (~8 min on 2 cores)
#   make test-all                               # the whole suite, slow tests included (about twice make test)
#   make test-vllm                              # the vLLM adapter against vLLM's real classes (CPU)
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu   # the CPU build of torch
#   make lock                                   # .ci/constraints.txt anew from the newest releases
#
# The tests run through .ci/pytest (pytest on 2 workers, `-m "not slow"` unless PYTEST_ARGS
# brings its own -m); pytest shows its progress and names every skipped test with its reason.
#
# torch: pip resolves TORCH_SPEC first, on its own, so nothing later can pull another build.
# From PyPI on Linux x86-64 that is a CUDA build (several GB of nvidia-* wheels), GPU or not;
# TORCH_INDEX_URL points pip at another index for torch only (e.g. PyTorch's CPU index).
#
# Everything else installs at the versions of CONSTRAINTS (.ci/constraints.txt: the set the suite
# last passed with), so a release published upstream cannot change what CI tests overnight.
# `make lock` builds a virtualenv without them (the newest releases pyproject.toml admits) and
# writes what it installed there; run the suite on it before committing the file.
# `make install CONSTRAINTS=` installs without them.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
CONSTRAINTS ?= .ci/constraints.txt
PYTEST_ARGS ?=
DEMO_ARGS ?=
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.staleflow-installed
# Runs a command inside the virtualenv (its bin/ first on PATH), as `source activate` would.
IN_VENV := PATH="$(abspath $(VENV))/bin:$$PATH" VIRTUAL_ENV="$(abspath $(VENV))"

.PHONY: install demo test test-all install-vllm test-vllm clean-venv lock

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade --progress-bar off pip
	$(PIP) install --progress-bar off $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) '$(TORCH_SPEC)'
	$(PIP) install --progress-bar off $(if $(CONSTRAINTS),--constraint $(CONSTRAINTS)) -e '.[dev,demo]'
	touch $@

demo: $(STAMP)
	$(IN_VENV) staleflow demo $(DEMO_ARGS)

test: $(STAMP)
	$(IN_VENV) .ci/pytest $(PYTEST_ARGS)

# `-m ""` selects every test: it overrides .ci/pytest's default `-m "not slow"`.
test-all: $(STAMP)
	$(IN_VENV) .ci/pytest -m "" $(PYTEST_ARGS)

# The vLLM adapter's tests against vLLM's real classes (its output processor, serialisation,
# engine arguments), which import on the CPU: a test-only environment, since vLLM's wheel is
# large (~6 GB with its CUDA libraries) and nothing else needs it. vLLM pulls PyPI's CUDA builds
# of torchvision, torchaudio and torchcodec, which cannot load beside the CPU torch; vLLM
# imports them only for multimodal input, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.staleflow-installed

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --progress-bar off $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) '$(TORCH_SPEC)'
	$(VLLM_VENV)/bin/python -m pip install --progress-bar off '$(VLLM_SPEC)'
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --progress-bar off -e '.[server]' pytest pytest-timeout hypothesis
	touch $@

install-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/unit/test_vllm_engine.py tests/unit/test_vllm_adapter.py

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)

# The constraints anew: a fresh .venv without them, then its packages, torch and staleflow aside,
# under the file's own header (its first lines, kept).
lock:
	rm -rf $(VENV)
	$(MAKE) install CONSTRAINTS=
	{ sed -n '/^#/!q;p' .ci/constraints.txt; $(PIP) freeze --exclude-editable | grep -v -i '^torch=='; } > .ci/constraints.txt.new
	mv .ci/constraints.txt.new .ci/constraints.txt
	touch $(STAMP)
