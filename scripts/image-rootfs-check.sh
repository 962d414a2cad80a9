#!/usr/bin/env bash
# The container image's runtime without Docker, for real: a Debian bookworm root from Debian's own
# packages (debootstrap --variant=minbase, what debian:bookworm-slim is built from), the
# Dockerfile's own apt-get steps run inside it, then prefill, decode and the gateway started in it
# (chroot) from this checkout's environment, and one chat answered through them.
#
# Slow (a few minutes: it downloads the packages), so not part of `make test`; the fast check
# that fails when the Dockerfile misses a library is tests/ops/test_ops_image.py.
# Needs root, debootstrap and the package mirror. Usage:
#   scripts/image-rootfs-check.sh [--without-dockerfile-packages]
# The second form shows the failure the Dockerfile's packages prevent.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
ROOT=${ROOTFS:-/var/tmp/kvguard-image-rootfs}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
with_packages=1
[ "${1:-}" = "--without-dockerfile-packages" ] && with_packages=0

command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }
[ -x .venv/bin/python ] || { echo "run make bootstrap first" >&2; exit 2; }

mounted=()
cleanup() {
  for ((i=${#mounted[@]}-1; i>=0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
  [ -n "${pids:-}" ] && kill $pids 2>/dev/null || true
}
trap cleanup EXIT
bind() { mkdir -p "$2"; mount --bind "$1" "$2"; mounted+=("$2"); }

if [ ! -x "$ROOT/usr/bin/apt-get" ]; then
  echo "== debootstrap --variant=minbase bookworm $ROOT"
  debootstrap --variant=minbase bookworm "$ROOT" "$MIRROR" >/dev/null
fi
bind /proc "$ROOT/proc"
bind /dev "$ROOT/dev"
bind /sys "$ROOT/sys"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"

# The base image's Python is built from source under /usr/local, and its build keeps (apt-mark
# manual) the Debian packages of the libraries that interpreter links against. This checkout's
# interpreter stands in for it (the .venv's base, bind-mounted at its own path); the packages of
# the libraries it links against are installed the same way.
PYHOME=$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')
modules=$(ls "$PYHOME"/lib/python3.11/lib-dynload/*.so | grep -v tkinter)  # as the image: no tk
paths=$(ldd "$PYHOME"/bin/python3.11 $modules 2>/dev/null | awk '/=> \// {print $3}' | sort -u)
pylibs=$(for path in $paths; do dpkg-query --search "$path" "$(realpath "$path")" 2>/dev/null \
  || true; done | cut -d: -f1 | sort -u | tr '\n' ' ')
echo "== the interpreter's libraries come from: $pylibs"
chroot "$ROOT" apt-get update -qq
chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  ca-certificates $pylibs >/dev/null
bind "$PYHOME" "$ROOT$PYHOME"
if [ "$with_packages" = 1 ]; then
  # The Dockerfile's own apt-get install line(s), as written there.
  packages=$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests/ops")
import image_runtime as r
print(" ".join(sorted(r.parse_dockerfile(open("Dockerfile").read()).apt_packages)))')
  echo "== the Dockerfile's packages: $packages"
  chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    $packages >/dev/null
fi
bind "$REPO" "$ROOT$REPO"

port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P=$(port); D=$(port); G=$(port)
logs=$(mktemp -d)
run() {  # NAME ARGS... : kvguard inside the root, log in $logs/NAME.log
  local name=$1; shift
  chroot "$ROOT" env -i PATH=/usr/bin:/bin HOME=/tmp KVGUARD_TORCH_THREADS=1 \
    KVGUARD_TRANSFER_HOST=127.0.0.1 KVGUARD_DATA_DIR=/tmp/kvguard GLOG_minloglevel=2 \
    LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_OFFLINE_MODE=true \
    "$REPO/.venv/bin/kvguard" "$@" >"$logs/$name.log" 2>&1 &
  pids="${pids:-} $!"
}
healthy() {  # URL NAME
  for _ in $(seq 1 600); do
    curl -fsS "$1/health" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "== $2 never became healthy:"; tail -20 "$logs/$2.log"; return 1
}
run prefill backend prefill --port "$P"
healthy "http://127.0.0.1:$P" prefill
run decode backend decode --port "$D" --prefill-url "http://127.0.0.1:$P"
healthy "http://127.0.0.1:$D" decode
run gateway gateway --port "$G" --engine "http://127.0.0.1:$D"
healthy "http://127.0.0.1:$G" gateway
for _ in $(seq 1 100); do
  curl -fsS "http://127.0.0.1:$D/engine/capacity" | grep -q '"unavailable":null' && break
  sleep 0.2
done
body='{"model": "kvguard-tiny", "messages": [{"role": "user", "content": "Repeat exactly: hello"}], "max_tokens": 8}'
answer=$(curl -sS "http://127.0.0.1:$D/v1/chat/completions" -H 'Content-Type: application/json' -d "$body")
echo "== decode (via prefill) answered: $answer"
echo "$answer" | grep -q '"finish_reason"' || { tail -20 "$logs/prefill.log"; exit 1; }
echo "== prefill, decode and gateway ran in a bookworm minbase root with the Dockerfile's packages"
