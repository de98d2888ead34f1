#!/usr/bin/env bash
# llama.cpp, the CPU peer of bench/llama_cpp.py, built once per machine outside the clone:
#   scripts/llama-cpp-env.sh           builds llama-bench and llama-batched-bench (first call: about
#                                      10 minutes on 2 cores) and prints the folder holding them
#   scripts/llama-cpp-env.sh --python  makes the venv of gguf-py (gguf==0.19.0 and its numpy), which
#                                      writes the benchmark's GGUF files, and prints its python
# The source is PyPI's sdist of llama-cpp-python 0.3.36, whose vendor/llama.cpp is llama.cpp at
# commit 0c1e57098bba (no git host is reachable here, PyPI is). The build is llama.cpp's default
# CPU build (Release, GGML_NATIVE, OpenMP, CPU_REPACK), the one its CPU users run, under nice 19
# (the machine is shared). Both live under scripts/cache-dir.sh; a stamp holding the build's
# settings marks a finished build, so later calls only print the path, and a changed setting
# below rebuilds. A lock serialises concurrent first calls.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/install-lib.sh
. scripts/install-lib.sh
version=0.3.36
gguf_pin="gguf==0.19.0"
cache="$(scripts/cache-dir.sh)"
venv="$cache/venv-llama-cpp"
dir="$cache/llama.cpp-$version"
cmake_options=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_CPU_REPACK=ON
               -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
               -DLLAMA_BUILD_SERVER=OFF)
targets=(llama-bench llama-batched-bench)

# the venv: gguf-py writes the models; its pip also fetches the sdist below
make_venv() {
  fill_venv "$venv" "$gguf_pin" "the llama.cpp venv $venv ($gguf_pin)" "$gguf_pin"
}

case "${1:-}" in
  --python)
    exec 9>"$venv.lock"
    flock 9
    make_venv
    echo "$venv/bin/python"
    exit 0 ;;
  "") ;;
  *) echo "llama-cpp-env.sh: unknown option $1 (expected none or --python)" >&2; exit 2 ;;
esac

stamp="$dir/.w4a8moe-built"
want="llama-cpp-python==$version ${cmake_options[*]} ${targets[*]}"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$dir/build/bin"
  exit 0
fi
mkdir -p "$dir"
exec 9>"$dir.lock"
flock 9
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  install_missing cmake make g++
  (exec 8>"$venv.lock"; flock 8; make_venv)
  src="$dir/src"
  if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
    echo "fetching llama-cpp-python==$version's sdist (llama.cpp 0c1e57098bba)" >&2
    rm -rf "$dir/sdist" "$src"
    # --no-binary of this package only: with :all: pip would also build each of its build
    # backend's own dependencies from source, just to read its metadata
    "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
      --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$dir/sdist" >&2
    mkdir -p "$src"
    tar -xzf "$dir"/sdist/llama_cpp_python-"$version".tar.gz -C "$src" --strip-components=1
    rm -rf "$dir/sdist"
  fi
  echo "building llama.cpp's ${targets[*]} in $dir/build (nice 19, about 10 minutes)" >&2
  rm -f "$stamp"
  nice -n 19 cmake -S "$src/vendor/llama.cpp" -B "$dir/build" "${cmake_options[@]}" >&2
  nice -n 19 cmake --build "$dir/build" -j "$(nproc)" --target "${targets[@]}" >&2
  for t in "${targets[@]}"; do
    if [ ! -x "$dir/build/bin/$t" ]; then
      echo "llama-cpp-env.sh: $dir/build/bin/$t was not built" >&2
      exit 1
    fi
  done
  echo "$want" >"$stamp"
fi
echo "$dir/build/bin"
