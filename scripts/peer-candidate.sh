#!/usr/bin/env bash
# The rnbd full path as one NBD server process: rnbd-server exporting FILE,
# rnbd-client mapping it over RTRS/TCP on loopback and serving it on the
# NBD socket SOCK, for an NBD client (fio's nbd engine, nbdinfo, qemu-io)
# to measure or profile by hand. Runs in the foreground until SIGTERM or
# SIGINT, then stops both daemons.
# make bench-peers (tools/benchpeers) starts the same pair itself.
#   make build && scripts/peer-candidate.sh FILE SOCK
set -euo pipefail
file=$1 sock=$2
bin=$(cd "$(dirname "$0")/../bin" && pwd)
dir=$(mktemp -d /tmp/rnbd-peer-XXXXXX)
port=$((20000 + RANDOM % 20000))
# RNBD_PROFILE_DIR=dir: each daemon writes a CPU profile there until it stops.
prof() { [ -n "${RNBD_PROFILE_DIR:-}" ] && echo "RNBD_CPUPROFILE=$RNBD_PROFILE_DIR/$1.prof" || true; }
env $(prof server) "$bin/rnbd-server" daemon --config /dev/null --listen "tcp://127.0.0.1:$port" \
	--control-socket "$dir/s.sock" --state-file "$dir/s.json" --log-level warn ${RNBD_SERVER_ARGS:-} &
spid=$!
env $(prof client) "$bin/rnbd-client" daemon --config /dev/null --control-socket "$dir/c.sock" \
	--state-file "$dir/c.json" --socket-dir "$dir" --log-level warn ${RNBD_CLIENT_ARGS:-} &
cpid=$!
trap 'kill $cpid 2>/dev/null; wait $cpid 2>/dev/null; kill $spid 2>/dev/null; wait $spid 2>/dev/null; rm -rf "$dir"' EXIT
trap 'exit 0' TERM INT
for _ in $(seq 100); do [ -S "$dir/s.sock" ] && [ -S "$dir/c.sock" ] && break; sleep 0.05; done
"$bin/rnbd-server" --socket "$dir/s.sock" map bench "$file" >/dev/null
"$bin/rnbd-client" --socket "$dir/c.sock" map --sessname peer --path ip:127.0.0.1 --dest-port "$port" \
	--device-path bench --as "socket:$sock" >/dev/null 2>&1
wait $cpid
