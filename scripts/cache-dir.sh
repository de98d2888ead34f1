#!/usr/bin/env bash
# Prints (and makes) the folder of the cached venvs, outside the clone: $W4A8MOE_CACHE if set,
# else /var/cache/w4a8moe if writable, else ~/.cache/w4a8moe.
set -euo pipefail
cache="${W4A8MOE_CACHE:-}"
if [ -z "$cache" ]; then
  cache=/var/cache/w4a8moe
  mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ] || cache="${XDG_CACHE_HOME:-$HOME/.cache}/w4a8moe"
fi
mkdir -p "$cache"
echo "$cache"
