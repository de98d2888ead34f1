#!/usr/bin/env bash
# Expert parallelism on one machine: the Qwen3-30B-A3B layer at 1, 32 and 512 tokens on one
# process (all threads) and on 2 processes under mpirun (threads split between them), both ways,
# dispatch with f32, bf16 and exact results; one JSON line per run (docs/expert-parallel.md,
# "Measured"). Usage: scripts/ep-bench.sh [BUILD]
set -euo pipefail
build="${1:-build}"
cli="$build/w4a8moe"
threads="$(nproc)"
per=$(( threads / 2 > 0 ? threads / 2 : 1 ))
mpi=(mpirun -np 2 --oversubscribe --allow-run-as-root)
for t in 1 32 512; do
  repeat=$(( t >= 512 ? 5 : 10 ))
  common=(bench --preset qwen3-30b-a3b --tokens "$t" --repeat "$repeat" --json)
  "$cli" "${common[@]}" --threads "$threads"
  "${mpi[@]}" "$cli" "${common[@]}" --threads "$per" --expert-parallel all-reduce
  for results in f32 bf16 exact; do
    "${mpi[@]}" "$cli" "${common[@]}" --threads "$per" --expert-parallel dispatch \
      --ep-results "$results"
  done
done
