#!/usr/bin/env bash
# Installs what the build needs on Debian 12, only where it is missing.
#   --torch        torch, its headers and pytest for /usr/bin/python3 (the PyTorch binding), and
#                  OpenBLAS (the tests' plain-torch reference runs ~4x slower on the reference BLAS)
#   --arm          the AArch64 cross compiler, qemu-user and GoogleTest's sources (the Arm stage)
#   --reliability  clang and its runtimes: libFuzzer and the sanitizers (scripts/reliability.sh)
set -euo pipefail

packages=(g++ cmake make libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
          libcli11-dev)
for arg in "$@"; do
  case "$arg" in
    --torch) packages+=(python3-torch libtorch-dev python3-pytest libopenblas0-pthread) ;;
    --arm) packages+=(g++-aarch64-linux-gnu qemu-user googletest) ;;
    --reliability) packages+=(clang libclang-rt-14-dev) ;;
    *) echo "install-deps.sh: unknown option $arg (expected --torch, --arm, --reliability)" >&2
       exit 2 ;;
  esac
done
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
