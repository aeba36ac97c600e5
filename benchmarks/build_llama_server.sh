#!/usr/bin/env bash
# Builds llama.cpp's own llama-server (for benchmarks/serve_llamacpp.py --llama-server OUT_DIR/bin/llama-server)
# with build_llama_tools.sh. Never run by CI.
# Usage: benchmarks/build_llama_server.sh [OUT_DIR] [UNPACKED_SDIST_DIR]
set -euo pipefail
exec "$(dirname "$0")/build_llama_tools.sh" "${1:-.bench/llama-server}" "${2:-}" llama-server
