#!/usr/bin/env bash
# The reliability stages of scripts/test.sh, each in its own build directory:
#
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer build (GCC) of the library, the program
#         and every test suite; CTest runs the library suites once per kernel set (W4A8MOE_ISA),
#         the kernel suites over every set, the program's suites against the sanitized program;
#         the driver's grids run under the best set and the portable one only.
#   tsan  ThreadSanitizer build (GCC) of the library suites; the threaded forward pass (thread
#         counts 1 to 7, concurrent contexts, repeated calls, the feature grid) and the dense
#         linear layer (its grid, 1 and 3 threads) under the best
#         set, its cheaper thread cases under the portable set.
#   fuzz  libFuzzer (clang) harnesses, each run for FUZZ_SECONDS (default 60) on its corpus in
#         fuzz/corpus/<name>; new inputs go to build-test-fuzz/corpus, the committed seeds are
#         read only. A crash fails the stage and names the input: add it to fuzz/corpus/<name>/
#         (the replay suite, tests/test_fuzz_replay.cpp, then keeps it fixed) and fix the bug.
#
# Usage: scripts/reliability.sh [asan] [tsan] [fuzz]   (no argument: all three)
# Nothing is suppressed for project code. ASan's allocator returns null instead of aborting on an
# impossible request (allocator_may_return_null=1), as malloc does: the tests check that the
# library turns that into an Error. The sanitized builds use -O1 -g1 without NDEBUG (so the
# kernels' debug checks run too) and do not treat warnings as errors: GCC documents false
# positives of its flow-based warnings under -fsanitize (the main build keeps -Werror).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="$(nproc)"
fuzz_seconds="${FUZZ_SECONDS:-60}"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(asan tsan fuzz)

export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"

common=(-DCMAKE_BUILD_TYPE=None "-DCMAKE_CXX_FLAGS=-O1 -g1" -DW4A8MOE_WERROR=OFF
        -DW4A8MOE_BUILD_BENCH=OFF -DW4A8MOE_BUILD_TORCH=OFF)

asan_stage() {
  cmake -S . -B build-test-asan -DW4A8MOE_SANITIZE=address,undefined "${common[@]}" >/dev/null
  cmake --build build-test-asan -j"$jobs"
  # The driver's grids (Forward/OriginalGrid and FeatureGrid, Cases/Threads and ExpertParallel:
  # the same driver code over each set's kernels) under this machine's best set and the portable
  # one; every other suite (validation, packing, hostile input, files, the kernel suites with
  # every tile and panel edge of every set) under every set. The grids under the other sets took
  # 4 of the 10 minutes of tests (2 cores), and the unsanitized stage runs them under every set.
  # The portable set skips the 24 largest OriginalGrid cases (H = 2048): only their size differs.
  # The per-set runs of sets this CPU lacks are left out too: they would only skip, and under
  # ASan each set's 340 skips took 21 s of CPU (the unsanitized stage still runs them).
  local best usable others lacking
  best="$(build-test-asan/w4a8moe check | sed -n 's/^active kernel set: //p')"
  usable="$(build-test-asan/w4a8moe check | sed -n 's/^kernel sets: //p' | tr -d ' ' |
    tr ',' '\n')"
  others="$(echo "$usable" | { grep -vx -e "$best" -e scalar || true; } | paste -sd '|')"
  lacking="$({ grep -vx -F "$usable" build-test-asan/kernel-sets.txt || true; } | paste -sd '|')"
  local grids='(Forward/(OriginalGrid|FeatureGrid)|Cases/(Threads|ExpertParallel))'
  local skip="^scalar\.Forward/OriginalGrid\..*_H2048_"
  [ -n "$others" ] && skip="$skip|^($others)\.$grids\."
  [ -n "$lacking" ] && skip="$skip|^($lacking)\."
  echo "-- asan: the driver's grids under $best and scalar only"
  ctest --test-dir build-test-asan --output-on-failure -j"$jobs" -E "$skip"
}

tsan_stage() {
  # (the software-model sets amxemu and avxvnniemu are not built: this stage runs the best set
  # and the portable one, and their GEMMs are the asan stage's and the unsanitized stage's)
  cmake -S . -B build-test-tsan -DW4A8MOE_SANITIZE=thread -DW4A8MOE_BUILD_TOOLS=OFF \
    -DW4A8MOE_MODEL_SETS=OFF "${common[@]}" >/dev/null
  cmake --build build-test-tsan -j"$jobs" --target w4a8moe_tests w4a8moe_reliability_tests
  # The thread suites (1 to 7 threads, concurrent and pooled contexts, repeated and chunked calls)
  # and the feature grid (every activation, bias, router weight on the input: 2 threads) with the
  # best kernel set; the portable set's kernels are slow under TSan: its cheaper thread cases only.
  local threads='Cases/Threads.*:ThreadsContext.*:TaskClaims.*:ContextPoolTest.*'
  threads+=':ForwardInput.EmptyBatchIsANoOp'
  threads+=':Forward/FeatureGrid.*:SpecialRows.NanOrInfInXStaysInItsToken'
  threads+=':Linear.BitIdenticalForAnyThreadCount:Linear/LinearGrid.*'
  local cheap='Cases/Threads.*decode_T1:Cases/Threads.*channelwise_odd_f16:ThreadsContext.*'
  cheap+=':ContextPoolTest.*'
  local more='ResourceLimits.*:PackedFileTest.RoundTripGivesTheSameBits:HostilePointers.*'
  local isa filter
  for isa in best scalar; do
    echo "-- tsan: kernel set $isa"
    filter="$threads"
    [ "$isa" = scalar ] && filter="$cheap"
    W4A8MOE_ISA="${isa/best/}" build-test-tsan/tests/w4a8moe_tests --gtest_brief=1 \
      --gtest_filter="$filter"
    W4A8MOE_ISA="${isa/best/}" build-test-tsan/tests/w4a8moe_reliability_tests --gtest_brief=1 \
      --gtest_filter="$more"
  done
}

fuzz_stage() {
  cmake -S . -B build-test-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DW4A8MOE_SANITIZE=address,undefined -DW4A8MOE_BUILD_FUZZ=ON -DW4A8MOE_BUILD_TESTS=OFF \
    -DW4A8MOE_BUILD_BENCH=OFF -DW4A8MOE_BUILD_TOOLS=OFF -DW4A8MOE_BUILD_TORCH=OFF \
    -DW4A8MOE_MODEL_SETS=OFF >/dev/null  # as the installed library: no software-model sets
  local names=(api packed packed_file safetensors)
  cmake --build build-test-fuzz -j"$jobs" --target "${names[@]/#/w4a8moe_fuzz_}"
  local pids=() status=0 name
  for name in "${names[@]}"; do
    mkdir -p "build-test-fuzz/corpus/$name" "build-test-fuzz/artifacts/$name"
  done
  # Two at a time (one per core); each is one process.
  run_one() {
    local name=$1 max_len=16384
    [ "$name" = api ] && max_len=512
    if build-test-fuzz/fuzz/w4a8moe_fuzz_"$name" -max_total_time="$fuzz_seconds" -timeout=20 \
         -rss_limit_mb=2048 -max_len="$max_len" -print_final_stats=1 \
         -artifact_prefix="build-test-fuzz/artifacts/$name/" \
         "build-test-fuzz/corpus/$name" "fuzz/corpus/$name" >"build-test-fuzz/$name.log" 2>&1; then
      echo "-- fuzz $name: $(grep -m1 -oE 'stat::number_of_executed_units: *[0-9]+' \
        "build-test-fuzz/$name.log" | grep -oE '[0-9]+$') runs, no finding"
    else
      echo "-- fuzz $name: FINDING (log build-test-fuzz/$name.log):"
      grep -E 'finding|ERROR|SUMMARY|Test unit written' "build-test-fuzz/$name.log" | head -20
      return 1
    fi
  }
  local running=0
  for name in "${names[@]}"; do
    run_one "$name" &
    pids+=($!)
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then
      wait "${pids[0]}" || status=1
      pids=("${pids[@]:1}")
      running=$((running - 1))
    fi
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  return "$status"
}

for stage in "${stages[@]}"; do
  start=$SECONDS
  echo "== reliability stage: $stage =="
  "${stage}_stage"
  echo "== reliability stage: $stage: $((SECONDS - start)) s =="
done
