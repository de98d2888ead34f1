#!/usr/bin/env bash
# Reproduces the table of docs/performance.md: `w4a8moe bench` for every x86 kernel set this CPU
# has and tokens 1, 8, 32, 128, 512 (Qwen3-30B-A3B, group 32, bf16 scales, f32 x, uniform
# routing, all threads) plus 512 with skewed routing, printing one markdown row per run. Each
# row's ratios come from probes run between that run's timed forwards; its last column is the
# all-thread MAC probe over the one-thread probe ("degraded" below 0.75 per thread: the host was
# taking cores away, and the MAC ratio of that row overstates).
# Usage: scripts/perf-table.sh [extra bench options]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DW4A8MOE_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target w4a8moe_cli >/dev/null
sets=$(./build/w4a8moe check | sed -n 's/^kernel sets: //p' | tr -d ',')
echo "| kernel set | tokens | median ms | tokens/s | weight GB/s | of read bandwidth | GMAC/s | of int8 MAC peak | MAC probe scaling |"
echo "|---|---|---|---|---|---|---|---|---|"
for isa in $sets; do
  [ "$isa" = scalar ] && continue
  [ "$isa" = amxemu ] && continue  # the software model of the tiles: its speed means nothing
  for point in 1 8 32 128 512 512:skewed; do
    t=${point%%:*} routing=uniform
    [ "$point" != "$t" ] && routing=skewed
    W4A8MOE_ISA=$isa ./build/w4a8moe bench --tokens "$t" --routing "$routing" --repeat 10 --json \
      "$@" 2>/dev/null |
      python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
tokens = str(j["tokens"]) + ("" if sys.argv[1] == "uniform" else " (skewed)")
print("| %s | %s | %.2f | %.0f | %.1f | %.0f%% | %.1f | %.0f%% | %.2fx%s |" % (
    j["kernel_set"], tokens, j["median_ms"], j["tokens_per_s"], j["weight_gb_per_s"],
    100 * j["bandwidth_fraction"], j["gmac_per_s"], 100 * j["mac_fraction"],
    j["mac_probe_scaling"], " (degraded)" if j["machine_degraded"] else ""))' "$routing"
  done
done
