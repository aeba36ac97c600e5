#!/usr/bin/env bash
# Builds llama.cpp's own llama-server from the vendored source in the llama-cpp-python 0.3.36 sdist, for
# benchmarks/serve_llamacpp.py --llama-server. Never run by CI; nothing of it is committed.
# Usage: benchmarks/build_llama_server.sh [OUT_DIR] [UNPACKED_SDIST_DIR]
set -euo pipefail
out="${1:-.bench/llama-server}"
src="${2:-}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
if [ -z "$src" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src="$(ls -d "$tmp"/llama_cpp_python-*/)"
fi
llama="$src/vendor/llama.cpp"
[ -d "$llama" ] || llama="$src"
# Same CPU flags as the Python build (a native build dies with SIGILL in the AMX path on some VMs).
cmake -S "$llama" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_SSE42=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF > "$out/cmake.log"
cmake --build "$out/build" --target llama-server -j "$(nproc)" > "$out/build.log"
ls -la "$out/build/bin/llama-server"
