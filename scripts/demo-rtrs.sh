#!/usr/bin/env bash
# The quick start's main job: an RTRS server and a client in two processes
# exchanging verified IO over TCP on loopback, over two paths (sources
# 127.0.0.1 and 127.0.0.2), then the client's per-path stats.
set -euo pipefail
cd "$(dirname "$0")/.."
port=${PORT:-12345}
tmp=$(mktemp -d)
trap 'kill "$srv" 2>/dev/null || true; wait "$srv" 2>/dev/null || true; rm -rf "$tmp"' EXIT

bin/rtrs-demo server --listen "tcp://127.0.0.1:$port" --hb-interval 1s --ready-file "$tmp/ready" &
srv=$!
for _ in $(seq 100); do
	[ -s "$tmp/ready" ] && break
	kill -0 "$srv" 2>/dev/null || { echo "demo: the server did not start" >&2; exit 1; }
	sleep 0.1
done
[ -s "$tmp/ready" ] || { echo "demo: the server did not come up in 10 s" >&2; exit 1; }

bin/rtrs-demo load --dest-port "$port" \
	--path ip:127.0.0.1@ip:127.0.0.1 --path ip:127.0.0.2@ip:127.0.0.1 \
	--hb-interval 1s --duration "${DURATION:-5s}" --qd 32 --bs 4096 --write-pct 50
