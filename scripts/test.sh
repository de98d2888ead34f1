#!/usr/bin/env bash
# Every test: install what is missing, build everything with warnings as errors, run CTest,
# then the PyTorch binding's pytest suite with Debian's torch (torch stage) and with the pinned
# PyTorch 2 from PyPI (PyTorch 2 stage), the Arm stage and the reliability stages.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --torch --ccache
jobs="$(nproc)"
# The venvs of the PyTorch 2 and vLLM stages are filled (downloads and unpacking, on a machine
# that has not made them yet; nothing when they are up to date) while the test build compiles.
venvs_log="$(mktemp)"
scripts/install-deps.sh --torch2 --vllm >"$venvs_log" 2>&1 &
venvs_pid=$!
# One compiler for the test build and the stages' `pip install .` builds (pip's would otherwise
# be the interpreter's configured x86_64-linux-gnu-g++), with ccache in front: the pip builds
# compile the library's files with the test build's very commands and take them from the cache
# (a third of their time), whatever the torch they build the ops against.
export CXX="${CXX:-c++}" CCACHE_DIR="${CCACHE_DIR:-$(scripts/cache-dir.sh)/ccache}"
cmake -S . -B build-test -DCMAKE_BUILD_TYPE=Release -DW4A8MOE_WERROR=ON \
  -DW4A8MOE_BUILD_TORCH=ON -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build build-test -j"$jobs"
ctest --test-dir build-test --output-on-failure -j"$jobs" -LE torch  # torch: the stage below
echo "== install check, test build, CTest: $SECONDS s =="

# ---- torch stage: the PyTorch binding's pytest suite, with Debian's torch ---------------------
echo "== torch stage: pytest python/tests with /usr/bin/python3 =="
PYTHONPATH="$PWD/build-test/python" W4A8MOE_CLI="$PWD/build-test/w4a8moe" \
  /usr/bin/python3 -m pytest -q -p no:cacheprovider python/tests
echo "== torch stage done at $SECONDS s =="

# ---- PyTorch 2 stage: `pip install .` into the pinned PyTorch 2 venv (made once and kept in a
# cache folder outside the clone by install-deps.sh --torch2; python/requirements-torch2.txt), then
# the same suite run from outside the clone, so that the installed package is what is imported;
# on torch 2 it adds opcheck, torch.compile and torch.export, and with the venv's gguf,
# transformers and compressed-tensors the checkpoints those libraries write.
wait "$venvs_pid" || { cat "$venvs_log"; echo "filling the venvs failed" >&2; exit 1; }
cat "$venvs_log" >&2
rm -f "$venvs_log"

# The PyTorch 2 and vLLM stages' build: `pip install .` of this clone into <venv>, with warnings
# as errors and ccache in front.
pip_install_clone() {  # <stage> <venv>
  echo "== $1 stage: pip install . into $2, pytest python/tests from /tmp =="
  CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$2/bin/python" -m pip install -q --disable-pip-version-check \
    --no-build-isolation --no-deps --force-reinstall -Ccmake.define.W4A8MOE_WERROR=ON \
    -Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache .
}

torch2_stage() {
  local start=$SECONDS repo=$PWD venv
  scripts/install-deps.sh --torch2
  venv="$(scripts/torch2-env.sh)"
  pip_install_clone "PyTorch 2" "$venv"
  (cd /tmp && W4A8MOE_CLI="$repo/build-test/w4a8moe" \
     "$venv/bin/python" -m pytest -q -p no:cacheprovider "$repo/python/tests")
  echo "== PyTorch 2 stage: $((SECONDS - start)) s =="
}
torch2_stage

# ---- vLLM stage: the plugin in the real engine. `pip install .` into the cached vLLM venv
# (vLLM's CPU build, install-deps.sh --vllm), then the engine tests (python/tests/
# test_vllm_engine.py: tiny W4A8 checkpoints by compressed-tensors, vllm.LLM, transformers'
# reference; test_vllm_formats.py: W4A16, GPTQ, AWQ and MXFP4, some served over the OpenAI API
# by docs/vllm.md's command; test_vllm_dense.py: their dense int4 layers; test_vllm_dense_int8.py:
# the bfloat16 dense layers in int8, compiled and eager; test_routed.py: the routing inside the op
# against vLLM's router; test_vllm_families.py: GLM-4.5, DeepSeek-V2/V3 and Qwen3-Next, compiled
# and eager; test_vllm_parallel.py:
# tensor and expert parallelism over two worker processes; test_vllm_load.py: the server under
# a minute of concurrent requests) and the rest of the suite against that torch, from outside
# the clone.
vllm_stage() {
  local start=$SECONDS repo=$PWD venv
  scripts/install-deps.sh --vllm
  venv="$(scripts/vllm-env.sh)"
  pip_install_clone vLLM "$venv"
  # vLLM runs a model on one core (it keeps the others for its front end), so the suite runs as
  # two pytest processes at once, each binding its engines to its half of the cores (the tensor
  # and expert parallel cases bind one rank per core over all of them); their logs follow.
  local t="$repo/python/tests" cpus half bind_a bind_b
  local group_a=("$t/test_vllm_formats.py" "$t/test_vllm_load.py" "$t/test_vllm_dense_int8.py"
                 "$t/test_routed.py" "$t/test_vllm_dense.py" "$t/test_vllm_parallel.py")
  local group_b=("$t/test_vllm_engine.py" "$t/test_vllm_families.py" "$t/test_vllm_plugin.py"
                 "$t/test_vllm_dropin.py" "$t/test_vllm_quantized.py" "$t/test_vllm_packers.py")
  vllm_pytest() {  # <log> <cores> <test files...>
    local log=$1 cores=$2
    shift 2
    (cd /tmp && VLLM_CPU_OMP_THREADS_BIND="$cores" W4A8MOE_CLI="$repo/build-test/w4a8moe" \
       "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15 --basetemp="$log.tmp" "$@") \
      >"$log" 2>&1
  }
  cpus="$(nproc)"
  if [ "$cpus" -lt 2 ]; then
    vllm_pytest "$repo"/build-test/vllm-tests.log auto "${group_a[@]}" "${group_b[@]}" ||
      { cat "$repo"/build-test/vllm-tests.log; return 1; }
    cat "$repo"/build-test/vllm-tests.log
  else
    half=$((cpus / 2))
    bind_a=0 bind_b=1
    [ "$half" -gt 1 ] && bind_a="0-$((half - 1))" bind_b="$half-$((cpus - 1))"
    local status_a=0 status_b=0 pid_a
    vllm_pytest "$repo"/build-test/vllm-tests-a.log "$bind_a" "${group_a[@]}" &
    pid_a=$!
    vllm_pytest "$repo"/build-test/vllm-tests-b.log "$bind_b" "${group_b[@]}" || status_b=$?
    wait "$pid_a" || status_a=$?
    echo "-- vLLM tests, cores $bind_a: ${group_a[*]##*/}"
    cat "$repo"/build-test/vllm-tests-a.log
    echo "-- vLLM tests, cores $bind_b: ${group_b[*]##*/}"
    cat "$repo"/build-test/vllm-tests-b.log
    if [ "$status_a" != 0 ] || [ "$status_b" != 0 ]; then return 1; fi
  fi
  echo "== vLLM stage: $((SECONDS - start)) s =="
}
vllm_stage

# ---- Arm stage: cross build for AArch64, its CTest suites under qemu-aarch64 -------
# One run per Arm kernel set on an emulated CPU with just its features, and the Arm program
# compared with build-test's x86 program on the same case files (tests/arm).
arm_stage() {
  local start=$SECONDS
  echo "== Arm stage: cross build for aarch64-linux-gnu, tests under qemu-aarch64 =="
  scripts/install-deps.sh --arm
  cmake -S . -B build-test-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake \
    -DCMAKE_BUILD_TYPE=Release -DW4A8MOE_WERROR=ON -DW4A8MOE_BUILD_BENCH=OFF \
    -DW4A8MOE_BUILD_TORCH=OFF -DW4A8MOE_HOST_BUILD_DIR="$PWD/build-test" >/dev/null
  cmake --build build-test-aarch64 -j"$jobs"
  ctest --test-dir build-test-aarch64 --output-on-failure -j"$jobs"
  echo "== Arm stage: $((SECONDS - start)) s =="
}
arm_stage

# ---- reliability stages: AddressSanitizer + UBSan build of everything, its tests
# under every kernel set, ThreadSanitizer on the threaded forward pass, libFuzzer harnesses
# (60 s each); see scripts/reliability.sh and docs/testing.md.
scripts/install-deps.sh --reliability
scripts/reliability.sh
echo "== scripts/test.sh: $SECONDS s =="
