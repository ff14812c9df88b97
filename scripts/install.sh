#!/usr/bin/env bash
# Set up this checkout on a fresh machine: system packages (when root), .venv on python3.11,
# the project with the extras named in ART_MEGA_EXTRAS (default: test). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${ART_MEGA_EXTRAS:-test}"
PYTHON="${ART_MEGA_PYTHON:-python3.11}"
APT_PACKAGES=(iproute2 procps openssh-server openssh-client etcd-server iptables)

if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "install.sh: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "install.sh: $PYTHON not found; install Python 3.11 or set ART_MEGA_PYTHON" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# pip's output is kept in a log and shown only when it fails.
pip_install() {
  local log
  log="$(mktemp)"
  if ! .venv/bin/python -m pip install "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2 || true
    rm -f "$log"
    echo "install.sh: pip install $* failed" >&2
    exit 1
  fi
  rm -f "$log"
}
pip_install -q --upgrade pip
pip_install -q -e ".[${EXTRAS}]"
.venv/bin/python -c "import art_mega, sys; print('install.sh: art-mega', art_mega.__version__, 'on Python', sys.version.split()[0])"
