#!/usr/bin/env bash
# Build a ClickHouse container image from the clickhouse-server installed on this host and
# import it into the local container engine. Nothing is pulled from any registry: the image
# holds the server binary, the shared libraries `ldd` lists for it, the zoneinfo database and
# the minimal config from docker/clickhouse/ (listening on 0.0.0.0, native port 9000, HTTP 8123).
#
# Usage: docker/build-local-image.sh [IMAGE]
#   IMAGE                 image name (default: dmi-clickhouse-local:<installed package version>)
#   DMI_CONTAINER_ENGINE  engine command line (default: docker; e.g. "podman --root R --runroot RR")
#   DMI_CLICKHOUSE_SERVER_BIN  the binary to package (default: clickhouse-server on PATH, /usr/sbin)
# Prints the image name on the last line of stdout.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "build-local-image: $*" >&2; exit 1; }

binary=${DMI_CLICKHOUSE_SERVER_BIN:-$(PATH="$PATH:/usr/sbin:/usr/local/sbin" command -v clickhouse-server || true)}
[ -n "$binary" ] && [ -x "$binary" ] ||
    fail "no clickhouse-server binary found (PATH, /usr/sbin, /usr/local/sbin); install it (Debian: apt-get install clickhouse-server) or set DMI_CLICKHOUSE_SERVER_BIN"
binary=$(readlink -f "$binary")

version=$(dpkg-query -W -f '${Version}' clickhouse-server 2>/dev/null | sed 's/[+~-].*//' || true)
image=${1:-dmi-clickhouse-local:${version:-unknown}}
read -ra engine <<<"${DMI_CONTAINER_ENGINE:-docker}"
command -v "${engine[0]}" >/dev/null || fail "container engine '${engine[0]}' is not installed (set DMI_CONTAINER_ENGINE)"

rootfs=$(mktemp -d /tmp/dmi-clickhouse-rootfs.XXXXXX)
chmod 0755 "$rootfs"
trap 'rm -rf "$rootfs"' EXIT

# The binary and every library the dynamic linker resolves for it (plus the linker itself).
ldd_out=$(ldd "$binary") || fail "ldd $binary failed: $ldd_out"
if grep -q 'not found' <<<"$ldd_out"; then
    fail "libraries of $binary are missing on this host: $(grep 'not found' <<<"$ldd_out" | tr -s ' \t' ' ')"
fi
install -D -m 0755 "$binary" "$rootfs/usr/bin/clickhouse-server"
for lib in $(awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' <<<"$ldd_out" | sort -u); do
    install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
done

# Time zones: ClickHouse resolves its <timezone> (UTC) through the zoneinfo database.
[ -d /usr/share/zoneinfo ] || fail "/usr/share/zoneinfo is missing (Debian: apt-get install tzdata)"
mkdir -p "$rootfs/usr/share" "$rootfs/etc"
cp -a /usr/share/zoneinfo "$rootfs/usr/share/"
ln -s /usr/share/zoneinfo/Etc/UTC "$rootfs/etc/localtime"

# Minimal config, same files the local-binary path of the test fixtures renders.
data=/var/lib/clickhouse
mkdir -p "$rootfs/etc/clickhouse-server" "$rootfs/tmp"
chmod 1777 "$rootfs/tmp"
for sub in log data tmp user_files format_schemas; do mkdir -p "$rootfs$data/$sub"; done
sed -e "s|@DIR@|$data|g" -e 's|@TCP_PORT@|9000|g' -e 's|@HTTP_PORT@|8123|g' -e 's|@LISTEN_HOST@|0.0.0.0|g' \
    "$here/clickhouse/config.xml" >"$rootfs/etc/clickhouse-server/config.xml"
# The default user's password comes from CLICKHOUSE_PASSWORD (empty unless set), as in the
# official image, so a test container need not be a passwordless server on a published port.
grep -q '<password></password>' "$here/clickhouse/users.xml" ||
    fail "docker/clickhouse/users.xml no longer has the empty <password></password> this script replaces"
sed -e 's|<password></password>|<password from_env="CLICKHOUSE_PASSWORD"/>|' \
    "$here/clickhouse/users.xml" >"$rootfs/etc/clickhouse-server/users.xml"
printf 'root:x:0:0:root:/root:/nonexistent\n' >"$rootfs/etc/passwd"
printf 'root:x:0:\n' >"$rootfs/etc/group"

tar -C "$rootfs" -c . | "${engine[@]}" import \
    --change 'CMD ["/usr/bin/clickhouse-server", "--config-file=/etc/clickhouse-server/config.xml"]' \
    --change "WORKDIR $data" \
    --change 'ENV CLICKHOUSE_PASSWORD=' \
    --change 'EXPOSE 9000' --change 'EXPOSE 8123' \
    - "$image" >/dev/null || fail "'${engine[*]} import' of the rootfs failed"
echo "$image"
