#!/usr/bin/env bash
# Runs sluice's whole test suite: unit tests, and integration tests that spawn a real
# redis-server, real upstream servers and the real sluice binary.
# Installs redis-server first when it is missing and this machine can (apt-get or Homebrew).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server not found; installing it" >&2
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  elif command -v brew >/dev/null 2>&1; then
    brew install redis
  else
    echo "cannot install redis-server here: install Redis (5.0 or newer, see README) and run this again" >&2
    exit 1
  fi
fi
echo "using $(redis-server --version)" >&2

cargo test --locked "$@"
