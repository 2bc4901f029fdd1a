#!/usr/bin/env bash
# Builds the container image's final stage here, without the registries the Dockerfile pulls
# from, and checks what a container user relies on, from the image itself:
#   1. the release binary (`cargo build --release --locked`: a no-op when CI has built it);
#   2. an OCI image built with buildah from `scratch`: the Dockerfile's final-stage COPY lines
#      applied as written (the build stage's /src/target/release/* is our target/release/*,
#      stripped as the build stage strips it), plus what the distroless cc base holds for this
#      binary: the libraries `ldd` names and the loader, Debian's CA certificates, /etc/passwd
#      and /etc/group with `nonroot` (65532), /etc/nsswitch.conf, /home/nonroot (the working
#      directory) and a world-writable /tmp. USER, EXPOSE, ENTRYPOINT and CMD are read from
#      the Dockerfile, so the two cannot drift;
#   3. the image is written as an OCI layout (`buildah push ... oci:`), and its config blob
#      must say what the Dockerfile says (user, ports, entrypoint, command);
#   4. its layers are unpacked into a root filesystem, where: the user is 65532 in
#      /etc/passwd; the config file the command names exists, listens on 0.0.0.0 on exposed
#      ports, and `sluice check` accepts it run as 65532:65532 under chroot; then, with a test
#      policy in its place (loopback addresses, a route limited to N requests in front of an
#      upstream this script runs), the image's own entrypoint and command run as 65532:65532
#      from that root: N requests get 200, the next 429, the upstream saw exactly N, /healthz
#      and /readyz answer, and SIGTERM makes it exit 0 within the policy's shutdown grace.
# Not a container: no namespaces, cgroups, seccomp or capability drops (starting one is refused
# in this sandbox: crun cannot set rlimits or cgroups), and the distroless base is not pulled.
# Needs root (buildah's storage, chroot; re-runs itself with sudo otherwise); installs buildah,
# binutils (strip), jq and curl with apt-get when missing. About 2-3 s once those are installed.
# Keeps its buildah storage in target/image-check and removes it when done.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

# shellcheck source=scripts/install.sh
source scripts/install.sh

fail() { echo "check-image: $*" >&2; exit 1; }

# The binary first, as the invoking user (CI's soak and bench reuse it).
echo "== release binary" >&2
if [ -z "${CHECK_IMAGE_AS_ROOT:-}" ]; then cargo build --release --locked --quiet; fi
if [ "$(id -u)" -ne 0 ]; then
  export CHECK_IMAGE_AS_ROOT=1
  # buildah's storage and chroot need root; the rest of the script runs under sudo.
  exec sudo -E bash "$repo/scripts/check-image.sh" "$@"
fi

install_if_missing buildah buildah
install_if_missing strip binutils
install_if_missing jq jq
install_if_missing curl curl
[ -s /etc/ssl/certs/ca-certificates.crt ] || install_if_missing update-ca-certificates ca-certificates

work=$(realpath "$(mktemp -d)")
storage=$repo/target/image-check
buildah=(buildah --root "$storage/root" --runroot "$storage/run" --storage-driver vfs)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  "${buildah[@]}" rm --all >/dev/null 2>&1 || true
  rm -rf "$work" "$storage"
}
trap cleanup EXIT

# --- The Dockerfile's final stage, as data -------------------------------------------------
echo "== Dockerfile final stage" >&2
python3 - Dockerfile >"$work/stage.json" <<'PY'
import json, sys
lines, joined = [], ""
for raw in open(sys.argv[1]):
    line = raw.rstrip("\n")
    if line.lstrip().startswith("#"):
        continue
    if line.endswith("\\"):
        joined += line[:-1] + " "
        continue
    lines.append(joined + line)
    joined = ""
stage = None
for line in lines:
    words = line.split()
    if not words:
        continue
    op, rest = words[0].upper(), line.split(None, 1)[1] if len(words) > 1 else ""
    if op == "FROM":
        stage = {"from": words[1], "copies": [], "expose": []}
    elif op == "COPY":
        args = words[1:]
        source_stage = None
        while args and args[0].startswith("--"):
            if args[0].startswith("--from="):
                source_stage = args[0][len("--from="):]
            args = args[1:]
        stage["copies"].append({"from": source_stage, "sources": args[:-1], "dest": args[-1]})
    elif op == "USER":
        stage["user"] = rest.strip()
    elif op == "EXPOSE":
        # Docker's default protocol is tcp, and its image config names it.
        stage["expose"] += [p if "/" in p else p + "/tcp" for p in words[1:]]
    elif op in ("ENTRYPOINT", "CMD"):
        # The exec form only: the shell form runs /bin/sh, which the distroless base lacks.
        try:
            stage[op.lower()] = json.loads(rest)
        except json.JSONDecodeError:
            sys.exit(f"{op} {rest}: the shell form needs /bin/sh, which the image lacks; use a JSON array")
    elif op in ("WORKDIR", "ENV", "RUN", "VOLUME", "LABEL", "ARG", "HEALTHCHECK", "STOPSIGNAL"):
        stage.setdefault("unhandled", []).append(op)
for key in ("user", "entrypoint", "cmd"):
    if key not in stage:
        sys.exit(f"the Dockerfile's final stage has no {key.upper()}")
if stage.get("unhandled"):
    sys.exit(f"the final stage uses {stage['unhandled']}, which scripts/check-image.sh does not apply")
print(json.dumps(stage))
PY
jq -c . "$work/stage.json" >&2
user=$(jq -r .user "$work/stage.json")
uid=${user%%:*}
gid=${user#*:}
case "$uid" in '' | *[!0-9]*) fail "USER $user is not numeric (Kubernetes' runAsNonRoot needs a uid)" ;; esac
[ "$uid" -ne 0 ] || fail "USER is root"
mapfile -t entrypoint < <(jq -r '.entrypoint[]' "$work/stage.json")
mapfile -t cmd < <(jq -r '.cmd[]' "$work/stage.json")
# The config path is the value after --config in CMD.
config_path=$(jq -r '.cmd as $c | ($c | index("--config")) as $i | if $i then $c[$i + 1] else empty end' \
  "$work/stage.json")
[ -n "$config_path" ] || fail "CMD names no --config"

# --- The image ----------------------------------------------------------------------------
echo "== buildah: image from scratch" >&2
started=$(date +%s.%N)
container=$("${buildah[@]}" from scratch)
rootfs=$("${buildah[@]}" mount "$container")
# The final stage's COPY lines, as written.
while read -r copy; do
  source_stage=$(jq -r '.from // empty' <<<"$copy")
  dest=$(jq -r .dest <<<"$copy")
  mapfile -t sources < <(jq -r '.sources[]' <<<"$copy")
  for source in "${sources[@]}"; do
    if [ -n "$source_stage" ]; then
      [ "$source_stage" = build ] || fail "COPY --from=$source_stage: only the build stage is known"
      # The build stage builds in /src and strips target/release/sluice.
      case "$source" in
        /src/target/release/*) local_file=target/release/${source#/src/target/release/} ;;
        *) fail "COPY --from=build $source: not a release artifact this script can supply" ;;
      esac
      mkdir -p "$rootfs$(dirname "$dest")"
      strip -o "$rootfs$dest" "$local_file"
    else
      mkdir -p "$rootfs$(dirname "$dest")"
      cp "$source" "$rootfs$dest"
    fi
  done
done < <(jq -c '.copies[]' "$work/stage.json")
binary=$rootfs${entrypoint[0]}
[ -x "$binary" ] || fail "the entrypoint ${entrypoint[0]} is not an executable file in the image"

# What distroless/cc-debian12:nonroot provides for this binary. Its libraries, at the paths
# `ldd` resolves them to (the loader at the path the binary's PT_INTERP names).
# (A static binary has none: ldd then says so and fails.)
{ ldd "$binary" || true; } | awk '/=> \// {print $3} /^\t\// {print $1}' | while read -r lib; do
  mkdir -p "$rootfs$(dirname "$lib")"
  cp -L "$lib" "$rootfs$lib"
done
mkdir -p "$rootfs/etc/ssl/certs" "$rootfs/home/nonroot" "$rootfs/tmp"
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
cat >"$rootfs/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
EOF
cat >"$rootfs/etc/group" <<'EOF'
root:x:0:
nobody:x:65534:
nonroot:x:65532:
EOF
# Names from files first, then DNS, as Debian's default (a runtime mounts /etc/hosts and
# /etc/resolv.conf into a container).
printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
chown 65532:65532 "$rootfs/home/nonroot"
chmod 1777 "$rootfs/tmp"
"${buildah[@]}" umount "$container" >/dev/null

ports=()
while read -r port; do ports+=(--port "$port"); done < <(jq -r '.expose[]' "$work/stage.json")
"${buildah[@]}" config --user "$user" "${ports[@]}" \
  --entrypoint "$(jq -c .entrypoint "$work/stage.json")" --cmd "$(jq -c .cmd "$work/stage.json")" \
  --workingdir /home/nonroot \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
  "$container"
"${buildah[@]}" commit --quiet "$container" localhost/sluice:check >/dev/null
"${buildah[@]}" push --quiet localhost/sluice:check "oci:$work/oci:sluice" >/dev/null
awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN {printf "   built and written as an OCI layout in %.1f s\n", b - a}' >&2

# --- The image's config, read from the OCI layout -----------------------------------------
echo "== image config against the Dockerfile" >&2
blob() { echo "$work/oci/blobs/${1/://}"; }
manifest=$(blob "$(jq -r '.manifests[0].digest' "$work/oci/index.json")")
config=$(blob "$(jq -r .config.digest "$manifest")")
jq -c '{os, architecture, config}' "$config" >&2
check_field() {
  local name=$1 actual=$2 expected=$3
  [ "$actual" = "$expected" ] || fail "image config $name is $actual; the Dockerfile says $expected"
}
check_field User "$(jq -c .config.User "$config")" "$(jq -c .user "$work/stage.json")"
check_field Entrypoint "$(jq -c .config.Entrypoint "$config")" "$(jq -c .entrypoint "$work/stage.json")"
check_field Cmd "$(jq -c .config.Cmd "$config")" "$(jq -c .cmd "$work/stage.json")"
check_field ExposedPorts "$(jq -c '.config.ExposedPorts | keys | sort' "$config")" \
  "$(jq -c '.expose | sort' "$work/stage.json")"
check_field os "$(jq -r .os "$config")" linux

# --- Its root filesystem -------------------------------------------------------------------
echo "== root filesystem from the image's layers" >&2
root=$work/rootfs
mkdir "$root"
while read -r layer; do tar -xf "$(blob "$layer")" -C "$root"; done < <(jq -r '.layers[].digest' "$manifest")
name=$(awk -F: -v uid="$uid" '$3 == uid {print $1}' "$root/etc/passwd")
[ -n "$name" ] || fail "uid $uid has no entry in the image's /etc/passwd"
awk -F: -v gid="$gid" '$3 == gid {found = 1} END {exit !found}' "$root/etc/group" ||
  fail "gid $gid has no entry in the image's /etc/group"
echo "   user $uid:$gid is $name in the image's /etc/passwd" >&2
[ -f "$root$config_path" ] || fail "the config path $config_path is not a file in the image"
# The baked policy listens where a container is reached: on every address, on the ports the
# image exposes.
for field in listen admin_listen; do
  address=$(awk -v f="$field:" '$1 == f {print $2}' "$root$config_path")
  case "$address" in
    0.0.0.0:* | "[::]:"*) ;;
    *) fail "the image's $config_path has $field: ${address:-nothing}, not 0.0.0.0 or [::]" ;;
  esac
  jq -e --arg p "${address##*:}/tcp" '.expose | index($p)' "$work/stage.json" >/dev/null ||
    fail "the image's $config_path has $field: $address, a port the Dockerfile does not EXPOSE"
done
as_user=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/home/nonroot
  chroot --userspec="$uid:$gid" "$root")
# The policy baked into the image, read by the image's binary as the image's user.
"${as_user[@]}" "${entrypoint[@]}" check --config "$config_path" >&2 ||
  fail "sluice check refuses the image's own $config_path, run as $uid:$gid in the image"

echo "== the image's command, as $uid:$gid, from its root filesystem" >&2
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
listen_port=$(free_port)
admin_port=$(free_port)
upstream_port=$(free_port)
limit=3
grace=5
python3 -m http.server --bind 127.0.0.1 "$upstream_port" --directory "$work" 2>>"$work/upstream.log" >/dev/null &
pids+=($!)
for _ in $(seq 100); do
  curl -fsS -o /dev/null "http://127.0.0.1:$upstream_port/" 2>/dev/null && break
  sleep 0.1
done
# The upstream's log counts from here: the request above was ours, not sluice's.
: >"$work/upstream.log"
# The test policy replaces the image's, as a user mounts theirs over it. A container listens
# on 0.0.0.0; here, with no network namespace, it listens on loopback on free ports instead.
cat >"$root$config_path" <<EOF
listen: 127.0.0.1:$listen_port
admin_listen: 127.0.0.1:$admin_port
admin: { api: false }
server: { shutdown_grace: ${grace}s }
upstreams:
  up: { url: "http://127.0.0.1:$upstream_port" }
routes:
  - name: limited
    match: { path_prefix: / }
    upstream: up
    limits:
      - { name: per-ip, key: [client_ip], requests: $limit, window: 1m }
EOF
chmod 0644 "$root$config_path"
"${as_user[@]}" "${entrypoint[@]}" "${cmd[@]}" 2>"$work/sluice.log" &
sluice=$!
pids+=("$sluice")
for _ in $(seq 100); do
  curl -fsS -o /dev/null "http://127.0.0.1:$admin_port/readyz" 2>/dev/null && break
  kill -0 "$sluice" 2>/dev/null || { cat "$work/sluice.log" >&2; fail "sluice exited at start"; }
  sleep 0.1
done
curl -fsS -o /dev/null "http://127.0.0.1:$admin_port/readyz" ||
  { cat "$work/sluice.log" >&2; fail "/readyz did not answer 200 within 10 s"; }
# The process is the image's binary, in the image's root, as the image's user.
[ "$(readlink "/proc/$sluice/root")" = "$root" ] || fail "sluice's root is not the image's root filesystem"
[ "$(readlink "/proc/$sluice/exe")" = "$root${entrypoint[0]}" ] ||
  fail "the running program is $(readlink "/proc/$sluice/exe"), not the image's ${entrypoint[0]}"
read -r _ ruid euid _ < <(grep '^Uid:' "/proc/$sluice/status")
read -r _ rgid egid _ < <(grep '^Gid:' "/proc/$sluice/status")
[ "$ruid:$euid:$rgid:$egid" = "$uid:$uid:$gid:$gid" ] ||
  fail "sluice runs as uid $ruid/$euid gid $rgid/$egid, not $uid:$gid"
health=$(curl -sS -o /dev/null -w '%{http_code}' "http://127.0.0.1:$admin_port/healthz")
[ "$health" = 200 ] || fail "/healthz answered $health"
codes=()
for _ in $(seq $((limit + 1))); do
  codes+=("$(curl -sS -o /dev/null -w '%{http_code}' "http://127.0.0.1:$listen_port/")")
done
expected="$(printf '200 %.0s' $(seq "$limit"))429"
[ "${codes[*]}" = "$expected" ] || {
  tail -n 5 "$work/sluice.log" "$work/upstream.log" >&2
  fail "answers were ${codes[*]}, expected $expected"
}
seen=$(grep -c '"GET / HTTP/1.1"' "$work/upstream.log" || true)
[ "$seen" -eq "$limit" ] || fail "the upstream received $seen requests, expected $limit"
echo "   answers ${codes[*]}; the upstream received $seen; /readyz and /healthz 200" >&2
signalled=$(date +%s.%N)
kill -TERM "$sluice"
status=0
# `wait` returns when it exits; the grace bounds how long that may take.
( sleep $((grace + 1)); kill -KILL "$sluice" 2>/dev/null ) &
watchdog=$!
wait "$sluice" || status=$?
kill "$watchdog" 2>/dev/null || true
took=$(awk -v a="$signalled" -v b="$(date +%s.%N)" 'BEGIN {print b - a}')
[ "$status" -eq 0 ] || { cat "$work/sluice.log" >&2; fail "sluice exited $status after SIGTERM"; }
awk -v t="$took" -v g="$grace" 'BEGIN {exit !(t <= g)}' ||
  fail "sluice took ${took}s to exit after SIGTERM, more than its ${grace}s grace"
printf '   SIGTERM: exit 0 after %.2f s (grace %d s)\n' "$took" "$grace" >&2
echo "image: all checks passed" >&2
