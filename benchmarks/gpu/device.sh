#!/usr/bin/env bash
# Issue 30's GPU checks, one prepared script for a lent GPU machine (no package registry there: everything travels
# in .gpu-carry/, git-ignored, under the device tool's 64 MiB carry limit; the image's Python, torch and
# transformers are used as they are).
#
# (a) llama.cpp: tuneport's engine with --gpu-layers all against the same engine on the CPU (logits F32/F16,
#     served greedy answers of base + 4 adapters under mixed traffic), and tok/s beside llama-server built from the
#     same llama.cpp (same GGUF, adapters and traffic):
#       here:   benchmarks/gpu/device.sh pack llamacpp            (~50 MB: trimmed llama.cpp source + wheels)
#       there:  benchmarks/gpu/device.sh build                    (llama.cpp with CUDA for this card + llama-server)
#               benchmarks/gpu/device.sh run llamacpp             ($OUT/llamacpp_parity.json, $OUT/serve_gpu.json)
# (b) ExLlamaV3: base + 2 adapters served by tuneport's in-process engine, KL per adapter against transformers +
#     PEFT on the dequantized base, mixed traffic equal to each adapter alone (exllamav3's JIT build: ~4 min):
#       here:   benchmarks/gpu/device.sh pack exllamav3           (exllamav3 1.6.5 and its wheels)
#       there:  benchmarks/gpu/device.sh run exllamav3            ($OUT/exllamav3_adapters.json)
# `build` keeps its output in .gpu-build/ (an ignored path a warm machine keeps between calls).
# Not yet run on a GPU (issue 30 is blocked on device time): `run llamacpp --cpu-check` tests the scripts here.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
CARRY="$ROOT/.gpu-carry"
BUILD="$ROOT/.gpu-build"
OUT="${OUT:-$ROOT/.bench/gpu}"
LLAMA_CPP_VERSION=0.3.36
PY="${PYTHON:-python3}"
# Pure-Python wheels tuneport needs beyond torch/transformers/numpy/safetensors/tokenizers (on the GPU image),
# and the binary ones for CPython 3.10-3.13 where the image may lack them.
PURE=(peft gguf accelerate huggingface_hub typer click rich markdown-it-py mdurl pygments shellingham httpx httpcore h11
      anyio sniffio idna certifi fastapi starlette uvicorn pydantic annotated-types typing-inspection typing-extensions
      jinja2 psutil)
BINARY=(pydantic-core pyyaml markupsafe sentencepiece)
EXL3_PURE=(exllamav3==1.6.5)
EXL3_BINARY=(ninja marisa-trie "llguidance>=1.7.0")  # pillow: the image has it (torchvision)

download_binary() {  # the binary wheels "$@" for the CPython versions the GPU image may have
  for v in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download -q --no-deps --only-binary :all: --python-version "$v" \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
      -d "$CARRY/wheels" "$@" || true
  done
}

pack() {
  rm -rf "$CARRY" && mkdir -p "$CARRY/wheels"
  "$PY" -m pip download -q --no-deps --only-binary :all: -d "$CARRY/wheels" "${PURE[@]}"
  download_binary "${BINARY[@]}"
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$CARRY/wheels" "$ROOT"
  case "${1:-}" in
    llamacpp) pack_llamacpp ;;
    exllamav3) "$PY" -m pip download -q --no-deps -d "$CARRY/wheels" "${EXL3_PURE[@]}"
               download_binary "${EXL3_BINARY[@]}" ;;
    *) echo "usage: $0 pack llamacpp|exllamav3" >&2; exit 2 ;;
  esac
  du -sh "$CARRY"
}

pack_llamacpp() {
  local tmp; tmp="$(mktemp -d)"
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  # llama.cpp's source without what a CUDA build of libllama + llama-server never reads (models, docs, tests,
  # other GPU backends): ~6 MB instead of 170
  tar czf "$CARRY/llama.cpp-src.tgz" -C "$tmp"/llama_cpp_python-*/vendor/llama.cpp \
    --exclude=./models --exclude=./docs --exclude=./media --exclude=./benches --exclude=./tests \
    --exclude=./examples --exclude=./gguf-py --exclude=./conversion --exclude=./ggml/src/ggml-vulkan \
    --exclude=./ggml/src/ggml-sycl --exclude=./ggml/src/ggml-opencl --exclude=./ggml/src/ggml-cann \
    --exclude=./ggml/src/ggml-musa --exclude=./ggml/src/ggml-webgpu --exclude=./ggml/src/ggml-metal \
    --exclude=./ggml/src/ggml-zdnn --exclude=./ggml/src/ggml-hexagon .
  # llama-cpp-python's Python bindings (the CPU wheel the Makefile caches; its libraries are not used there:
  # LLAMA_CPP_LIB_PATH points at the CUDA build, same llama.cpp source, so the same ABI)
  cp "${TUNEPORT_WHEEL_CACHE:-$HOME/.cache/tuneport/wheels}"/llama_cpp_python-$LLAMA_CPP_VERSION-*.whl "$CARRY/wheels/"
  rm -rf "$tmp"
}

install() {
  # only what is missing: the image's torch, transformers and CUDA stack stay as they are
  "$PY" -m pip install -q --no-index --find-links "$CARRY/wheels" --no-deps "$CARRY"/wheels/tuneport-*.whl
  for pkg in "$CARRY"/wheels/llama_cpp_python-*.whl "$CARRY"/wheels/exllamav3-*.whl; do
    [ -f "$pkg" ] && "$PY" -m pip install -q --no-index --no-deps "$pkg"
  done
  for pkg in "${PURE[@]}" "${BINARY[@]}" "${EXL3_BINARY[@]}"; do
    "$PY" -m pip show -q "$pkg" >/dev/null 2>&1 || \
      "$PY" -m pip install -q --no-index --find-links "$CARRY/wheels" --no-deps "$pkg" || echo "could not install $pkg"
  done
}

build() {
  install
  mkdir -p "$BUILD/src"
  [ -f "$BUILD/src/CMakeLists.txt" ] || tar xzf "$CARRY/llama.cpp-src.tgz" -C "$BUILD/src"
  local arch
  arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)"  # 90 on an H100/H200
  cmake -S "$BUILD/src" -B "$BUILD/cuda" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON > "$BUILD/cmake.log" 2>&1 || { tail -30 "$BUILD/cmake.log"; exit 1; }
  local t0=$SECONDS
  cmake --build "$BUILD/cuda" --target llama llama-server -j "$(nproc)" > "$BUILD/build.log" 2>&1 \
    || { tail -40 "$BUILD/build.log"; exit 1; }
  echo "llama.cpp CUDA (sm_$arch) built in $((SECONDS - t0)) s"
}

run() {
  mkdir -p "$OUT"
  case "${1:-}" in
    llamacpp) shift; run_llamacpp "$@" ;;
    exllamav3) install
               nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
               "$PY" benchmarks/gpu/exllamav3_adapters.py --out "$OUT" 2>&1 | tail -40 ;;
    *) echo "usage: $0 run llamacpp [--cpu-check]|exllamav3" >&2; exit 2 ;;
  esac
}

run_llamacpp() {
  local cpu_check=()
  if [ "${1:-}" = "--cpu-check" ]; then
    cpu_check=(--cpu-check)
  else
    export LLAMA_CPP_LIB_PATH="$BUILD/cuda/bin"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
  fi
  "$PY" -m tuneport doctor --json > "$OUT/doctor.json" || true
  "$PY" benchmarks/gpu/llamacpp_parity.py --out "$OUT" --workdir "$ROOT/.bench/gpu-parity" "${cpu_check[@]}" \
    2>&1 | tail -20
  if [ ${#cpu_check[@]} -eq 0 ]; then
    "$PY" benchmarks/serve_llamacpp.py --gpu-layers all --llama-server "$BUILD/cuda/bin/llama-server" \
      --models "${MODELS:-125m}" --requests 96 --concurrency 8 --json-out "$OUT/serve_gpu.json" --workdir "$ROOT/.bench/serve-gpu" \
      2>&1 | tee "$OUT/serve_gpu.txt" | tail -30
  fi
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 pack llamacpp|exllamav3 | build | run llamacpp [--cpu-check]|exllamav3" >&2; exit 2 ;;
esac
