# shellcheck shell=bash
# What scripts/install-deps.sh and scripts/llama-cpp-env.sh share (sourced, not run): Debian
# packages installed where missing, and cached venvs filled when what they should hold changed.

# install_missing <package>...: installs with apt-get those of the Debian packages that are not
# installed (through sudo when not root); nothing when all are.
install_missing() {
  local missing=() p sudo=""
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "installing: ${missing[*]}" >&2
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
}

# fill_venv <venv> <stamp> <what> <pip install arguments>...: unless the venv's stamp file
# (.w4a8moe-requirements) holds <stamp> already, makes the venv with /usr/bin/python3 where it has
# none, pip-installs into it and writes the stamp; says "filling <what>" first. Prints nothing on
# stdout (pip's output goes to stderr).
fill_venv() {
  local venv=$1 want=$2 what=$3
  shift 3
  [ "$(cat "$venv/.w4a8moe-requirements" 2>/dev/null)" != "$want" ] || return 0
  echo "filling $what" >&2
  [ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >&2
  echo "$want" >"$venv/.w4a8moe-requirements"
}
