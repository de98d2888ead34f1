#!/usr/bin/env bash
# Prints the folder of the PyTorch 2 venv (made by scripts/install-deps.sh --torch2): under
# $W4A8MOE_CACHE if set, else /var/cache/w4a8moe if writable, else ~/.cache/w4a8moe. The name
# carries the pinned torch version, so a new pin gets a new venv next to the old one.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="$(scripts/cache-dir.sh)"
torch_pin="$(sed -n 's/^torch==//p' python/requirements-torch2.txt)"
echo "$cache/venv-torch-$torch_pin"
