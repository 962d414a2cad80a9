#!/usr/bin/env bash
# Sets up everything kvguard needs on a Debian/Ubuntu machine with Python >= 3.11:
#   1. the Debian packages (server binaries for tests and the production-like profile, the
#      libraries Mooncake's transfer engine links against), installed when missing and possible;
#   2. the virtual environment at .venv with the project and its extras, refreshed when
#      pyproject.toml changes.
# Anything it cannot install stops the run with a message naming what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# binary-or-library:debian-package
NEEDED=(
  "redis-server:redis-server"
  "/usr/lib/postgresql:postgresql"
  "prometheus:prometheus"
  "promtool:prometheus"
  "prometheus-alertmanager:prometheus-alertmanager"
  "amtool:prometheus-alertmanager"
  "libibverbs.so.1:libibverbs1"
  "libnuma.so.1:libnuma1"
  "libcurl.so.4:libcurl4"
  # the operator console's browser tests drive this chromium (Playwright never downloads one)
  "/usr/bin/chromium:chromium"
)

have() {
  local what=$1
  case "$what" in
    /*) [ -e "$what" ] ;;
    *.so.*) ldconfig -p 2>/dev/null | grep -q "$what" ;;
    *) command -v "$what" >/dev/null 2>&1 ;;
  esac
}

missing=()
for entry in "${NEEDED[@]}"; do
  what=${entry%%:*}; pkg=${entry#*:}
  if ! have "$what"; then
    [[ " ${missing[*]-} " == *" $pkg "* ]] || missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then apt=(apt-get); elif sudo -n true 2>/dev/null; then apt=(sudo -n apt-get)
  else
    echo "kvguard: missing Debian packages: ${missing[*]}" >&2
    echo "kvguard: install them with: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "kvguard: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${apt[@]}" update -qq
  "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The Debian packages start their own daemons on standard ports; kvguard starts private
  # instances and does not need them, but leaves a machine's existing services alone.
fi

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "kvguard: Python >= 3.11 is required (found: $("$PY" --version 2>&1 || echo none))" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo "kvguard: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.kvguard-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "kvguard: installing Python packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: an unpinned resolver pass could otherwise pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
