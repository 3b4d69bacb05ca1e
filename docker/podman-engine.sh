#!/usr/bin/env bash
# Podman (from Debian) as the container engine behind a Docker API, on a host that has a docker
# client but no engine and no registry (as root). Each fact below was found on such a host and
# is checked here; when one stops holding the script stops with a message, never falls through.
#
#   docker/podman-engine.sh install          apt-get install podman runc (no recommends)
#   docker/podman-engine.sh start STATE      containers.conf + Docker API socket under STATE;
#                                            writes STATE/env (source it: DOCKER_HOST, ...)
#   docker/podman-engine.sh check STATE IMG  run IMG with a loopback port, wait for /ping
#   docker/podman-engine.sh stop STATE       remove every container, stop the socket, delete STATE
#
# Facts (docs/clickhouse-server.md has the details):
# - crun fails here (cgroup v1 "hybrid mode not supported"), so runtime = runc;
# - runc cannot raise rlimits (setrlimit: Operation not permitted) and podman's defaults are
#   higher than allowed, so default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
#   (the hard limits podman's own processes hold here);
# - storage paths from storage.conf made every run wait 20 s on a conmon timeout, so --root and
#   --runroot go on the command line (DMI_CONTAINER_ENGINE carries them);
# - podman's CNI bridge (containernetworking-plugins + iptables, both podman dependencies)
#   publishes ports on 127.0.0.1; no netavark, slirp4netns or pasta is needed as root;
# - `podman system service` speaks Docker API 1.41 (printed by start); testcontainers needs DOCKER_HOST,
#   TESTCONTAINERS_RYUK_DISABLED=true (Ryuk's image cannot be pulled) and
#   TESTCONTAINERS_CONNECTION_MODE=docker_host (/.dockerenv exists, and podman leaves empty the
#   gateway fields testcontainers would otherwise read).
set -euo pipefail

fail() { echo "podman-engine: $*" >&2; exit 1; }
need_state() { [ -n "${1:-}" ] || fail "usage: $0 ${cmd} STATE_DIR"; }
engine() { podman --root "$state/root" --runroot "$state/runroot" "$@"; }

cmd=${1:-}
case "$cmd" in
install)
    [ "$(id -u)" = 0 ] || fail "install needs root (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends podman runc >/dev/null ||
        fail "apt-get install podman runc failed"
    ;;
start)
    need_state "${2:-}"
    state=$2
    command -v podman >/dev/null || fail "podman is not installed (run: $0 install)"
    command -v runc >/dev/null || fail "runc is not installed (run: $0 install); crun fails on this kind of host"
    [ "$(id -u)" = 0 ] || fail "this setup is rootful (CNI bridge, iptables); run it as root"
    # runc may lower limits but not raise them: these are what podman's own processes hold here.
    nofile=20000 nproc=32768
    hard_nofile=$(ulimit -Hn)
    [ "$hard_nofile" = unlimited ] || [ "$hard_nofile" -ge "$nofile" ] ||
        fail "hard RLIMIT_NOFILE is $hard_nofile, below the nofile=$nofile containers get; lower it in $0"
    mkdir -p "$state/root" "$state/runroot"
    cat >"$state/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
EOF
    export CONTAINERS_CONF="$state/containers.conf"
    socket="$state/podman.sock"
    # Not through engine(): $! must be podman itself, not a subshell, for stop to end it.
    podman --root "$state/root" --runroot "$state/runroot" system service --time=0 "unix://$socket" \
        >"$state/service.log" 2>&1 &
    echo $! >"$state/service.pid"
    for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.1; done
    [ -S "$socket" ] || fail "podman system service did not create $socket within 10 s: $(cat "$state/service.log")"
    api=$(python3 - "$socket" <<'EOF'
import json, socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sys.argv[1])
    s.sendall(b"GET /version HTTP/1.0\r\nHost: d\r\n\r\n")
    data = b""
    while chunk := s.recv(65536):
        data += chunk
print(json.loads(data.split(b"\r\n\r\n", 1)[1])["ApiVersion"])
EOF
    ) || fail "the socket $socket did not answer GET /version: $(cat "$state/service.log")"
    cat >"$state/env" <<EOF
export CONTAINERS_CONF='$state/containers.conf'
export DMI_CONTAINER_ENGINE='podman --root $state/root --runroot $state/runroot'
export DOCKER_HOST='unix://$socket'
export TESTCONTAINERS_RYUK_DISABLED=true
export TESTCONTAINERS_CONNECTION_MODE=docker_host
EOF
    echo "podman-engine: Docker API $api at unix://$socket (source $state/env)"
    ;;
check)
    need_state "${2:-}"
    state=$2
    image=${3:?usage: $0 check STATE_DIR IMAGE}
    export CONTAINERS_CONF="$state/containers.conf"
    id=$(engine run -d -p 127.0.0.1::8123 "$image" 2>&1) ||
        fail "podman run $image failed (runtime, ulimits or network; see docs/clickhouse-server.md): $id"
    port=$(engine port "$id" 8123/tcp | sed 's/.*://')
    ok=""
    for _ in $(seq 300); do
        if python3 -c "import urllib.request as u, sys; u.urlopen('http://127.0.0.1:$port/ping', timeout=1).close()" 2>/dev/null
        then ok=1; break; fi
        sleep 0.1
    done
    logs=$(engine logs "$id" 2>&1 | tail -20)
    engine rm -f "$id" >/dev/null
    [ -n "$ok" ] || fail "$image published on 127.0.0.1:$port did not answer /ping within 30 s; its log: $logs"
    echo "podman-engine: $image answers /ping through 127.0.0.1:$port"
    ;;
stop)
    need_state "${2:-}"
    state=$2
    [ -d "$state" ] || exit 0
    export CONTAINERS_CONF="$state/containers.conf"
    if [ -d "$state/root" ]; then
        engine rm -af >/dev/null 2>&1 || echo "podman-engine: could not remove the containers under $state" >&2
    fi
    if [ -f "$state/service.pid" ]; then
        pid=$(cat "$state/service.pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        ! kill -0 "$pid" 2>/dev/null || fail "podman system service (pid $pid) did not stop"
    fi
    # containers/storage leaves its overlay directory mounted; nothing under STATE may stay mounted.
    { grep -o " $state/[^ ]*" /proc/mounts || true; } | sort -r | while read -r mnt; do umount "$mnt" || true; done
    rm -rf "$state" || fail "could not delete $state (still mounted: $(grep -c " $state/" /proc/mounts))"
    ;;
*)
    fail "usage: $0 install | start STATE_DIR | check STATE_DIR IMAGE | stop STATE_DIR"
    ;;
esac
