#!/usr/bin/env bash
# Checks the deploy kit with real tools, without a Docker engine or a cluster:
#   - the Dockerfile with hadolint, and its build stage's files (what it COPYs) make a project
#     cargo accepts (`cargo fetch --locked` in a folder holding only those);
#   - the Prometheus config and alert rules with promtool (Debian's `prometheus` package);
#   - the Kubernetes manifests against the Kubernetes API schemas (kubernetes-validate,
#     strict: unknown fields fail), and the PodMonitor/ServiceMonitor against the Prometheus
#     Operator's API types (scripts/check_monitors.py);
#   - the compose file against the compose specification's schema (check-jsonschema);
#   - the Grafana dashboard is JSON (its queries run against a real Prometheus in
#     tests/it/prometheus.rs);
#   - every sluice policy in config/, deploy/ (including those inside ConfigMaps) and the
#     complete examples of the book (docs/src) and the README with `sluice check` and against
#     config/sluice.schema.json, and
#     policies `sluice check` refuses must be refused by the schema too.
# Installs promtool with apt-get and the Python checkers into target/ci-tools when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_install() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! command -v promtool >/dev/null 2>&1; then
  echo "promtool not found; installing Debian's prometheus package" >&2
  apt_install prometheus
fi
# Debian's python3 makes virtual environments only with python3-venv (ensurepip).
if ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
  echo "python3 cannot make a virtual environment; installing Debian's python3-venv" >&2
  apt_install python3-venv
fi

tools=target/ci-tools
stamp=$tools/.installed-$(sha256sum scripts/ci-tools.txt | cut -c1-16)
if [ ! -e "$stamp" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install --quiet -r scripts/ci-tools.txt
  touch "$stamp"
fi

echo "== hadolint Dockerfile" >&2
"$tools/bin/hadolint" Dockerfile

# No image is built here, but the build stage's context is: the files its COPY lines bring in,
# alone in a folder, must make a Cargo project whose manifest and lock file cargo accepts.
echo "== Docker build context" >&2
context=$(mktemp -d)
awk '/^FROM .* AS build/ {build=1; next} /^FROM / {build=0}
     build && /^COPY / && !/--from/ {for (i = 2; i < NF; i++) print $i}' Dockerfile |
  while read -r source; do cp -r "$source" "$context/"; done
# Online: `--offline` needs every crate of the lock file for every target in the local cache,
# and a build for this machine never downloads the wasm-only ones (web-time), so a fresh cache
# lacks them. Crates already cached are not downloaded again.
(cd "$context" && cargo fetch --locked --quiet) ||
  { echo "the Dockerfile's build stage does not copy a buildable project" >&2; exit 1; }
rm -rf "$context"
awk '/^COPY / && !/--from/ {print $2}' Dockerfile | while read -r source; do
  [ -e "$source" ] || { echo "Dockerfile copies $source, which does not exist" >&2; exit 1; }
done

echo "== promtool" >&2
promtool check rules deploy/prometheus/alerts.yml
# Also checks the rule files the config names.
promtool check config deploy/prometheus/prometheus.yml

echo "== Kubernetes manifests" >&2
manifests=(deploy/kubernetes/*.yaml)
"$tools/bin/kubernetes-validate" --strict --quiet "${manifests[@]}"
"$tools/bin/python" scripts/check_monitors.py "${manifests[@]}"

echo "== compose file" >&2
"$tools/bin/check-jsonschema" --builtin-schema vendor.compose-spec deploy/docker-compose.yaml

echo "== Grafana dashboard" >&2
"$tools/bin/python" -m json.tool deploy/grafana/sluice-dashboard.json >/dev/null

echo "== sluice policies" >&2
policies=$(mktemp -d)
trap 'rm -rf "$policies"' EXIT
# With the key files the policies name beside them (public-api.yaml's JWK set).
cp config/*.yaml config/*.jwks.json deploy/sluice.container.yaml "$policies/"
# And the files the book's examples name (its JWT example's keys).
cp -r docs/fixtures/. "$policies/"
# The policies inside the ConfigMaps, and the complete examples of the book and the README
# (a ```yaml block with top-level `listen:` and `routes:`, not marked `yaml,refused`), each
# written out as a file of its own. scripts/book.sh runs `sluice check` on every example too;
# here they also meet the JSON Schema.
"$tools/bin/python" - "$policies" "${manifests[@]}" <<'PY'
import glob, os, re, sys, yaml
out, paths = sys.argv[1], sys.argv[2:]
complete = []
for source in ["README.md"] + sorted(glob.glob("docs/src/**/*.md", recursive=True)):
    with open(source) as f:
        blocks = re.findall(r"^```yaml\n(.*?)^```", f.read(), re.S | re.M)
    complete += [(source, b) for b in blocks
                 if re.search(r"^listen:", b, re.M) and re.search(r"^routes:", b, re.M)]
if not complete:
    sys.exit("no complete policy example found in README.md or docs/src")
for n, (source, text) in enumerate(complete, 1):
    name = re.sub(r"[^A-Za-z0-9]+", "-", source)
    with open(os.path.join(out, f"{name}-{n}.yaml"), "w") as g:
        g.write(text)
for path in paths:
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if doc and doc.get("kind") == "ConfigMap":
                for key, text in doc.get("data", {}).items():
                    if key.endswith((".yaml", ".yml")):
                        name = f"{os.path.basename(path)}-{doc['metadata']['name']}-{key}"
                        with open(os.path.join(out, name), "w") as g:
                            g.write(text)
PY
cargo build --locked --quiet
# envoyproxy/ratelimit rule files (a top-level `domain:`, docs/fixtures/ratelimit.yaml) sit
# beside the policies that name them; they are no sluice policy: `sluice check` reads them
# through those policies' `rls.config`.
mapfile -t checked < <(grep -L '^domain:' "$policies"/*.yaml)
for policy in "${checked[@]}"; do
  # config/tls.yaml names certificate files that exist only when generated: tests/it/tls.rs
  # runs `sluice check` on it next to a certificate made at test time.
  if [ "$(basename "$policy")" = tls.yaml ]; then continue; fi
  target/debug/sluice check --config "$policy" >/dev/null \
    || { echo "sluice check failed for $(basename "$policy")" >&2; exit 1; }
done
"$tools/bin/check-jsonschema" --schemafile config/sluice.schema.json "${checked[@]}"

# The schema is not vacuous: policies `sluice check` refuses, the schema refuses too.
bad=$policies/bad
mkdir "$bad"
head='listen: 127.0.0.1:8080
admin_listen: 127.0.0.1:9090
routes:
  - name: api
    match: { path_prefix: /api }
    respond: { status: 200 }'
printf '%s\n    limts: []\n' "$head" >"$bad/unknown-field.yaml"
printf '%s\n    limits: [{ name: x, key: [client_ip], requests: 5, window: 60 }]\n' "$head" \
  >"$bad/window-without-unit.yaml"
printf '%s\n    limits: [{ name: x, key: [jwt], requests: 5, window: 1m }]\n' "$head" \
  >"$bad/unknown-key-part.yaml"
printf '%s\n    limits: [{ name: "a b", key: [client_ip], requests: 0, window: 1m }]\n' "$head" \
  >"$bad/bad-name-and-count.yaml"
sed 's/path_prefix: \/api/path_prefix: api/' <<<"$head" >"$bad/relative-prefix.yaml"
sed 's/respond: { status: 200 }/respond: { status: 200 }\n    match_methods: [GET]/' <<<"$head" \
  >"$bad/unknown-route-field.yaml"
for policy in "$bad"/*.yaml; do
  if target/debug/sluice check --config "$policy" >/dev/null 2>&1; then
    echo "sluice check accepted $(basename "$policy"), which is meant to be invalid" >&2; exit 1
  fi
  if "$tools/bin/check-jsonschema" --schemafile config/sluice.schema.json "$policy" >/dev/null; then
    echo "config/sluice.schema.json accepts $(basename "$policy"), which sluice check refuses" >&2
    exit 1
  fi
done
echo "deploy kit: all checks passed" >&2
