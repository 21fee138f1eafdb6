# Two entry points, both safe on a fresh machine: they set up .venv first.
#   make demo   start a daemon on a private socket and cache (removed at the end), run a small workload, stop
#   make test   the whole test suite (as root, its set-up also apt-installs redis-server for the fleet tests)
PYTHON ?= python3
VENV := .venv
# The CPU build of torch (it lies on disk on our machines); set TORCH_SPEC=torch for a CUDA host.
TORCH_SPEC ?= torch==2.13.0
# NVRTC from the same CUDA release as the toolkit whose headers it compiles against (nvcc on PATH);
# without a toolkit it is left out and CUDA kernels compile through nvcc (or not at all).
CUDA_RELEASE := $(shell nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
NVRTC_SPEC ?= $(if $(CUDA_RELEASE),"nvidia-cuda-nvrtc==$(CUDA_RELEASE).*" "cuda-bindings==$(CUDA_RELEASE).*")

$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV) (once): pip installs torch, TileLang and about 60 more packages (1.8 GB): about 1 min on 2 cores, plus any download"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e ".[test,hf]" $(NVRTC_SPEC)
	touch $@

# The fleet tests start a real redis-server (Debian's package): installed for `make test` when we
# are root; otherwise we say what to install, and those tests skip (outside CI). Never for the demo.
redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; \
	  else echo "redis-server is not installed: the fleet tests need it (sudo apt-get install redis-server); they skip without it"; fi; }

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/python -m devtools.demo

test: setup redis-server
	$(VENV)/bin/python -m pytest -q

stubs: setup
	$(VENV)/bin/python -m proto.generate

.PHONY: setup redis-server demo test stubs
