#!/usr/bin/env bash
# Every test: install what is missing, build everything with warnings as errors, run CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs="$(nproc)"
cmake -S . -B build-test -DCMAKE_BUILD_TYPE=Release -DW4A8MOE_WERROR=ON >/dev/null
cmake --build build-test -j"$jobs"
ctest --test-dir build-test --output-on-failure -j"$jobs"
