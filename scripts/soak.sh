#!/usr/bin/env bash
# sluice's soak: a long mixed run with faults, and a checker of the whole history
# (scripts/soak.py says what it runs, injects and checks; the README's "The soak" says what
# it found).
#
#   bash scripts/soak.sh                      10 minutes, a random seed (printed)
#   bash scripts/soak.sh --duration 60        the CI run
#   bash scripts/soak.sh --seed 42            replay a schedule of faults and load
#   bash scripts/soak.sh --mode cluster       A, B and C on a Redis Cluster instead of Sentinel
#   bash scripts/soak.sh --binary PATH        use this sluice instead of building one
#   bash scripts/soak.sh --keep               keep the state directory (every process's log)
#   bash scripts/soak.sh --history FILE       write the whole history (JSON) for a closer look
#
# It installs redis-server, redis-sentinel and python3 when they are missing (as
# scripts/test.sh does), the `h2` package (HTTP/2 clients) in a venv under target/, and builds
# sluice in release (`cargo build --release --locked`: bench/run.sh then reuses that build).
# Exits 1 when any check fails. Every process listens on 127.0.0.1 only and is stopped when
# the run ends, and the iptables rules of its network faults are removed.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/install.sh
source scripts/install.sh

install_if_missing redis-server redis-server
install_if_missing redis-sentinel redis-sentinel
install_if_missing python3 python3 python@3.11
# The partition and loss faults drop loopback packets to a Redis port with iptables (its
# statistic match for loss), which needs root: without it the soak stops here rather than
# run without them.
install_if_missing iptables iptables iptables
if ! iptables -S OUTPUT >/dev/null 2>&1; then
  echo "soak: iptables cannot be used here (root is needed for the partition and loss faults)" >&2
  exit 1
fi
# Debian's python3 makes venvs only with python3-venv (ensurepip).
python3 -c 'import ensurepip' >/dev/null 2>&1 || {
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  fi
}

# The HTTP/2 client library, pinned, in a venv of its own (under target/, so `cargo clean`
# removes it and CI caches it with the build). curl cannot serve: Debian 12's curl 7.88 fails
# a second stream on a cleartext HTTP/2 connection (curl/curl#10634).
H2_VERSION=4.1.0
venv="${SLUICE_SOAK_VENV:-target/soak-venv}"
if ! "$venv/bin/python" -c "import h2; assert h2.__version__ == '$H2_VERSION'" 2>/dev/null; then
  echo "soak: installing h2 $H2_VERSION from PyPI into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "h2==$H2_VERSION"
fi

binary=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) binary=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -z "$binary" ]; then
  echo "soak: building sluice (cargo build --release --locked)" >&2
  cargo build --release --locked --quiet
  binary=target/release/sluice
fi

ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
exec "$venv/bin/python" scripts/soak.py --binary "$binary" "${args[@]}"
