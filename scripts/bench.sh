#!/usr/bin/env bash
# The main job: install what is missing, build (Release), then benchmark the default model preset
# (Qwen3-30B-A3B MoE layer) with its correctness check. Extra arguments go to `w4a8moe bench`,
# e.g. scripts/bench.sh --tokens 32 --json
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DW4A8MOE_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target w4a8moe_cli
./build/w4a8moe bench "$@"
