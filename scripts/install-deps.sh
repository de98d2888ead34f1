#!/usr/bin/env bash
# Installs what the build needs on Debian 12, only where it is missing.
set -euo pipefail

packages=(g++ cmake make libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
          libcli11-dev)
# ---- PyTorch binding (issue 5): --torch adds torch, its headers and pytest for /usr/bin/python3,
# and OpenBLAS (the tests' plain-torch reference runs ~4x slower on Debian's reference BLAS)
for arg in "$@"; do
  if [ "$arg" = "--torch" ]; then
    packages+=(python3-torch libtorch-dev python3-pytest libopenblas0-pthread)
  fi
done
# ---- end PyTorch binding
# ---- Arm (issue 4): --arm adds the AArch64 cross compiler, qemu-user and GoogleTest's sources
for arg in "$@"; do
  if [ "$arg" = "--arm" ]; then packages+=(g++-aarch64-linux-gnu qemu-user googletest); fi
done
# ---- end Arm
# ---- reliability (issue 6): --reliability adds clang and its runtimes (libFuzzer, sanitizers)
for arg in "$@"; do
  if [ "$arg" = "--reliability" ]; then packages+=(clang libclang-rt-14-dev); fi
done
# ---- end reliability
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
