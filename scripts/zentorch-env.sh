#!/usr/bin/env bash
# zentorch, the peer of bench/zentorch_moe.py: fills, once per machine, a venv with
# python/requirements-zentorch.txt (torch and zentorch from PyPI, about 5.6 GB) under
# scripts/cache-dir.sh, and prints its folder. The venv's name carries the zentorch pin, so a new
# pin gets a new venv next to the old one; a stamp holding the file's hash marks a finished fill,
# so later calls only print the path. A lock serialises concurrent first calls. The fill needs
# about 9 GB free for a moment (the downloaded wheels beside the unpacked venv): it stops first
# when the cache's disk has less.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/install-lib.sh
. scripts/install-lib.sh
requirements=python/requirements-zentorch.txt
pin="$(sed -n 's/^zentorch==//p' "$requirements")"
venv="$(scripts/cache-dir.sh)/venv-zentorch-$pin"
want="$(sha256sum "$requirements" | cut -d' ' -f1)"
if [ "$(cat "$venv/.w4a8moe-requirements" 2>/dev/null)" != "$want" ]; then
  install_missing python3-venv
  free_gb=$(( $(df --output=avail -k "$(dirname "$venv")" | tail -1) / 1000000 ))
  if [ ! -d "$venv" ] && [ "$free_gb" -lt 9 ]; then
    echo "zentorch-env.sh: $(dirname "$venv") has $free_gb GB free; filling $venv needs about 9" >&2
    exit 1
  fi
  exec 9>"$venv.lock"
  flock 9
  fill_venv "$venv" "$want" "the zentorch venv $venv ($requirements changed or new)" \
    --no-cache-dir -r "$requirements"
fi
echo "$venv"
