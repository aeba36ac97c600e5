#!/usr/bin/env bash
# Builds llama.cpp's own command-line tools (default: llama-imatrix and llama-quantize; llama-server for
# benchmarks/serve_llamacpp.py) from the vendored source in the llama-cpp-python 0.3.36 sdist, with the
# non-native CPU flags of the Python build. tests/test_imatrix.py runs it once and keeps the binaries under
# the fixture cache; nothing of it is committed.
# Usage: benchmarks/build_llama_tools.sh OUT_DIR [UNPACKED_SDIST_DIR] [TARGET...]
# The binaries end up in OUT_DIR/bin.
set -euo pipefail
out="${1:?usage: build_llama_tools.sh OUT_DIR [UNPACKED_SDIST_DIR] [TARGET...]}"
src="${2:-}"
shift $(( $# >= 2 ? 2 : $# ))
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(llama-imatrix llama-quantize)
server=OFF
for t in "${targets[@]}"; do [ "$t" = llama-server ] && server=ON; done
mkdir -p "$out"
out="$(cd "$out" && pwd)"
if [ -z "$src" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "${PYTHON:-python3}" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src="$(ls -d "$tmp"/llama_cpp_python-*/)"
fi
llama="$src/vendor/llama.cpp"
[ -d "$llama" ] || llama="$src"
# Same CPU flags as the Python build (a native build dies with SIGILL in the AMX path on some VMs).
cmake -S "$llama" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_SSE42=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=$server -DLLAMA_BUILD_TOOLS=ON \
  -DBUILD_SHARED_LIBS=OFF > "$out/cmake.log" 2>&1
cmake --build "$out/build" --target "${targets[@]}" -j "$(nproc)" > "$out/build.log" 2>&1
mkdir -p "$out/bin"
for t in "${targets[@]}"; do
  cp "$out/build/bin/$t" "$out/bin/$t"
done
ls -la "$out/bin"
