#!/usr/bin/env bash
# The packages under systemd, as on a node: in a Debian 12 container
# booted by systemd-nspawn (systemd as its PID 1; the CI machine's own init
# is not systemd). Installs the first build of both packages, configures
# them as an operator would (the server's address, and the TLS files the
# example configurations name, from scripts/test-ca.sh), starts the
# daemons through their hardened units, exports and maps a device (an NBD
# socket: the container has no nbd module), writes through it; upgrades to
# the second build (both daemons restart on the new binaries, the mapping
# comes back, the data is there); reboots the container (the units start
# at boot, rnbd-client-wait.service before remote-fs-pre.target, the
# mapping restored); removes and purges (the daemons stop).
# On the way: the package made /srv/rnbd (0700); the README's "Serving a
# file" example, run as written, works under the packaged unit; a map
# the unit's sandbox would defeat (a read-write export of a file it sees
# read-only, a file in the host's /var/tmp it cannot see) is refused
# naming the sandbox and the drop-in that allows it, and the drop-in
# does; `dpkg -r` keeps the daemons' state (a reinstall serves the same
# exports and mappings), `dpkg -P` removes it (a reinstall starts empty)
# and leaves /srv/rnbd while it holds files.
#
#   scripts/test-deb-systemd.sh DEBS1 DEBS2
#
# DEBS1 and DEBS2 are directories with the two builds' .debs (test-deb.sh
# makes them). As root; installs systemd-container and debootstrap from
# apt if missing; keeps the container's base tree in NSPAWN_CACHE
# (/var/cache/rnbd-nspawn) for the next run. The container shares the
# host's network (loopback only is used) and nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '== [%(%T)T] systemd: %s\n' -1 "$*" >&2; }
die() {
	log "FAIL: $*"
	if [ -n "${leader:-}" ]; then
		ct journalctl --no-pager -n 60 -u rnbd-server -u rnbd-client -u rnbd-client-wait 2>/dev/null | sed 's/^/   /' >&2 || true
	fi
	exit 1
}
[ "$(id -u)" = 0 ] || die "needs root"
[ $# = 2 ] && [ -d "$1" ] && [ -d "$2" ] || die "usage: $0 DEBS1 DEBS2"
debs1=$(cd "$1" && pwd) debs2=$(cd "$2" && pwd)

need=()
for c in systemd-nspawn:systemd-container debootstrap:debootstrap nsenter:util-linux openssl:openssl; do
	command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
	log "apt-get install ${need[*]}"
	DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
		die "apt-get install ${need[*]}"
fi

# The base tree: Debian 12 with systemd, what the packages depend on, and
# qemu-io to do IO through the mapping.
cache=${NSPAWN_CACHE:-/var/cache/rnbd-nspawn}/bookworm
if [ ! -f "$cache/.complete" ]; then
	mirror=${DEBIAN_MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)}
	[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 ~ /^https?:/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
	[ -n "$mirror" ] || die "no Debian mirror in the apt sources; set DEBIAN_MIRROR"
	log "debootstrap bookworm (once; kept in $cache)"
	rm -rf "$cache.new"
	mkdir -p "$(dirname "$cache")"
	timeout 900 debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,kmod,libibverbs1,librdmacm1,qemu-utils \
		bookworm "$cache.new" "$mirror" >/dev/null || die "debootstrap"
	touch "$cache.new/.complete"
	rm -rf "$cache"
	mv "$cache.new" "$cache"
fi

root=$(mktemp -d /var/tmp/rnbd-nspawn.XXXXXX)
nspid= leader=
stop_container() {
	if [ -n "$nspid" ] && kill -0 "$nspid" 2>/dev/null; then
		kill -TERM "$nspid" 2>/dev/null || true # nspawn powers the container off
		for _ in $(seq 100); do kill -0 "$nspid" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$nspid" 2>/dev/null || true
		wait "$nspid" 2>/dev/null || true
	fi
	nspid= leader=
}
trap 'stop_container; rm -rf "$root" "$root.console"' EXIT
cp -a "$cache/." "$root/"
mkdir -p "$root/opt/rnbd-test/debs1" "$root/opt/rnbd-test/debs2"
# The daemons' packages: rnbd-csi has no unit (test-deb.sh checks it).
cp "$debs1"/rnbd-server_*.deb "$debs1"/rnbd-client_*.deb "$root/opt/rnbd-test/debs1/"
cp "$debs2"/rnbd-server_*.deb "$debs2"/rnbd-client_*.deb "$root/opt/rnbd-test/debs2/"
machine=rnbd-test-$$

# ct CMD...: run CMD inside the booted container.
ct() { nsenter -t "$leader" -a -- "$@"; }

# boot: start the container and wait until its systemd has booted.
boot() {
	systemd-nspawn -D "$root" -b --register=no --keep-unit --machine="$machine" --console=pipe \
		>"$root.console" 2>&1 </dev/null &
	nspid=$!
	for _ in $(seq 300); do
		leader=$(pgrep -P "$nspid" -x systemd || true)
		[ -n "$leader" ] && break
		kill -0 "$nspid" 2>/dev/null || die "systemd-nspawn exited: $(tail -5 "$root.console")"
		sleep 0.1
	done
	[ -n "$leader" ] || die "no systemd in the container"
	# Until its bus is up, systemctl cannot ask; then it waits for the
	# boot to end.
	local st=
	for _ in $(seq 600); do
		st=$(timeout 120 nsenter -t "$leader" -a -- systemctl is-system-running --wait 2>/dev/null || true)
		[ -n "$st" ] && break
		sleep 0.2
	done
	case $st in
	running) ;;
	*) die "the container booted ${st:-nothing}: $(ct systemctl --failed --no-legend --no-pager 2>&1 | tr '\n' ' ')" ;;
	esac
}

# quiet WHAT CMD...: run CMD in the container; its output only if it fails.
quiet() {
	local what=$1 out
	shift
	out=$(ct "$@" 2>&1) || die "$what: $out"
}

# mainpid UNIT: the unit's main process, 0 when it has none.
mainpid() { ct systemctl show -p MainPID --value "$1"; }

# active UNIT...: every unit is active.
active() {
	local u
	for u in "$@"; do
		[ "$(ct systemctl is-active "$u")" = active ] || die "$u is $(ct systemctl is-active "$u")"
	done
}

# mapped: the client's mapping is open (on its server), within 30 s.
mapped() {
	for _ in $(seq 300); do
		ct rnbd-client device list --format csv --fields state 2>/dev/null | grep -qx open && return 0
		sleep 0.1
	done
	die "the mapping did not come back: $(ct rnbd-client device list --fields all 2>&1 | tr '\n' ' ')"
}

# connected: the client's session has its path up, within 30 s.
connected() {
	for _ in $(seq 300); do
		[ "$(ct rnbd-client session list --format csv --fields act_path_cnt 2>/dev/null | tail -n +2)" = 1 ] && return 0
		sleep 0.1
	done
	die "the session did not reconnect: $(ct rnbd-client session list --fields all 2>&1 | tr '\n' ' ')"
}

log "boot"
boot
port=$((20000 + RANDOM % 20000))
uri="nbd+unix:///vol?socket=/run/rnbd/rnbd0.sock"

log "install the first build"
quiet "dpkg -i" sh -c 'dpkg -i /opt/rnbd-test/debs1/*.deb'
for u in rnbd-server.service rnbd-client.service rnbd-client-wait.service; do
	[ "$(ct systemctl is-enabled "$u")" = enabled ] || die "$u is $(ct systemctl is-enabled "$u") after install"
done
[ "$(ct systemctl is-active rnbd-server.service)" = inactive ] || die "a first install started the server before it was configured"
# The operator's part: the server's storage-network address (loopback
# here), the certificates, keys and authority where the example
# configurations' [tls] looks for them (the server's names the address
# the client dials), an export in /srv/rnbd (the unit's writable export
# directory).
ct sed -i "s|^listen = .*|listen = [\"tcp://127.0.0.1:$port\"]|" /etc/rnbd/server.toml
for args in ca "server server 127.0.0.1" "client client"; do
	# shellcheck disable=SC2086 # the words are the arguments
	scripts/test-ca.sh "$root/etc/rnbd/tls" $args >/dev/null || die "test-ca.sh $args"
done
# The package made the data directory the unit may write.
[ "$(ct stat -c %a:%U /srv/rnbd 2>&1)" = 700:root ] || die "/srv/rnbd after install: $(ct stat -c %a:%U /srv/rnbd 2>&1)"
ct truncate -s 64M /srv/rnbd/vol.img
ct systemctl start rnbd-server.service rnbd-client.service || die "systemctl start"
active rnbd-server.service rnbd-client.service
# The example configuration runs TLS: the server says so, and does not
# warn that it trusts whoever reaches it.
for _ in $(seq 50); do
	ct journalctl --no-pager -u rnbd-server.service | grep -q "rnbd-server started.*tls=true" && break
	sleep 0.1
done
ct journalctl --no-pager -u rnbd-server.service | grep -q "rnbd-server started.*tls=true" || die "the packaged server does not run TLS"
! ct journalctl --no-pager -u rnbd-server.service | grep -q "without TLS anyone" || die "the packaged server warns it runs without TLS"
ct rnbd-server map vol /srv/rnbd/vol.img >/dev/null || die "rnbd-server map"
out=$(ct rnbd-client map --sessname ns --path ip:127.0.0.1 --dest-port "$port" --device-path vol 2>&1) || die "rnbd-client map: $out"
grep -qx "rnbd0 mapped: $uri" <<<"$out" || die "rnbd-client map said: $out"
io=$(ct qemu-io -f raw -c "write -P 0x5a 0 1M" "$uri" 2>&1)
[[ $io != *failed* ]] || die "write through the mapping: $io"

log "the README's example, as written"
# The lines of README.md's "Serving a file" block, but the daemon's (the
# unit runs it) and with the packaged binaries for bin/.
example=$(awk '/^Serving a file:/ {f = 1; next} f && /^```sh/ {b = 1; next} b && /^```/ {exit} b' README.md |
	grep -v ' daemon ' | sed 's|^bin/||')
[ -n "$example" ] || die "no \"Serving a file\" example in README.md"
grep -q "rnbd-server map " <<<"$example" || die "the README's example maps nothing: $example"
out=$(ct bash -euo pipefail -c "$example" 2>&1) || die "the README's example under the packaged unit: $out"
name=$(sed -n 's/^rnbd-server map \([^ ]*\) .*/\1/p' <<<"$example" | head -1)
grep -q "\"devname\": *\"$name\"" <<<"$out" || die "the README's example does not list $name: $out"

log "sandbox: what the unit cannot write or see is refused at map, naming the drop-in"
# A file outside /srv/rnbd: read-only to the unit (ProtectSystem=strict).
ct mkdir -p /var/lib/rnbd-images
ct truncate -s 16M /var/lib/rnbd-images/out.img
rc=0
out=$(ct rnbd-server map out /var/lib/rnbd-images/out.img 2>&1) || rc=$?
[ "$rc" = 7 ] || die "a read-write export the unit cannot write: exit $rc (want 7, permission): $out"
for want in "read-only" "ReadWritePaths=/var/lib/rnbd-images" "systemctl edit rnbd-server.service" "--ro"; do
	grep -qF -- "$want" <<<"$out" || die "the refusal does not say \"$want\": $out"
done
ct rnbd-server map out-ro /var/lib/rnbd-images/out.img --ro >/dev/null || die "a read-only export of it was refused"
ct rnbd-server unmap out-ro >/dev/null || die "rnbd-server unmap out-ro"
# A file in the host's /var/tmp: the unit's /var/tmp is its own (PrivateTmp).
ct truncate -s 16M /var/tmp/disk0.img
rc=0
out=$(ct rnbd-server map tmp0 /var/tmp/disk0.img 2>&1) || rc=$?
[ "$rc" = 3 ] || die "an export in the host's /var/tmp: exit $rc (want 3, not found): $out"
for want in "no such file or directory" "PrivateTmp" "/srv/rnbd"; do
	grep -qF -- "$want" <<<"$out" || die "the refusal does not say \"$want\": $out"
done
# The drop-in the refusal names allows it; a client writes to it.
ct mkdir -p /etc/systemd/system/rnbd-server.service.d
printf '[Service]\nReadWritePaths=/var/lib/rnbd-images\n' | ct tee /etc/systemd/system/rnbd-server.service.d/images.conf >/dev/null
ct systemctl daemon-reload
ct systemctl restart rnbd-server.service || die "restart with the drop-in"
active rnbd-server.service
out=$(ct rnbd-server map out /var/lib/rnbd-images/out.img 2>&1) || die "map with the drop-in: $out"
connected
out=$(ct rnbd-client map --sessname ns --path ip:127.0.0.1 --dest-port "$port" --device-path out 2>&1) || die "rnbd-client map out: $out"
outuri=$(sed -n 's/^rnbd[0-9]* mapped: //p' <<<"$out")
io=$(ct qemu-io -f raw -c "write -P 0x3c 0 1M" "$outuri" 2>&1)
[[ $io != *failed* ]] || die "write through the mapping of the export outside /srv/rnbd: $io"
mapped

log "upgrade: the daemons restart on the new binaries"
spid=$(mainpid rnbd-server.service) cpid=$(mainpid rnbd-client.service)
quiet "dpkg -i (upgrade)" sh -c 'dpkg -i --force-confold /opt/rnbd-test/debs2/*.deb'
active rnbd-server.service rnbd-client.service
[ "$(mainpid rnbd-server.service)" != "$spid" ] || die "rnbd-server was not restarted by the upgrade"
[ "$(mainpid rnbd-client.service)" != "$cpid" ] || die "rnbd-client was not restarted by the upgrade"
[ "$(ct dpkg-query -W -f '${Version}' rnbd-client)" = "$(dpkg-deb -f "$debs2"/rnbd-client_*.deb Version)" ] || die "not upgraded"
mapped
io=$(ct qemu-io -f raw -c "read -P 0x5a 0 1M" "$uri" 2>&1)
[[ $io != *failed* ]] || die "read after the upgrade: $io"

log "reboot: the units start at boot, the wait unit before remote-fs-pre.target"
ct systemctl reboot || true
for _ in $(seq 300); do kill -0 "$nspid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$nspid" 2>/dev/null && die "the container did not go down for its reboot"
wait "$nspid" 2>/dev/null || true
boot
active rnbd-server.service rnbd-client.service rnbd-client-wait.service remote-fs-pre.target
waited=$(ct systemctl show -p ExecMainExitTimestampMonotonic --value rnbd-client-wait.service)
pre=$(ct systemctl show -p ActiveEnterTimestampMonotonic --value remote-fs-pre.target)
[ "$waited" -gt 0 ] && [ "$waited" -le "$pre" ] || die "rnbd-client-wait ended at $waited, remote-fs-pre.target was reached at $pre"
[ "$(ct systemctl show -p Result --value rnbd-client-wait.service)" = success ] || die "rnbd-client-wait.service did not succeed"
mapped
io=$(ct qemu-io -f raw -c "read -P 0x5a 0 1M" "$uri" 2>&1)
[[ $io != *failed* ]] || die "read after the reboot: $io"

log "remove: the daemons stop, their state stays"
quiet "dpkg -r" dpkg -r rnbd-client rnbd-server
stopped() {
	local u st
	for u in rnbd-server.service rnbd-client.service; do
		st=$(ct systemctl is-active "$u" || true)
		[ "$st" = inactive ] || die "$u is $st after $1"
	done
}
stopped remove
for f in /var/lib/rnbd/server.json /var/lib/rnbd/client.json /srv/rnbd/vol.img; do
	ct test -f "$f" || die "dpkg -r took $f (only purge may)"
done

log "reinstall after remove: the same exports and mappings"
quiet "dpkg -i (reinstall)" sh -c 'dpkg -i /opt/rnbd-test/debs2/*.deb'
ct systemctl start rnbd-server.service rnbd-client.service || die "systemctl start after the reinstall"
active rnbd-server.service rnbd-client.service
exports=$(ct rnbd-server device list --format csv --fields devname 2>&1) || die "rnbd-server device list: $exports"
exports=$(tail -n +2 <<<"$exports" | sort | tr '\n' ' ')
for e in vol out "$name"; do
	[[ " $exports " == *" $e "* ]] || die "export $e did not come back after remove and reinstall: $exports"
done
mapped
io=$(ct qemu-io -f raw -c "read -P 0x5a 0 1M" "$uri" 2>&1)
[[ $io != *failed* ]] || die "read after remove and reinstall: $io"

log "purge: the state goes, the exported files stay"
quiet "dpkg -P" dpkg -P rnbd-client rnbd-server
stopped purge
left=$(ct find /var/lib/rnbd /run/rnbd 2>/dev/null | tr '\n' ' ' || true)
[ -z "$left" ] || die "left after purge: $left"
ct test -f /srv/rnbd/vol.img || die "purge removed an exported file"

log "reinstall after purge: nothing old comes back"
quiet "dpkg -i (after purge)" sh -c 'dpkg -i /opt/rnbd-test/debs2/*.deb'
ct sed -i "s|^listen = .*|listen = [\"tcp://127.0.0.1:$port\"]|" /etc/rnbd/server.toml
ct systemctl start rnbd-server.service rnbd-client.service || die "systemctl start after purge and reinstall"
active rnbd-server.service rnbd-client.service
out=$(ct rnbd-server device list --format csv --fields devname 2>&1) || die "rnbd-server device list: $out"
out=$(tail -n +2 <<<"$out")
[ -z "$out" ] || die "exports came back after purge: $out"
out=$(ct rnbd-client device list --format csv --fields devname 2>&1) || die "rnbd-client device list: $out"
out=$(tail -n +2 <<<"$out")
[ -z "$out" ] || die "mappings came back after purge: $out"
# Purge removes /srv/rnbd once it is empty.
ct sh -c 'rm -f /srv/rnbd/*.img'
quiet "dpkg -P" dpkg -P rnbd-client rnbd-server
stopped purge
for d in /srv/rnbd /var/lib/rnbd; do
	ct test ! -e "$d" || die "$d is left after purge: $(ct ls -lA "$d" 2>&1 | tr '\n' ' ')"
done
stop_container
log "installed, started, used, upgraded (restarted, mapping back), rebooted (wait unit before remote-fs-pre.target), removed (state kept) and reinstalled (state back), purged (state gone) and reinstalled (nothing back) under systemd"
