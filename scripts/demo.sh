#!/usr/bin/env bash
# The quick start's main job, on one machine: rnbd-server exporting a
# sparse file, rnbd-client mapping it over RTRS/TCP on loopback (as
# /dev/nbdN where the kernel has nbd, else as an NBD unix socket), and a
# short verified IO through the mapping. The daemons keep running; the
# script prints where the device is and how to unmap it and stop them.
#   DEMO_DIR=dir   where sockets, state and the sparse file go (default /tmp/rnbd-demo)
#   DEMO_STOP=1    unmap and stop the daemons at the end (used by the tests)
#   RNBD_BIN=dir   where the binaries are (default bin/)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${RNBD_BIN:-$PWD/bin}
dir=${DEMO_DIR:-/tmp/rnbd-demo}
port=${PORT:-$((21000 + RANDOM % 20000))}
say() { printf 'demo: %s\n' "$*"; }
die() { printf 'demo: %s\n' "$*" >&2; exit 1; }

if [ -s "$dir/pids" ]; then
	for p in $(cat "$dir/pids"); do
		kill -0 "$p" 2>/dev/null && die "a demo is already running (pids $(tr '\n' ' ' <"$dir/pids")); stop it first: kill $(tr '\n' ' ' <"$dir/pids")"
	done
fi
mkdir -p "$dir"
rm -f "$dir"/*.sock "$dir"/*.json "$dir/pids"

# The server, on a random port unless PORT names one: a port another
# program holds (an ephemeral port of some connection) is tried again
# with another, five times at most.
touch "$dir/server.log"
for try in 1 2 3 4 5; do
	logged=$(stat -c %s "$dir/server.log")
	"$bin/rnbd-server" daemon --config /dev/null --listen "tcp://127.0.0.1:$port" \
		--control-socket "$dir/server.sock" --state-file "$dir/server.json" --log-level warn \
		>>"$dir/server.log" 2>&1 &
	spid=$!
	for _ in $(seq 100); do
		{ [ -S "$dir/server.sock" ] || ! kill -0 $spid 2>/dev/null; } && break
		sleep 0.1
	done
	if [ -z "${PORT:-}" ] && [ "$try" -lt 5 ] && ! kill -0 $spid 2>/dev/null &&
		tail -c +$((logged + 1)) "$dir/server.log" | grep -q 'address already in use'; then
		port=$((21000 + RANDOM % 20000))
		continue
	fi
	break
done
echo $spid >>"$dir/pids"
"$bin/rnbd-client" daemon --config /dev/null --control-socket "$dir/client.sock" \
	--state-file "$dir/client.json" --socket-dir "$dir" --log-level warn \
	>>"$dir/client.log" 2>&1 &
echo $! >>"$dir/pids"
stop() { # SIGTERM the daemons this script started, wait up to 10 s for them
	local pids p
	pids=$(cat "$dir/pids")
	kill $pids 2>/dev/null || true
	for p in $pids; do
		for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
	done
	rm -f "$dir/pids"
}
trap 'stop' ERR
for _ in $(seq 100); do
	[ -S "$dir/server.sock" ] && [ -S "$dir/client.sock" ] && break
	sleep 0.1
done
[ -S "$dir/server.sock" ] && [ -S "$dir/client.sock" ] || die "the daemons did not start: see $dir/server.log and $dir/client.log"
say "rnbd-server on tcp://127.0.0.1:$port, rnbd-client running (logs in $dir)"

truncate -s 1G "$dir/disk0.img"
"$bin/rnbd-server" --socket "$dir/server.sock" map demo0 "$dir/disk0.img" >/dev/null
say "exported $dir/disk0.img (1 GiB, sparse) as demo0"

as=socket:$dir/demo0.sock
if [ -e /sys/module/nbd ] || modprobe nbd 2>/dev/null; then
	as=nbd
fi
cli=("$bin/rnbd-client" --socket "$dir/client.sock")
out=$("${cli[@]}" map --sessname demo --path ip:127.0.0.1 --dest-port "$port" \
	--device-path demo0 --access-mode rw --as "$as" 2>/dev/null) || die "map failed: $("${cli[@]}" device list 2>&1)"
# "NAME mapped: URI" for a socket, "NAME mapped: /dev/nbdN" for the kernel.
read -r name _ where <<<"$out"
say "mapped demo0 as $name: $where"

# A short verified IO: 4 MiB of random data at 1 MiB, read back and compared.
case $where in
/dev/*)
	dev=$where
	head -c $((4 << 20)) /dev/urandom >"$dir/pattern"
	dd if="$dir/pattern" of="$dev" bs=1M seek=1 oflag=direct status=none
	cmp <(dd if="$dev" bs=1M skip=1 count=4 iflag=direct status=none) "$dir/pattern" ||
		die "the data read back from $dev differs from what was written"
	rm -f "$dir/pattern"
	;;
*)
	uri=$where
	command -v qemu-io >/dev/null || die "qemu-io (Debian: qemu-utils) is needed to check the mapping"
	qemu-io -f raw -c "write -P 0xa5 1M 4M" "$uri" >/dev/null
	res=$(qemu-io -f raw -r -c "read -P 0xa5 1M 4M" "$uri" 2>&1) || die "read back through $uri: $res"
	case $res in *failed*) die "read back through $uri: $res" ;; esac
	;;
esac
say "wrote 4 MiB through the mapping, read it back: identical"

if [ "${DEMO_STOP:-0}" = 1 ]; then
	"${cli[@]}" unmap "$name" >/dev/null
	stop
	say "unmapped and stopped"
	exit 0
fi
cat <<MSG

The device $name is at $where
  (an NBD URI serves qemu-io -f raw, qemu-img, nbdinfo, nbdcopy and fio --ioengine=nbd)
List:   ${cli[*]} device list
Unmap:  ${cli[*]} unmap $name
Stop the daemons:  kill $(tr '\n' ' ' <"$dir/pids")
MSG
