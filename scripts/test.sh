#!/usr/bin/env bash
# Runs sluice's whole test suite: unit tests, and integration tests that spawn a real
# redis-server, real upstream servers and the real sluice binary.
# Installs redis-server, redis-sentinel, redis-cli, curl, openssl and prometheus first when
# they are missing and this machine can (apt-get or Homebrew).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/install.sh
source scripts/install.sh

install_if_missing redis-server redis-server
# tests/it/sentinel.rs runs three sentinels next to a master and a replica.
install_if_missing redis-sentinel redis-sentinel
# tests/it/cluster.rs creates a Redis Cluster with redis-cli (Debian's redis-tools).
install_if_missing redis-cli redis-tools
# tests/it/partitions.rs puts a redis-server in its own network namespace (iproute2's `ip`)
# and cuts its link with iptables; for delay and loss, two TUN devices joined by
# scripts/tunrelay.py (python3, which scripts/test-tools.sh needs too).
install_if_missing ip iproute2 iproute2
install_if_missing iptables iptables iptables
# tests/it/tls.rs uses curl as a real TLS client (HTTP/2 through ALPN), and openssl to rewrite
# test keys in the PKCS#1 and SEC1 formats.
install_if_missing curl curl curl
install_if_missing openssl openssl openssl
# tests/it/prometheus.rs scrapes sluice with a real Prometheus server.
install_if_missing prometheus prometheus prometheus
# tests/it/rls.rs runs a real Envoy and a Python gRPC client (venv under target/test-tools).
bash scripts/test-tools.sh
echo "using $(redis-server --version)" >&2

cargo test --locked "$@"
