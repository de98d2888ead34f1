#!/usr/bin/env bash
# Reproduces the AMX table of docs/performance.md: `w4a8moe bench` with the amx and the
# avx512vnni kernel sets side by side (one after the other for each point, so both see the same
# machine), Qwen3-30B-A3B and Mixtral-8x7B at 1, 8, 32, 128 and 512 tokens (group 32, bf16
# scales, f32 x, uniform routing, all threads), Qwen3 at 512 tokens with skewed routing and with
# group 128 and channelwise scales. Each row: median time, the forward over its roofline
# (max(weight bytes / read bandwidth, MACs / the set's MAC peak), both probed between that run's
# timed forwards), the avx512vnni time over the amx time, and the amx run's MAC probe scaling.
# Needs a CPU with AMX (`w4a8moe check` says why a machine has none).
# Usage: scripts/amx-table.sh [extra bench options]; W4A8MOE_BUILD_DIR picks the build directory
# (default build; configured here as Release if it is not yet).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${W4A8MOE_BUILD_DIR:-build}
scripts/install-deps.sh
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DW4A8MOE_BUILD_TESTS=OFF >/dev/null
fi
cmake --build "$build" -j"$(nproc)" --target w4a8moe_cli >/dev/null
if ! "./$build/w4a8moe" check | grep -q '^kernel sets: amx'; then
  "./$build/w4a8moe" check >&2
  echo "amx-table.sh: the amx kernel set is not usable here" >&2
  exit 1
fi
bench() {  # isa preset tokens routing group [extra]
  local isa=$1 preset=$2 tokens=$3 routing=$4 group=$5
  shift 5
  W4A8MOE_ISA=$isa "./$build/w4a8moe" bench --preset "$preset" --tokens "$tokens" \
    --routing "$routing" --group "$group" --repeat 10 --json "$@" 2>/dev/null
}
echo "| preset | group | tokens | amx ms | amx of roofline | avx512vnni ms | avx512vnni of roofline | avx512vnni / amx | amx MAC probe scaling |"
echo "|---|---|---|---|---|---|---|---|---|"
row() {  # preset tokens routing group [extra]
  local a b
  a=$(bench amx "$@")
  b=$(bench avx512vnni "$@")
  python3 - "$2" "$3" "$a" "$b" <<'PY'
import json, sys
tokens, routing, a, b = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
group = "channelwise" if a["group"] == -1 else str(a["group"])
label = tokens + ("" if routing == "uniform" else " (skewed)")
print("| %s | %s | %s | %.2f | %.0f%% | %.2f | %.0f%% | %.2fx | %.2fx%s |" % (
    a["preset"], group, label, a["median_ms"], 100 * a["roofline_fraction"], b["median_ms"],
    100 * b["roofline_fraction"], b["median_ms"] / a["median_ms"], a["mac_probe_scaling"],
    " (degraded)" if a["machine_degraded"] else ""))
PY
}
for preset in qwen3-30b-a3b mixtral-8x7b; do
  for t in 1 8 32 128 512; do row "$preset" "$t" uniform 32 "$@"; done
done
row qwen3-30b-a3b 512 skewed 32 "$@"
row qwen3-30b-a3b 512 uniform 128 "$@"
row qwen3-30b-a3b 512 uniform -1 "$@"
row qwen3-30b-a3b 128 uniform 128 "$@"
row qwen3-30b-a3b 128 uniform -1 "$@"
