#!/bin/busybox sh
# /init of the VM tier's guest (busybox sh): the kernel /dev/nbdN and
# /dev/ublkbN scenarios against a real kernel. Both daemons run in the
# guest and talk RTRS over TCP on its loopback (and a dummy interface for
# a second path). Prints one "RESULT name PASS|FAIL detail" line per check
# and one "SCENARIO name seconds" line per scenario, then "N passed, N
# failed" and VMTEST-DONE, and powers off.
/bin/busybox --install -s /bin
mount -t proc p /proc
mount -t sysfs s /sys
mount -t devtmpfs d /dev
mount -t tmpfs t /tmp
mkdir -p /run /mnt
ip link set lo up
# The peer (test/vm/run.sh, VM_PEER): a second kernel whose rnbd_server
# exports loop1 (72 MiB) over soft-RoCE on the NIC it shares with the
# guest, at 10.79.0.2, for the interop part's mirror over two kernels'
# rnbd_servers. Prints PEER lines, then idles until the host stops it.
if grep -q 'vmtest\.role=peer' /proc/cmdline; then
	for m in $(cat /lib/modules/order); do insmod "/lib/modules/$m" 2>/dev/null; done
	ok=1
	for m in rtrs-core rtrs-server; do insmod /lib/modules/extra/$m.ko || ok=0; done
	insmod /lib/modules/extra/rnbd-server.ko port_nr=1235 dev_search_path=/dev || ok=0
	ip link set eth0 up && ip addr add 10.79.0.2/24 dev eth0 && /usr/bin/rdma link add rxe0 type rxe netdev eth0 || ok=0
	truncate -s 72M /tmp/leg.img && losetup /dev/loop1 /tmp/leg.img || ok=0
	[ $ok = 1 ] && echo "PEER ready: $(uname -r), rnbd_server on port $(cat /sys/module/rnbd_server/parameters/port_nr), loop1 at 10.79.0.2" ||
		echo "PEER FAILED to set up: $(dmesg | tail -3 | tr '\n' ' ')"
	while :; do sleep 3600; done
fi
echo VMTEST-INIT
only=$(sed -n 's/.*vmtest\.only=\([^ ]*\).*/\1/p' /proc/cmdline)
want() { case ",${only:-all}," in *",all,"* | *",$1,"*) return 0 ;; esac; return 1; }
named() { case ",$only," in *",$1,"*) return 0 ;; esac; return 1; } # a part run only when named
# interop-perf (only when named) needs the interop part's setup.
want_interop() { want interop || named interop-perf; }
pass=0 fail=0
res() { # name PASS|FAIL detail (on one line: the host keeps only RESULT lines)
	echo "RESULT $1 $2 $(printf '%s' "$3" | tr '\n' ' ')"
	case $2 in PASS) pass=$((pass + 1)) ;; FAIL) fail=$((fail + 1)) ;; esac
}
check() { # name command... : PASS if the command succeeds
	local name=$1
	shift
	if out=$("$@" 2>&1); then res "$name" PASS ""; else res "$name" FAIL "$(echo "$out" | tail -3 | tr '\n' ' ')"; fi
}
scen_name="" scen_t0=0
scenario() { # name: ends the running scenario (its time) and starts the next
	local now
	now=$(cut -d' ' -f1 /proc/uptime)
	[ -n "$scen_name" ] && echo "SCENARIO $scen_name $(awk "BEGIN {printf \"%.1f\", $now - $scen_t0}")s"
	scen_name=$1 scen_t0=$now
}
finish() {
	scenario ""
	echo "--- rnbd-client log"
	tail -30 /tmp/client.log
	echo "--- rnbd-server log"
	tail -20 /tmp/server.log
	echo "$pass passed, $fail failed"
	echo VMTEST-DONE
	poweroff -f
}
cli() { /bin/rnbd-client --socket /tmp/c.sock "$@"; }
srv() { /bin/rnbd-server --socket /tmp/s.sock "$@"; }
# Faster failure detection than the defaults (2s x 3 heartbeats), and a
# shorter no_path_timeout: that bounds how long the kernel nbd driver
# leaves a request stranded on a dead socket (nbd_io_timeout is derived
# from them: 20 + 2*4 + 10 = 38 s).
start_client() {
	/bin/rnbd-client daemon --config /dev/null --control-socket /tmp/c.sock --state-file /tmp/c.json \
		--socket-dir /tmp --log-level info --hb-interval 2s --hb-missed-max 3 --no-path-timeout 20s --size-poll 1s >>/tmp/client.log 2>&1 &
	for _ in $(seq 100); do [ -S /tmp/c.sock ] && return 0; sleep 0.1; done
	return 1
}
stop_client() { # [-9]: the client daemon goes (SIGTERM, or SIGKILL with -9)
	kill ${1:-} "$(pidof rnbd-client)"
	for _ in $(seq 100); do pidof rnbd-client >/dev/null || break; sleep 0.1; done
	rm -f /tmp/c.sock
}
restart_client() { # [-9]
	stop_client "$@"
	start_client || res client-restart FAIL "no control socket"
}
start_server() {
	/bin/rnbd-server daemon --config /dev/null --listen tcp://127.0.0.1:1234 $listen2 $rdma_listen $srv_extra \
		--control-socket /tmp/s.sock --state-file /tmp/s.json --log-level info >>/tmp/server.log 2>&1 &
	for _ in $(seq 100); do [ -S /tmp/s.sock ] && return 0; sleep 0.1; done
	return 1
}
stop_server() { # [-9]
	kill ${1:-} "$(pidof rnbd-server)"
	for _ in $(seq 100); do pidof rnbd-server >/dev/null || break; sleep 0.1; done
	rm -f /tmp/s.sock
}
mb() { echo $(($1 * 1024 * 1024)); }
devname() { cli device list --format csv --fields devname 2>/dev/null | tail -1; }
devpath() { cli device list --format csv --fields devpath 2>/dev/null | tail -1; }
# counter EXPORT FIELD: a per-device counter of the server (flush_cnt…).
counter() { srv device show "$1" --format csv --fields "$2" 2>/dev/null | tail -1; }
throughput() { # name dev: 64 MiB written and read with 1 MiB O_DIRECT requests, then 4 KiB random reads at depth 16 (TCG: recorded, not judged)
	local t0 t1 t2
	t0=$(cut -d' ' -f1 /proc/uptime)
	dd if=/dev/zero of="$2" bs=1M count=64 oflag=direct 2>/dev/null
	t1=$(cut -d' ' -f1 /proc/uptime)
	dd if="$2" of=/dev/null bs=1M count=64 iflag=direct 2>/dev/null
	t2=$(cut -d' ' -f1 /proc/uptime)
	echo "TPUT $1 dd-1M-direct write $(awk "BEGIN {printf \"%.0f\", 64 / ($t1 - $t0)}") MB/s read $(awk "BEGIN {printf \"%.0f\", 64 / ($t2 - $t1)}") MB/s (emulated)"
	# Depth: what batching (plugs, bursts) is for.
	echo "TPUT $1 fio-4k-randread-qd16 $(fio --name=t --filename="$2" --direct=1 --ioengine=libaio --rw=randread --bs=4k \
		--iodepth=16 --size=64M --runtime=5 --time_based --output-format=terse 2>/dev/null | awk -F';' '{print $8}') IOPS (emulated)"
}

# basic P DEV EXPORT FILE MB: the device has the export's size, 16 MiB of
# O_DIRECT random data at MB reads back and is in the backing file there,
# a discard punches a hole in the file, and fsync reaches the backend as a
# flush.
basic() {
	local p=$1 dev=$2 exp=$3 file=$4 at=$5 size before after
	size=$(/usr/sbin/blockdev --getsize64 "$dev")
	[ "$size" = "$(stat -c %s "$file")" ] && res "$p-size" PASS "$size bytes" || res "$p-size" FAIL "$size, file $(stat -c %s "$file")"
	dd if=/tmp/pat of="$dev" bs=1M seek="$at" oflag=direct 2>/dev/null
	dd if="$dev" of=/tmp/back bs=1M skip="$at" count=16 iflag=direct 2>/dev/null
	check "$p-direct-io" cmp /tmp/pat /tmp/back
	dd if="$file" of=/tmp/onfile bs=1M skip="$at" count=16 2>/dev/null
	check "$p-on-backend" cmp /tmp/pat /tmp/onfile
	before=$(du -k "$file" | cut -f1)
	blkdiscard -o "$(mb "$at")" -l "$(mb 8)" "$dev" && sync
	after=$(du -k "$file" | cut -f1)
	[ $((before - after)) -ge 8000 ] && res "$p-discard-hole" PASS "${before}K -> ${after}K" || res "$p-discard-hole" FAIL "${before}K -> ${after}K"
	before=$(counter "$exp" flush_cnt)
	dd if=/tmp/pat of="$dev" bs=1M count=1 seek="$at" conv=fsync 2>/dev/null
	after=$(counter "$exp" flush_cnt)
	[ -n "$before" ] && [ "${after:-0}" -gt "$before" ] && res "$p-flush" PASS "server flush_cnt $before -> $after" ||
		res "$p-flush" FAIL "server flush_cnt $before -> $after"
}

# under_io P DEV MB ACTION...: a writer makes four passes of 32 MiB of
# fresh random data at MB while ACTION runs (a fault); the writer must end
# without an error and the data must read back equal.
writer() { for _ in 1 2 3 4; do dd if="$1" of="$dev" bs=1M seek="$2" oflag=direct 2>>/tmp/dd.err || return 1; done; }
under_io() {
	local p=$1 at=$3 ddpid during
	dev=$2
	shift 3
	dd if=/dev/urandom of=/tmp/patio bs=1M count=32 2>/dev/null
	: >/tmp/dd.err
	writer /tmp/patio "$at" &
	ddpid=$!
	sleep 0.5
	kill -0 $ddpid 2>/dev/null && during=1 || during=0
	"$@"
	if wait $ddpid && [ $during = 1 ]; then res "$p-under-io" PASS ""; else res "$p-under-io" FAIL "during=$during $(cat /tmp/dd.err)"; fi
	dd if="$dev" of=/tmp/backio bs=1M skip="$at" count=32 iflag=direct 2>/dev/null
	check "$p-data" cmp /tmp/patio /tmp/backio
}

# resized P DEV EXPORT BYTES: rnbd-server resize grows the export, and the
# mapping's kernel device shows the new size within 15 s (the client's
# size poll), with IO in the grown part. Only ublk before Linux 6.16
# (no UPDATE_SIZE) may keep its size, and then the client must say so;
# nbd has resized through netlink RECONFIGURE since 5.3.
resized() {
	local p=$1 dev=$2 exp=$3 want=$4 got out said before
	said="could not apply the new one.*path=$dev "
	before=$(grep -c "$said" /tmp/client.log)
	if ! out=$(srv resize "$exp" "$want" 2>&1); then
		res "$p-server-resize" FAIL "$out"
		return
	fi
	for _ in $(seq 150); do
		got=$(/usr/sbin/blockdev --getsize64 "$dev")
		[ "$got" = "$want" ] && break
		[ "$(grep -c "$said" /tmp/client.log)" -gt "$before" ] && break
		sleep 0.1
	done
	if [ "$got" = "$want" ]; then
		res "$p-server-resize" PASS "$got bytes"
		dd if=/tmp/pat of="$dev" bs=1M seek=$((want / 1048576 - 16)) oflag=direct 2>/dev/null
		dd if="$dev" of=/tmp/backr bs=1M skip=$((want / 1048576 - 16)) count=16 iflag=direct 2>/dev/null
		check "$p-resized-io" cmp /tmp/pat /tmp/backr
	elif [ "$p" = ublk ] && ! kernel_at_least 6 16 && [ "$(grep -c "$said" /tmp/client.log)" -gt "$before" ]; then
		out=$(grep "$said" /tmp/client.log | tail -1 | sed -n 's/.*error="\([^"]*\)".*/\1/p')
		res "$p-server-resize" PASS "the kernel cannot resize it, and the client said so ($out); $dev kept $got bytes"
	else
		res "$p-server-resize" FAIL "$dev shows $got bytes, want $want"
		grep -i "size" /tmp/client.log | tail -5 | sed 's/^/DETAIL /'
	fi
}

# stable NAME SESS DEVPATH DEV: the daemon's stable name of a mapping,
# /dev/rnbd/SESS/DEVPATH, is a link to its kernel device DEV.
stable() {
	local got
	got=$(readlink "/dev/rnbd/$2/$3" 2>&1)
	[ "$got" = "$4" ] && res "$1" PASS "/dev/rnbd/$2/$3 -> $got" || res "$1" FAIL "/dev/rnbd/$2/$3 -> $got, want $4"
}

# kernel_at_least MAJOR MINOR: the running kernel is that version or later.
kernel_at_least() {
	local v=$(uname -r) maj min
	maj=${v%%.*}
	min=${v#*.}
	min=${min%%[!0-9]*}
	[ "$maj" -gt "$1" ] || { [ "$maj" -eq "$1" ] && [ "$min" -ge "$2" ]; }
}

# fs P DEV: ext4 made, a file written, unmounted, mounted again and
# compared; unmap is refused while mounted (exit 5) and --force works.
fs() {
	local p=$1 dev=$2 name out rc
	name=$(devname)
	if /usr/sbin/mkfs.ext4 -q -F "$dev" && mount -t ext4 "$dev" /mnt && cp /tmp/pat /mnt/f && sync; then
		res "$p-mkfs-mount" PASS ""
		umount /mnt && mount -t ext4 "$dev" /mnt
		check "$p-remount-compare" cmp /tmp/pat /mnt/f
		out=$(cli unmap "$name" 2>&1)
		rc=$?
		[ $rc = 5 ] && res "$p-unmap-busy" PASS "" || res "$p-unmap-busy" FAIL "rc=$rc $out"
		check "$p-unmap-force" cli unmap --force "$name"
		cat /mnt/f >/dev/null 2>&1
		umount /mnt 2>/dev/null
	else
		res "$p-mkfs-mount" FAIL ""
		check "$p-unmap" cli unmap "$name"
	fi
	[ -z "$(cli device list --format csv 2>/dev/null | tail -n +2)" ] && res "$p-unmapped" PASS "" || res "$p-unmapped" FAIL "$(cli device list 2>&1)"
}

# fs_check P DEV: what a user does with a disk: ext4 made on DEV, files
# written and their checksums kept, sync, unmount; e2fsck -fn finds the
# filesystem clean; mounted again, every file has its checksum.
fs_check() {
	local p=$1 dev=$2 i out
	if ! out=$(/usr/sbin/mkfs.ext4 -q -F "$dev" 2>&1); then
		res "$p-mkfs" FAIL "$out"
		return 1
	fi
	if ! mount -t ext4 "$dev" /mnt; then
		res "$p-mount" FAIL "$(dmesg | tail -3 | tr '\n' ' ')"
		return 1
	fi
	mkdir -p /mnt/d
	for i in 1 2 3 4; do dd if=/dev/urandom of=/mnt/d/f$i bs=64k count=$((i * 8)) 2>/dev/null; done
	cp /tmp/pat /mnt/d/pat
	(cd /mnt/d && sha256sum f1 f2 f3 f4 pat) >/tmp/$p.sums
	sync
	umount /mnt
	check "$p-fsck-clean" /usr/sbin/e2fsck -fn "$dev"
	if mount -t ext4 "$dev" /mnt; then
		check "$p-files-verify" sh -c "cd /mnt/d && sha256sum -c /tmp/$p.sums"
		umount /mnt
	else
		res "$p-remount" FAIL ""
	fi
}
# flushes BLOCKDEV: the flushes the block layer completed on it (field
# 16 of /sys/block/DEV/stat).
flushes() { awk '{print $16}' "/sys/block/$1/stat"; }

for m in $(cat /lib/modules/order); do insmod "/lib/modules/$m" || res "insmod-$m" FAIL ""; done
[ -e /sys/module/nbd ] && res nbd-module PASS "" || { res nbd-module FAIL ""; finish; }

# program NAME BINARY ARGS...: a check program printing its own RESULT
# lines, counted here.
program() {
	local name=$1 bin=$2
	shift 2
	timeout 300 "$bin" "$@" >/tmp/$name.out 2>&1 || { res "$name-exit" FAIL "exit $?"; grep -v '^RESULT ' /tmp/$name.out | tail -20 | sed 's/^/DETAIL /'; }
	cat /tmp/$name.out
	while read -r tag _ st _; do
		[ "$tag" = RESULT ] || continue
		case $st in PASS) pass=$((pass + 1)) ;; FAIL) fail=$((fail + 1)) ;; esac
	done </tmp/$name.out
}

# gotest NAME BINARY ARGS...: a Go test binary, one RESULT line per test.
gotest() { # name binary args...; bounded by $gotest_timeout seconds (600)
	local name=$1 bin=$2 rc
	shift 2
	timeout "${gotest_timeout:-600}" "$bin" -test.v -test.count=1 "$@" >/tmp/$name.out 2>&1
	rc=$?
	grep -E '^ *--- (PASS|FAIL)' /tmp/$name.out | sed 's/^ *--- //; s/://' >/tmp/$name.res
	while read -r st tn _; do res "$name-$tn" "$st" ""; done </tmp/$name.res
	[ $rc = 0 ] || { res "$name-exit" FAIL "exit $rc"; grep -v '^=== ' /tmp/$name.out | tail -40 | sed 's/^/DETAIL /'; }
}

# RDMA: soft-RoCE on a dummy netdev with two guest-only addresses (rdma_cm
# does not resolve over lo), MTU 9000 so that the RoCE MTU is 4096.
rdma_setup() {
	ip link add rxenet type dummy && ip link set rxenet mtu 9000 &&
		ip addr add 10.78.0.1/24 dev rxenet && ip addr add 10.78.0.2/24 dev rxenet && ip link set rxenet up &&
		/usr/bin/rdma link add rxe0 type rxe netdev rxenet || return 1
	for _ in $(seq 50); do
		grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null && return 0
		sleep 0.1
	done
	return 1
}
# A path cut here takes an address off rxenet (its GID goes); rdma_rxe
# can then lose its GSI QP for good (docs/testing.md, "What the kernel
# allows"): every cut is followed by gsi_ok, which names that case.
gsi_ok() { # NAME [DEV]: DEV's (rxe0's) GSI QP, the CM's, still works after a cut
	local q
	q=$(/usr/bin/rdma res show qp lqpn 1 2>&1 | grep -m1 "${2:-rxe0}/")
	case $q in
	*"type GSI state RTS"*) res "$1" PASS "$q" ;;
	*"state ERR"*) res "$1" FAIL "soft-RoCE's GSI QP is in the error state: no RDMA connection to ${2:-rxe0} can be made any more (an rdma_rxe defect, docs/testing.md): $q" ;;
	*) res "$1" FAIL "no GSI QP ready to send on ${2:-rxe0} (rdma res show qp lqpn 1): ${q:-no line for it}" ;;
	esac
}
# ublk: pkg/frontend/ublk on its own, over an asynchronous RAM backend
# (test/vm/ublkcheck prints its own RESULT lines).
if want ublk-package; then
	scenario ublk-package
	if [ -e /dev/ublk-control ]; then
		res ublk-module PASS ""
		program ublkcheck /bin/ublkcheck
	else
		res ublk-module FAIL "no /dev/ublk-control"
	fi
fi

# lvm_setup: lvm2's tools without udev or dmeventd (the lvm parts).
lvm_setup() {
	export PATH=/sbin:/usr/sbin:/bin:/usr/bin
	mkdir -p /etc/lvm /run/lock/lvm
	cat >/etc/lvm/lvm.conf <<-EOF
		devices { obtain_device_list_from_udev = 0 }
		activation { udev_sync = 0 udev_rules = 0 monitoring = 0 }
		global { thin_check_executable = "/usr/sbin/thin_check" }
		backup { backup = 0 archive = 0 }
	EOF
}
# lvm: internal/pool's LVM thin pool on a real one (its tests make a
# volume group on a loop device and a thin pool in it) — lvm2's tools
# without udev or dmeventd, thin_check from thin-provisioning-tools.
if want lvm; then
	scenario lvm-pool
	lvm_setup
	if [ -e /dev/mapper/control ] && [ -e /sys/module/dm_thin_pool ]; then
		res dm-thin-pool PASS "$(lvm version | head -1)"
	else
		res dm-thin-pool FAIL "no /dev/mapper/control or dm_thin_pool module"
	fi
	RNBD_LVM_REQUIRED=1 gotest pool-lvm /bin/pool.test -test.run LVM

	# The daemon's lvm-thin pool, through the command line: a volume
	# group on a loop device, a thin pool of 256 MiB in it.
	scenario lvm-daemon
	truncate -s 300M /tmp/lvm-pv.img
	lvmdev=$(losetup -f) && losetup "$lvmdev" /tmp/lvm-pv.img &&
		pvcreate -q -y "$lvmdev" && vgcreate -q rnbdvm "$lvmdev" && lvcreate -q -y --type thin-pool -L 256m -n thin rnbdvm >/tmp/lvm-setup.out 2>&1
	printf '[[pool]]\nname = "thin"\ntype = "lvm-thin"\nvolume_group = "rnbdvm"\nthin_pool = "thin"\n' >/tmp/lvm-server.toml
	/bin/rnbd-server daemon --config /tmp/lvm-server.toml --listen tcp://127.0.0.1:1240 --control-socket /tmp/lvm-s.sock \
		--state-file /tmp/lvm-s.json --log-level info >>/tmp/lvm-server.log 2>&1 &
	for _ in $(seq 100); do [ -S /tmp/lvm-s.sock ] && break; sleep 0.1; done
	lsrv() { /bin/rnbd-server --socket /tmp/lvm-s.sock "$@"; }
	lexit() { # NAME WANT command...: the command exits WANT
		local name=$1 want=$2 out rc
		shift 2
		out=$("$@" 2>&1)
		rc=$?
		[ $rc = "$want" ] && res "$name" PASS "exit $rc" || res "$name" FAIL "exit $rc, want $want: $out"
	}
	lv_there() { lvs --noheadings -o lv_name rnbdvm 2>/dev/null | tr -d ' ' | grep -qx "$1"; }
	lexit lvm-daemon-create 0 lsrv volume create v1 --pool thin --size 64MiB
	lv1=/dev/rnbdvm/rnbd.v.v1
	[ "$(lsrv volume show v1 --format csv --fields path 2>&1 | tail -1)" = "$lv1" ] && [ -b "$lv1" ] &&
		[ "$(/usr/sbin/blockdev --getsize64 "$lv1")" = $((64 << 20)) ] && res lvm-daemon-thin-lv PASS "$lv1" ||
		res lvm-daemon-thin-lv FAIL "$(lsrv volume show v1 2>&1; lvs rnbdvm 2>&1)"
	lexit lvm-daemon-create-again 0 lsrv volume create v1 --pool thin --size 64MiB
	lexit lvm-daemon-create-other-size 4 lsrv volume create v1 --pool thin --size 32MiB
	dd if=/dev/urandom of=/tmp/lvm-pat bs=1M count=16 2>/dev/null
	dd if=/tmp/lvm-pat of="$lv1" bs=1M seek=4 conv=fsync 2>/dev/null
	lexit lvm-daemon-snapshot 0 lsrv volume snapshot create v1 s1
	lv_there rnbd.s.s1 && res lvm-daemon-snapshot-lv PASS "" || res lvm-daemon-snapshot-lv FAIL "$(lvs rnbdvm 2>&1)"
	dd if=/dev/zero of="$lv1" bs=1M seek=4 count=16 conv=fsync 2>/dev/null
	lexit lvm-daemon-clone 0 lsrv volume create v2 --pool thin --size 64MiB --from-snapshot s1
	dd if=/dev/rnbdvm/rnbd.v.v2 of=/tmp/lvm-back bs=1M skip=4 count=16 2>/dev/null
	check lvm-daemon-clone-data cmp /tmp/lvm-pat /tmp/lvm-back
	# A client has v1 open while it grows: it learns the thin LV's new
	# size by its size poll; the volume is busy for delete until the
	# client lets it go.
	mkdir -p /tmp/lvmc
	/bin/rnbd-client daemon --config /dev/null --control-socket /tmp/lvm-c.sock --state-file /tmp/lvm-c.json \
		--socket-dir /tmp/lvmc --log-level info --size-poll 1s >>/tmp/lvm-client.log 2>&1 &
	for _ in $(seq 100); do [ -S /tmp/lvm-c.sock ] && break; sleep 0.1; done
	lcli() { /bin/rnbd-client --socket /tmp/lvm-c.sock "$@"; }
	# An NBD socket, not /dev/nbdN: lvm2 scans every block device, and a
	# kernel device of a client gone would hang it (docs/server.md).
	lvdev=$(lcli map --sessname lvm --path ip:127.0.0.1 --dest-port 1240 --device-path v1 --as socket:/tmp/lvmc/v1.sock 2>&1 | awk '{print $1; exit}')
	[ -n "$lvdev" ] && [ "$(lcli device list --format csv --fields size 2>&1 | tail -1)" = $((64 << 20)) ] &&
		res lvm-daemon-client-map PASS "$lvdev" || res lvm-daemon-client-map FAIL "$(lcli device list 2>&1; tail -5 /tmp/lvm-client.log)"
	lexit lvm-daemon-resize 0 lsrv volume resize v1 --size 96MiB
	[ "$(/usr/sbin/blockdev --getsize64 "$lv1")" = $((96 << 20)) ] && res lvm-daemon-resized PASS "" ||
		res lvm-daemon-resized FAIL "$(/usr/sbin/blockdev --getsize64 "$lv1")"
	seen=""
	for _ in $(seq 100); do
		seen=$(lcli device list --format csv --fields size 2>&1 | tail -1)
		[ "$seen" = $((96 << 20)) ] && break
		sleep 0.2
	done
	[ "$seen" = $((96 << 20)) ] && res lvm-daemon-client-sees-growth PASS "$seen" || res lvm-daemon-client-sees-growth FAIL "$seen"
	lexit lvm-daemon-delete-busy 5 lsrv volume delete v1
	lcli unmap "$lvdev" >/dev/null 2>&1
	kill "$(pidof rnbd-client | tr ' ' '\n' | while read -r p; do grep -q lvm-c.sock /proc/$p/cmdline 2>/dev/null && echo $p; done)" 2>/dev/null
	# The server closes v1 when it sees the session go, a moment after
	# the unmap: the delete waits for that (up to 10 s), not a race.
	for _ in $(seq 50); do
		lsrv device list --format csv --fields mapping_path 2>/dev/null | grep -qx v1 || break
		sleep 0.2
	done
	lexit lvm-daemon-delete 0 lsrv volume delete v1
	! lv_there rnbd.v.v1 && res lvm-daemon-deleted PASS "" || res lvm-daemon-deleted FAIL "$(lvs rnbdvm 2>&1)"
	lexit lvm-daemon-delete-again 0 lsrv volume delete v1
	lexit lvm-daemon-over-pool 9 lsrv volume create huge --pool thin --size 1GiB
	! lv_there rnbd.v.huge && res lvm-daemon-over-pool-nothing PASS "" || res lvm-daemon-over-pool-nothing FAIL "$(lvs rnbdvm 2>&1)"
	out=$(lvs --noheadings -o lv_name,lv_tags rnbdvm 2>&1)
	names=$(echo "$out" | awk '{print $1}' | sort | tr '\n' ' ')
	[ "$names" = "rnbd.s.s1 rnbd.v.v2 thin " ] && ! echo "$out" | grep -q incomplete && res lvm-daemon-nothing-half-made PASS "$names" ||
		res lvm-daemon-nothing-half-made FAIL "$out"
	out=$(lsrv pool list --format csv --fields name,type,state 2>&1 | tail -1)
	[ "$out" = "thin,lvm-thin,served" ] && res lvm-daemon-pool-list PASS "$out" || res lvm-daemon-pool-list FAIL "$out"
	kill "$(pidof rnbd-server)" 2>/dev/null
	for _ in $(seq 100); do pidof rnbd-server >/dev/null || break; sleep 0.1; done
	[ "$fail" = 0 ] || tail -20 /tmp/lvm-server.log | sed 's/^/DETAIL /'
	vgremove -ff -y rnbdvm >/dev/null 2>&1
	losetup -d "$lvmdev"
fi

# csi: the CSI node service on this kernel (internal/csi's OnKernel
# tests): stage, publish, expand, unpublish, unstage through /dev/nbdN
# and ublk with ext4, and a raw block volume; util-linux's blkid first in
# PATH (busybox's has none of mount-utils' flags).
if want csi; then
	scenario csi-node
	f0=$fail
	mkdir -p /tmp/csi-logs
	PATH=/sbin:/usr/sbin:/usr/bin:/bin RNBD_CSI_KERNEL=1 RNBD_BIN=/bin RNBD_CSI_LOGS=/tmp/csi-logs RNBD_CSI_CONSOLE=1 \
		gotest csi /bin/csi.test -test.run '^TestNode.*OnKernel$' -test.timeout 360s
	[ "$fail" = "$f0" ] || grep -E '_test\.go:[0-9]+: ' /tmp/csi.out | grep -vE ': rnbd-(server|client):$' | head -20 | sed 's/^/DETAIL /' 
fi

# csi-sanity: csi-sanity's whole suite (internal/csi's TestSanity) on
# this kernel: two storage nodes (dir pools on XFS loop mounts, admin
# over TLS) and a worker's rnbd-client as processes, the node service
# staging and publishing for real. Once per access type (one ginkgo run
# per process), each on one frontend: a file system volume on ublk (the
# default where the kernel has it), a raw block volume on nbd. Each run
# prints "TPUT csi-sanity ACCESS on FRONTEND: N passed, ...".
if want csi-sanity; then
	scenario csi-sanity
	for run in mount:ublk block:nbd; do
		a=${run%:*} f=${run#*:}
		PATH=/sbin:/usr/sbin:/usr/bin:/bin RNBD_CSI_KERNEL=1 RNBD_BIN=/bin RNBD_CSI_SANITY_ACCESS=$a RNBD_CSI_SANITY_FRONTEND=$f \
			gotest csi-sanity-$a-$f /bin/csi.test -test.run '^TestSanity$' -test.timeout 500s -ginkgo.no-color
		grep -a '^TPUT csi-sanity' /tmp/csi-sanity-$a-$f.out || res csi-sanity-$a-$f-counts FAIL "no TPUT line"
		# The specs that failed (ginkgo's summary; the daemons' logs
		# after it push it out of gotest's tail).
		grep -a '^ *\[FAIL\] ' /tmp/csi-sanity-$a-$f.out | sed 's/^ */DETAIL /'
		# Each skip and the suite's reason, for the console log only.
		grep -a 'sanity_test.go:[0-9]*: skipped: ' /tmp/csi-sanity-$a-$f.out | sed "s/.*sanity_test.go:[0-9]*: skipped: /SKIP $a-$f: /"
	done
fi

# csi-fleet: the fleet scenario (internal/csi's TestFleetOnKernel, see
# docs/testing.md): two storage nodes, two workers in network namespaces
# (iproute2's ip, /usr/sbin/ip), 20 volumes through the CSI services over
# gRPC, a storage node stopped, then frozen, and back; its TPUT lines,
# and on a failure the steps and the daemons' last words.
if want csi-fleet; then
	scenario csi-fleet
	f0=$fail
	mkdir -p /tmp/csi-fleet-logs
	# Its steps' bounds add up to more than the others' (the storage
	# outage, issue 40): 20 minutes at most, for a busy host.
	gotest_timeout=1530
	PATH=/sbin:/usr/sbin:/usr/bin:/bin RNBD_CSI_KERNEL=1 RNBD_BIN=/bin RNBD_CSI_LOGS=/tmp/csi-fleet-logs RNBD_CSI_IP=/usr/sbin/ip RNBD_CSI_CONSOLE=1 \
		gotest csi-fleet /bin/csi.test -test.run '^TestFleetOnKernel$' -test.timeout 1500s
	unset gotest_timeout
	grep '^TPUT ' /tmp/csi-fleet.out
	if [ "$fail" != "$f0" ]; then
		grep -E 'fleet_(outage_)?kernel_test\.go:[0-9]+: ' /tmp/csi-fleet.out | head -30 | sed 's/^/DETAIL /'
		for l in /tmp/csi-fleet-logs/*.log; do
			echo "DETAIL --- $l"
			tail -15 "$l" | sed 's/^/DETAIL /'
		done
	fi
	# A replicated volume's fleet scenario (TestFleetReplicatedOnKernel):
	# four storage nodes, a leg's frozen and thawed (resynced from the
	# bitmap), the other's killed for good (the leg made anew on a spare
	# and rebuilt).
	f0=$fail
	mkdir -p /tmp/csi-fleet-mirror-logs
	PATH=/sbin:/usr/sbin:/usr/bin:/bin RNBD_CSI_KERNEL=1 RNBD_BIN=/bin RNBD_CSI_LOGS=/tmp/csi-fleet-mirror-logs RNBD_CSI_CONSOLE=1 \
		gotest csi-fleet-mirror /bin/csi.test -test.run '^TestFleetReplicatedOnKernel$' -test.timeout 580s
	grep '^TPUT ' /tmp/csi-fleet-mirror.out
	if [ "$fail" != "$f0" ]; then
		grep -E 'fleet_mirror_kernel_test\.go:[0-9]+: ' /tmp/csi-fleet-mirror.out | head -30 | sed 's/^/DETAIL /'
		for l in /tmp/csi-fleet-mirror-logs/*.log; do
			echo "DETAIL --- $l"
			tail -25 "$l" | sed 's/^/DETAIL /'
		done
	fi
fi

# lvm-bench (only when named): tools/fleetbench on a thin pool of its
# own (docs/benchmarks.md, issue 33): 100 volumes made, granted and
# deleted; its table on the console (VM_LOG keeps it).
case ",$only," in *,lvm-bench,*)
	scenario lvm-bench
	lvm_setup
	truncate -s 700M /tmp/bench-pv.img
	bdev=$(losetup -f) && losetup "$bdev" /tmp/bench-pv.img &&
		pvcreate -q -y "$bdev" >/dev/null && vgcreate -q rnbdbench "$bdev" >/dev/null &&
		lvcreate -q -y --type thin-pool -L 600m -n thin rnbdbench >/dev/null 2>&1
	/bin/fleetbench -bin /bin -pool lvm-thin:rnbdbench/thin -size 4MiB -reps 1 -exports 0 -idle 1s -out /tmp/fleet.tsv >/tmp/fleet.out 2>&1 &&
		res lvm-bench PASS "" || res lvm-bench FAIL "$(tail -3 /tmp/fleet.out | tr '\n' ' ')"
	sed 's/^/BENCH /' /tmp/fleet.out
	vgremove -ff -y rnbdbench >/dev/null 2>&1
	losetup -d "$bdev"
	;;
esac

rdma_up=0 rdma_listen="" srv_extra=""
if want rdma || want_interop; then
	scenario rdma-setup
	if rdma_setup; then
		res rxe-up PASS "$(cat /sys/class/infiniband/rxe0/ports/1/state)"
		rdma_up=1 rdma_listen="--listen rdma://0.0.0.0:1234"
	else
		res rxe-up FAIL "$(/usr/bin/rdma link 2>&1 | tr '\n' ' ')"
	fi
fi
if want rdma && [ $rdma_up = 1 ]; then
	scenario rdma-verbs
	RNBD_RDMA_ADDR=10.78.0.1 gotest ibverbs /bin/ibverbs.test
	# always_invalidate's two ways: re-registration and memory windows.
	RNBD_RDMA_ADDR=10.78.0.1 timeout 120 /bin/ibverbs.test -test.run '^$' -test.bench . -test.benchtime 300x >/tmp/bench.out 2>&1
	grep -E 'Benchmark|SKIP|FAIL|bind|window' /tmp/bench.out | sed 's/^/TPUT verbs (emulated) /'
	scenario rdma-fabric
	RNBD_RDMA_ADDR=10.78.0.1 gotest fabric-rdma /bin/rdma.test
	RNBD_RDMA_ADDR=10.78.0.1 timeout 120 /bin/rdma.test -test.run '^$' -test.bench . -test.benchtime 2000x >/tmp/bench.out 2>&1
	grep -E 'Benchmark|SKIP|FAIL' /tmp/bench.out | sed 's/^/TPUT fabric (emulated) /'
fi
want nbd || want ublk || want mirror || want mirror-schedules || want gonbd || named mirror-bench || [ $rdma_up = 1 ] || finish

cd /tmp
dd if=/dev/urandom of=/tmp/pat bs=1M count=16 2>/dev/null
for d in disk0:256M disk1:128M disk2:128M disk3:128M disk4:128M; do truncate -s "${d#*:}" "/tmp/${d%%:*}.img"; done
listen2=""
start_server || { res daemons FAIL "no server control socket"; finish; }
start_client || { res daemons FAIL "no client control socket"; finish; }
for d in disk0 disk1 disk2 disk3 disk4; do srv map $d /tmp/$d.img >/dev/null; done

# A mirror over two storage nodes (two more rnbd-servers in the
# guest, on ports 1240 and 1241, each exporting a file) as /dev/ublkbN:
# a filesystem on it, checked; one node killed (-9) under a writer, which
# goes on (the leg fenced after mirror_leg_timeout); the node started
# again: the leg rejoins and is resynced while mapped; a filesystem again;
# at the end both legs hold the same data.
if want mirror; then
	scenario mirror-map
	mirror_srv() { # N: the mirror's storage node N, on port 124N
		/bin/rnbd-server daemon --config /dev/null --listen tcp://127.0.0.1:124$1 --control-socket /tmp/m$1.sock \
			--state-file /tmp/m$1.json --log-level info >>/tmp/m$1.log 2>&1 &
		eval "mpid$1=\$!"
		for _ in $(seq 100); do [ -S /tmp/m$1.sock ] && return 0; sleep 0.1; done
		return 1
	}
	mleg() { echo "sessname=mleg$1 path=ip:127.0.0.1 dest_port=124$1 device_path=vol"; }
	mstate() { cli device show "$(devname)" --format csv --fields state 2>/dev/null | tail -1; }
	for n in 0 1; do
		truncate -s 136M /tmp/leg$n.img
		mirror_srv $n || res mirror-node-$n FAIL "no control socket"
		/bin/rnbd-server --socket /tmp/m$n.sock map vol /tmp/leg$n.img >/dev/null
	done
	out=$(cli map --mirror mvol --create --leg "$(mleg 0)" --leg "$(mleg 1)" --as ublk 2>&1)
	dev=$(echo "$out" | awk '/mapped:/ {print $3}')
	case $dev in /dev/ublkb*) res mirror-map PASS "$dev" ;; *) res mirror-map FAIL "$out" ;; esac
	if [ -b "$dev" ]; then
		size=$(/usr/sbin/blockdev --getsize64 "$dev")
		[ "$size" = "$(mb 128)" ] && res mirror-size PASS "$size bytes" || res mirror-size FAIL "$size bytes"
		fs_check mirror "$dev"
		scenario mirror-node-kill
		kill_leg1() { kill -9 "$mpid1"; }
		t0=$(cut -d' ' -f1 /proc/uptime)
		under_io mirror-node-kill "$dev" 32 kill_leg1
		t1=$(cut -d' ' -f1 /proc/uptime)
		st=$(mstate)
		[ "$st" = degraded ] && res mirror-degraded PASS "writer done in $(awk "BEGIN {print $t1 - $t0}") s" || res mirror-degraded FAIL "state $st"
		scenario mirror-rejoin
		mirror_srv 1 || res mirror-node-restart FAIL "no control socket"
		for _ in $(seq 600); do [ "$(mstate)" = open ] && break; sleep 0.1; done
		st=$(mstate)
		[ "$st" = open ] && res mirror-rejoin-resync PASS "" || res mirror-rejoin-resync FAIL "state $st: $(cli device show "$(devname)" 2>&1 | tr '\n' ' ')"
		dd if="$dev" of=/tmp/backio bs=1M skip=32 count=32 iflag=direct 2>/dev/null
		check mirror-rejoin-data cmp /tmp/patio /tmp/backio
		fs_check mirror-rejoined "$dev"
		check mirror-unmap cli unmap "$(devname)"
		# The data past the 8 MiB of metadata: the same on both legs.
		check mirror-legs-equal cmp /tmp/leg0.img /tmp/leg1.img 8388608 8388608
	fi
	kill "$mpid0" "$mpid1" 2>/dev/null
	grep -h "mirror" /tmp/client.log | tail -8 | sed 's/^/DETAIL client: /'
fi

# The mirror's fault schedules on a real device: real rnbd-servers
# killed, frozen and started again, the client daemon killed with
# writes in flight, every read of /dev/ublkbN judged by the history
# checker (test/e2e, TestMirrorSchedulesOnKernel; a RESULT line per
# schedule, the totals in a NOTE line). Not on kernels before 6.16: on
# 6.12 a SIGKILL of the daemon serving ublk devices oopsed the kernel
# in io_uring's exit path (io_fallback_tw, a ring's request left on the
# dying task after the ring was freed: ublk's cancel racing its
# dispatch) once in some twenty kills; make test-vm's second pass runs
# them on trixie-backports' kernel.
if want mirror-schedules && ! kernel_at_least 6 16; then
	echo "NOTE mirror-schedules not run: $(uname -r) is older than 6.16 (its ublk oopses when the daemon is killed at the wrong moment; docs/testing.md)"
fi
if want mirror-schedules && kernel_at_least 6 16; then
	scenario mirror-schedules
	export RNBD_E2E_BIN=/bin RNBD_MIRROR_SCHEDULES=${RNBD_MIRROR_SCHEDULES:-24}
	gotest_timeout=1300
	gotest mirror-schedules /bin/e2e.test -test.run '^TestMirrorSchedulesOnKernel$' -test.timeout 1200s
	unset gotest_timeout
	grep -h "schedules in" /tmp/mirror-schedules.out | sed 's/^ *[^ ]*: /NOTE mirror-schedules: /'
	if grep -q '^--- FAIL' /tmp/mirror-schedules.out; then
		# What is stuck, if anything: the tasks in D state and their
		# kernel stacks.
		echo 1 >/proc/sys/kernel/sysrq && echo w >/proc/sysrq-trigger
		dmesg | tail -120 | sed 's/^/DETAIL kernel: /'
	fi
fi

# mirror-bench (only when named): the mirror of two legs against one
# device and against the usual answer, md raid1 over two rnbd devices
# (an internal write-intent bitmap, as the mirror's), each a ublk device
# over two rnbd-servers on the guest's loopback: 4 KiB random writes at
# depth 1 (the median latency) and 32 (IOPS), random reads at depth 32
# (IOPS). The CPU is emulated: only the ratios to one device mean
# anything. Rounds interleaved, medians reported (TPUT lines).
if named mirror-bench; then
	scenario mirror-bench
	bsrv() { # N: storage node N, on port 125N
		/bin/rnbd-server daemon --config /dev/null --listen tcp://127.0.0.1:125$1 --control-socket /tmp/b$1.sock \
			--state-file /tmp/b$1.json --log-level warning >>/tmp/b$1.log 2>&1 &
		eval "bpid$1=\$!"
		for _ in $(seq 100); do [ -S /tmp/b$1.sock ] && return 0; sleep 0.1; done
		return 1
	}
	for n in 0 1; do
		truncate -s 264M /tmp/bvol$n.img && truncate -s 256M /tmp/braw$n.img
		bsrv $n || res mirror-bench-node-$n FAIL "no control socket"
		/bin/rnbd-server --socket /tmp/b$n.sock map vol /tmp/bvol$n.img >/dev/null
		/bin/rnbd-server --socket /tmp/b$n.sock map raw /tmp/braw$n.img >/dev/null
	done
	bleg() { echo "sessname=bm$1 path=ip:127.0.0.1 dest_port=125$1 device_path=vol"; }
	cli map --mirror bm --create --leg "$(bleg 0)" --leg "$(bleg 1)" --as socket:/tmp/bm-create.sock >/dev/null 2>&1 &&
		cli unmap "$(devname)" >/dev/null 2>&1 || res mirror-bench-create FAIL ""
	bmap() { # sessname node: /dev/ublkbN of one device
		cli map --sessname $1 --path ip:127.0.0.1 --dest-port 125$2 --device-path raw --as ublk 2>/dev/null | awk '/mapped:/ {print $3}'
	}
	# bfio DEV RW DEPTH: prints the write median latency (µs) for QD 1
	# writes, else the IOPS.
	bfio() {
		fio --name=b --filename=$1 --direct=1 --ioengine=libaio --rw=$2 --bs=4k --iodepth=$3 --size=200M \
			--runtime=5 --time_based --output-format=terse --terse-version=3 2>/dev/null | awk -F';' -v rw=$2 -v qd=$3 '
			rw == "randread" {print $8; exit}
			qd == 1 {for (i = 59; i <= 78; i++) if ($i ~ /^50\.0+%=/) {split($i, a, "="); print a[2]; exit}}
			{print $49; exit}'
	}
	bround() { # name dev
		local w key rw qd v
		if [ ! -b "$2" ]; then
			eval "bench_${1}_fail=1"
			return
		fi
		for w in w1:randwrite:1 w32:randwrite:32 r32:randread:32; do
			key=${w%%:*} rw=${w#*:}
			qd=${rw#*:} rw=${rw%%:*}
			v=$(bfio "$2" $rw $qd)
			[ -n "$v" ] || eval "bench_${1}_fail=1"
			eval "bench_${1}_$key=\"\${bench_${1}_$key:-} $v\""
		done
	}
	for r in 1 2 3; do
		d=$(bmap bs$r 0); bround single "$d"; [ -b "$d" ] && cli unmap "$(devname)" >/dev/null
		d=$(cli map --mirror bm --leg "$(bleg 0)" --leg "$(bleg 1)" --as ublk 2>/dev/null | awk '/mapped:/ {print $3}')
		bround mirror "$d"; [ -b "$d" ] && cli unmap "$(devname)" >/dev/null
		d0=$(bmap bd0$r 0) d1=$(bmap bd1$r 1)
		if [ -b "$d0" ] && [ -b "$d1" ] && mdadm --create /dev/md0 --run --quiet --level=1 --raid-devices=2 --assume-clean \
			--bitmap=internal --metadata=1.2 "$d0" "$d1" >/tmp/mdadm.out 2>&1; then
			bround md /dev/md0
			mdadm --stop /dev/md0 >/dev/null 2>&1
		else
			res mirror-bench-md FAIL "$(tail -2 /tmp/mdadm.out | tr '\n' ' ')"
			bench_md_fail=1
		fi
		for n in $(cli device list --format csv --fields devname 2>/dev/null | tail -n +2); do cli unmap "$n" >/dev/null; done
	done
	bmed() { echo "$@" | tr ' ' '\n' | grep -v '^$' | sort -n | awk '{v[NR] = $1} END { if (NR) print v[int((NR + 1) / 2)] }'; }
	bratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else printf "?" }'; }
	for p in single mirror md; do
		eval "f=\${bench_${p}_fail:-}"
		[ -z "$f" ] && res mirror-bench-$p PASS "" || res mirror-bench-$p FAIL "not mapped, or no figure, in every round"
	done
	for w in w1 w32 r32; do
		eval "s=\$(bmed \$bench_single_$w) m=\$(bmed \$bench_mirror_$w) d=\$(bmed \$bench_md_$w)"
		eval "all=\"single [\${bench_single_$w# }] mirror [\${bench_mirror_$w# }] md [\${bench_md_$w# }]\""
		case $w in
		w1) what="4 KiB random write QD1, median latency us" ;;
		w32) what="4 KiB random write QD32, IOPS" ;;
		r32) what="4 KiB random read QD32, IOPS" ;;
		esac
		echo "TPUT mirror-bench $what (emulated, median of 3 rounds): single $s, mirror $m ($(bratio "$m" "$s")x), md raid1 $d ($(bratio "$d" "$s")x); rounds: $all"
	done
	kill "$bpid0" "$bpid1" 2>/dev/null
	rm -f /tmp/bvol?.img /tmp/braw?.img
fi

# RDMA: both daemons on soft-RoCE, a session of two paths (the two
# addresses of the rxe netdev). /dev/nbdN first, then /dev/ublkbN.
# rdma_data rd|wr: the data bytes of stats/rdma summed over the client's
# paths. Its byte counters include each request's user message (the
# 32-byte RNBD IO message), as the kernel's do.
rdma_data() {
	cli stats --format csv --fields rdma.rd_cnt,rdma.rd_bytes,rdma.wr_cnt,rdma.wr_bytes 2>/dev/null | tail -n +2 |
		awk -F, -v d="$1" '{ c = (d == "rd") ? $1 : $3; b = (d == "rd") ? $2 : $4; s += b - 32 * c } END { print s + 0 }'
}
if want rdma && [ $rdma_up = 1 ]; then
	scenario rdma-nbd
	rpaths="--path ip:10.78.0.1@ip:10.78.0.1 --path ip:10.78.0.2@ip:10.78.0.2"
	out=$(cli map --sessname rd $rpaths --device-path disk3 --transport rdma --as nbd 2>&1)
	dev=$(echo "$out" | awk '/mapped:/ {print $3}')
	case $dev in /dev/nbd*) res rdma-map PASS "$dev" ;; *) res rdma-map FAIL "$out"; finish ;; esac
	st=$(cli session list --format csv --fields transport,path_uu 2>/dev/null | tail -1)
	[ "$st" = rdma,UU ] && res rdma-session PASS "$st" || res rdma-session FAIL "$st"
	ps=$(cli path list --format csv --fields hca_name,hca_port,src_addr,dst_addr 2>/dev/null | tail -n +2 | tr '\n' ' ')
	case $ps in "rxe0,1,ip:10.78.0.1,ip:10.78.0.1 rxe0,1,ip:10.78.0.2,ip:10.78.0.2 ") res rdma-path-show PASS "$ps" ;;
	*) res rdma-path-show FAIL "$ps" ;; esac
	basic rdma-nbd "$dev" disk3 /tmp/disk3.img 4
	check rdma-nbd-fio-verify fio --name=v --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite \
		--bsrange=4k-64k --size=32M --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=0
	throughput rdma-nbd "$dev"
	# A hostile client writes a chunk with an rkey the server has revoked:
	# the device refuses it, and the server goes on serving this device.
	scenario rdma-hostile
	dd if=/tmp/pat of="$dev" bs=1M seek=48 oflag=direct 2>/dev/null
	program rdmahostile /bin/rdmahostile -src 10.78.0.1 -dst 10.78.0.1:1234
	dd if="$dev" of=/tmp/rback bs=1M skip=48 count=16 iflag=direct 2>/dev/null
	check rdma-hostile-server-serves cmp /tmp/pat /tmp/rback
	for _ in $(seq 50); do grep -q 'session=hostile.*closing path\|closing path.*session=hostile' /tmp/server.log && break; sleep 0.1; done
	grep -q 'session=hostile.*closing path\|closing path.*session=hostile' /tmp/server.log &&
		res rdma-hostile-server-closed-path PASS "$(grep 'closing path.*session=hostile\|session=hostile.*closing path' /tmp/server.log | tail -1 | sed -n 's/.*reason="\([^"]*\)".*/\1/p')" ||
		res rdma-hostile-server-closed-path FAIL "$(grep hostile /tmp/server.log | tail -3 | tr '\n' ' ')"
	# stats/rdma: the bytes the client sent and received are the IO done,
	# and at most a few KiB of the size poll's, every second here: its
	# OPEN's answer (56 bytes) and the one-block read before it (512).
	cli stats --reset >/dev/null
	dd if=/dev/urandom of="$dev" bs=1M count=8 seek=40 oflag=direct 2>/dev/null
	dd if="$dev" of=/dev/null bs=1M count=4 skip=40 iflag=direct 2>/dev/null
	w=$(rdma_data wr) r=$(rdma_data rd)
	[ "$w" -ge $((8 << 20)) ] && [ "$w" -le $(((8 << 20) + 4096)) ] && [ "$r" -ge $((4 << 20)) ] && [ "$r" -le $(((4 << 20) + 16384)) ] &&
		res rdma-stats PASS "written $w read $r" ||
		res rdma-stats FAIL "written $w read $r, want $((8 << 20)) and $((4 << 20)): $(cli stats --format csv --fields rdma | tr '\n' ' ')"
	scenario rdma-path-cut
	rdma_cut() { ip addr del 10.78.0.2/24 dev rxenet; }
	under_io rdma-path-cut "$dev" 64 rdma_cut
	st=$(cli path list --format csv --fields dst_addr,state,reconnects.successful,reconnects.failed 2>/dev/null | grep 10.78.0.2)
	case $st in *,connected,0,0 | "") res rdma-path-cut-seen FAIL "$st" ;; *) res rdma-path-cut-seen PASS "$st" ;; esac
	gsi_ok rdma-path-cut-gsi
	ip addr add 10.78.0.2/24 dev rxenet
	# The address is back: the path's own reconnects bring it up again
	# (their delay has grown to several seconds by now).
	t0=$(cut -d' ' -f1 /proc/uptime)
	for _ in $(seq 120); do
		st=$(cli path list --format csv --fields dst_addr,state 2>/dev/null | grep 10.78.0.2)
		[ "$st" = ip:10.78.0.2,connected ] && break
		sleep 0.5
	done
	[ "$st" = ip:10.78.0.2,connected ] &&
		res rdma-path-cut-reconnected PASS "in $(awk -v a="$t0" -v b="$(cut -d' ' -f1 /proc/uptime)" 'BEGIN { print b - a }')s" ||
		res rdma-path-cut-reconnected FAIL "$st"
	scenario rdma-nbd-fs
	fs rdma-nbd "$dev"

	scenario rdma-ublk
	# auto: both paths lead to rxe0, so the session is the RDMA one.
	out=$(cli map --sessname rdu $rpaths --device-path disk4 --as ublk 2>&1)
	dev=$(echo "$out" | awk '/mapped:/ {print $3}')
	case $dev in /dev/ublkb*) res rdma-ublk-map PASS "$dev" ;; *) res rdma-ublk-map FAIL "$out"; finish ;; esac
	st=$(cli session list --format csv --fields sessname,transport 2>/dev/null | grep rdu)
	[ "$st" = rdu,rdma ] && res rdma-auto PASS "$st" || res rdma-auto FAIL "$st"
	basic rdma-ublk "$dev" disk4 /tmp/disk4.img 2
	check rdma-ublk-fio-verify fio --name=v --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite \
		--bsrange=4k-64k --size=32M --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=0
	throughput rdma-ublk "$dev"
	scenario rdma-ublk-fs
	fs rdma-ublk "$dev"

	# What always_invalidate costs: 4 KiB random reads with the server
	# rotating every chunk's rkey (the default), then without.
	scenario rdma-invalidate-cost
	out=$(cli map --sessname rdc $rpaths --device-path disk3 --transport rdma --as nbd 2>&1)
	dev=$(echo "$out" | awk '/mapped:/ {print $3}')
	iops() {
		fio --name=c --filename="$dev" --direct=1 --ioengine=libaio --rw=randread --bs=4k --iodepth=8 \
			--runtime=5 --time_based --output-format=terse 2>/dev/null | awk -F';' '{print $8}'
	}
	on=$(iops)
	stop_server
	srv_extra="--always-invalidate=false"
	start_server || res server-restart FAIL "no control socket"
	for _ in $(seq 200); do
		[ "$(cli session list --format csv --fields sessname,path_uu 2>/dev/null | grep rdc)" = rdc,UU ] && break
		sleep 0.1
	done
	off=$(iops)
	echo "TPUT rdma-nbd fio-4k-randread-qd8 always_invalidate on ${on:-?} IOPS, off ${off:-?} IOPS (emulated)"
	check rdma-unmap-cost cli unmap "$(devname)"
	stop_server
	srv_extra=""
	start_server || res server-restart FAIL "no control socket"
fi
# Interoperability with the kernel's own RTRS/RNBD (when the tier was given
# its modules, VM_KMODS): our client against the kernel's rnbd-server, and
# the kernel's rnbd-client against ours, both over rdma_rxe.
if want_interop && [ $rdma_up = 1 ] && [ ! -e /lib/modules/extra/rnbd-server.ko ]; then
	echo "NOTE interop not run: the tier was given no kernel RTRS/RNBD modules (VM_KMODS)"
fi
if want_interop && [ $rdma_up = 1 ] && [ -e /lib/modules/extra/rnbd-server.ko ]; then
	scenario interop-setup
	# Two RAM disks: ram0 for the kernel's server, ram1 for ours
	# (interop-perf).
	insmod /lib/modules/extra/brd.ko rd_nr=2 rd_size=65536
	ok=1
	for m in rtrs-core rtrs-server rtrs-client; do insmod /lib/modules/extra/$m.ko || ok=0; done
	insmod /lib/modules/extra/rnbd-server.ko port_nr=1235 dev_search_path=/dev || ok=0
	insmod /lib/modules/extra/rnbd-client.ko || ok=0
	[ $ok = 1 ] && [ -b /dev/ram0 ] && res interop-modules PASS "$(cat /sys/module/rnbd_server/parameters/port_nr 2>/dev/null)" ||
		res interop-modules FAIL "$(dmesg | tail -5 | tr '\n' ' ')"

	scenario interop-kernel-server
	log0=$(wc -l </tmp/client.log)
	out=$(cli map --sessname kint --path ip:10.78.0.1@ip:10.78.0.1 --dest-port 1235 --device-path ram0 --transport rdma --as nbd 2>&1)
	dev=$(echo "$out" | awk '/mapped:/ {print $3}')
	case $dev in /dev/nbd*) res interop-map-kernel-server PASS "$dev" ;; *) res interop-map-kernel-server FAIL "$out $(dmesg | tail -5 | tr '\n' ' ')" ;; esac
	if [ -b "$dev" ]; then
		dd if=/tmp/pat of="$dev" bs=1M seek=8 oflag=direct 2>/dev/null
		dd if="$dev" of=/tmp/kback bs=1M skip=8 count=16 iflag=direct 2>/dev/null
		check interop-kernel-server-io cmp /tmp/pat /tmp/kback
		dd if=/dev/ram0 of=/tmp/kram bs=1M skip=8 count=16 2>/dev/null
		check interop-kernel-server-on-device cmp /tmp/pat /tmp/kram
		check interop-kernel-server-fio fio --name=v --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite \
			--bsrange=4k-256k --size=16M --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=0
		check interop-kernel-server-unmap cli unmap "$(devname)"
	fi

	scenario interop-kernel-client
	dd if=/tmp/pat of=/tmp/disk0.img bs=1M seek=100 conv=notrunc 2>/dev/null
	if echo "sessname=kcl dest_port=1234 path=ip:10.78.0.1@ip:10.78.0.1 device_path=disk0" >/sys/class/rnbd-client/ctl/map_device 2>/tmp/kmap.err; then
		for _ in $(seq 50); do [ -b /dev/rnbd0 ] && break; sleep 0.1; done
	fi
	if [ -b /dev/rnbd0 ]; then
		res interop-map-kernel-client PASS "$(cat /sys/block/rnbd0/rnbd/state) $(cat /sys/block/rnbd0/size) sectors"
		dd if=/dev/rnbd0 of=/tmp/kcback bs=1M skip=100 count=16 iflag=direct 2>/dev/null
		check interop-kernel-client-read cmp /tmp/pat /tmp/kcback
		dd if=/tmp/pat of=/dev/rnbd0 bs=1M seek=150 oflag=direct 2>/dev/null
		dd if=/tmp/disk0.img of=/tmp/kcfile bs=1M skip=150 count=16 2>/dev/null
		check interop-kernel-client-write cmp /tmp/pat /tmp/kcfile
		check interop-kernel-client-fio fio --name=v --filename=/dev/rnbd0 --direct=1 --ioengine=libaio --rw=randwrite \
			--bsrange=4k-256k --size=16M --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=0
		echo normal >/sys/block/rnbd0/rnbd/unmap_device
		[ ! -b /dev/rnbd0 ] && res interop-kernel-client-unmap PASS "" || res interop-kernel-client-unmap FAIL ""
	else
		res interop-map-kernel-client FAIL "$(cat /tmp/kmap.err) $(dmesg | tail -8 | tr '\n' ' ')"
		grep kcl /tmp/server.log | tail -20 | sed 's/^/DETAIL server: /'
		dmesg | tail -30 | sed 's/^/DETAIL kernel: /'
	fi

	# The kernel's client writing past the end of our export, after its
	# own resize beyond the export, then after a forced shrink on our
	# server: the O_DIRECT write must fail with ENOSPC. With EINVAL (what
	# our server answered to a write that starts past the end) busybox dd
	# took it for a misaligned buffer, wrote again through the page cache
	# and returned 0: the data was lost at writeback.
	scenario interop-past-end
	truncate -s 8M /tmp/pe.img
	srv map pe /tmp/pe.img >/dev/null
	kdev=""
	if echo "sessname=kpe dest_port=1234 path=ip:10.78.0.1@ip:10.78.0.1 device_path=pe" >/sys/class/rnbd-client/ctl/map_device 2>/tmp/kmap.err; then
		for _ in $(seq 50); do
			for b in /sys/block/rnbd*; do [ "$(cat $b/rnbd/mapping_path 2>/dev/null)" = pe ] && kdev=${b##*/}; done
			[ -n "$kdev" ] && break
			sleep 0.1
		done
	fi
	if [ -n "$kdev" ]; then
		# past_end P SEEK_4K FILE_SIZE: a 4 KiB O_DIRECT write at block
		# SEEK_4K fails with "No space left on device", and the backing
		# file keeps its size (nothing written behind dd's back).
		past_end() {
			local out rc
			out=$(dd if=/tmp/pat of=/dev/$kdev bs=4k count=1 seek=$2 oflag=direct 2>&1)
			rc=$?
			sync
			if [ $rc != 0 ] && echo "$out" | grep -q "No space left on device" && [ "$(stat -c %s /tmp/pe.img)" = $3 ]; then
				res $1 PASS "dd exit $rc: $(echo "$out" | head -1)"
			else
				res $1 FAIL "dd exit $rc: $(echo "$out" | head -2 | tr '\n' ' ') file $(stat -c %s /tmp/pe.img) bytes"
			fi
		}
		echo 32768 >/sys/block/$kdev/rnbd/resize
		got=$(/usr/sbin/blockdev --getsize64 /dev/$kdev)
		[ "$got" = 16777216 ] && res interop-past-end-resized PASS "16 MiB over an export of 8" || res interop-past-end-resized FAIL "$got bytes"
		past_end interop-past-end-after-resize 3072 8388608
		srv resize pe 4MiB --force >/dev/null || res interop-past-end-shrink FAIL "srv resize --force"
		past_end interop-past-end-after-shrink 1280 4194304
		# Inside the export, writes go on.
		dd if=/tmp/pat of=/dev/$kdev bs=1M count=1 seek=2 oflag=direct 2>/dev/null
		dd if=/tmp/pe.img of=/tmp/peback bs=1M skip=2 count=1 2>/dev/null
		dd if=/tmp/pat of=/tmp/pe1 bs=1M count=1 2>/dev/null
		check interop-past-end-inside cmp /tmp/pe1 /tmp/peback
		echo normal >/sys/block/$kdev/rnbd/unmap_device
	else
		res interop-past-end-map FAIL "$(cat /tmp/kmap.err) $(dmesg | tail -5 | tr '\n' ' ')"
	fi
	srv unmap pe --force >/dev/null
	rm -f /tmp/pe.img /tmp/peback /tmp/pe1

	# A device closed by its server's administrator stays closed across
	# our client's size polls (1 s here) until it is remapped: against
	# the kernel's rnbd_server (force_close in its sysfs; it hands the
	# same device id back to the next OPEN, so the poll's OPEN used to
	# reopen the device and its IO went on) and against ours.
	# close_sticks P SESS DEVPATH PORT CLOSE OPEN_ON_SERVER: CLOSE closes
	# the device on the server; OPEN_ON_SERVER succeeds while the server
	# has it open for the session.
	close_sticks() {
		local p=$1 sess=$2 out dev dn st i
		out=$(cli map --sessname $sess --path ip:10.78.0.1@ip:10.78.0.1 --dest-port $4 --device-path $3 --transport rdma --as nbd 2>&1)
		dev=$(echo "$out" | awk '/mapped:/ {print $3}')
		if [ ! -b "$dev" ]; then
			res $p-map FAIL "$out"
			return
		fi
		dn=$(cli device list --format csv --fields devname,devpath 2>/dev/null | awk -F, -v d="$dev" '$2 == d {print $1}')
		state() { cli device list --format csv --fields devname,state 2>/dev/null | awk -F, -v d="$dn" '$1 == d {print $2}'; }
		dd if=/tmp/pat of="$dev" bs=1M count=1 seek=2 oflag=direct 2>/dev/null
		dd if=/tmp/pat of=/tmp/cs1 bs=1M count=1 2>/dev/null
		$5
		for i in $(seq 100); do [ "$(state)" = "closed by server" ] && break; sleep 0.1; done
		st=$(state)
		[ "$st" = "closed by server" ] && res $p-seen PASS "in ${i}00 ms" || res $p-seen FAIL "state $st"
		sleep 4 # four size polls
		st=$(state)
		if [ "$st" = "closed by server" ] && ! $6; then res $p-stays PASS "$st"; else res $p-stays FAIL "state $st, open on the server: $($6 && echo yes || echo no)"; fi
		dd if="$dev" of=/dev/null bs=4k count=1 iflag=direct 2>/dev/null && res $p-io-fails FAIL "a read succeeded" || res $p-io-fails PASS ""
		if cli remap "$dn" >/dev/null 2>&1 && [ "$(state)" = open ] && $6; then
			dd if="$dev" of=/tmp/cs2 bs=1M count=1 skip=2 iflag=direct 2>/dev/null
			check $p-remap cmp /tmp/cs1 /tmp/cs2
		else
			res $p-remap FAIL "state $(state)"
		fi
		cli unmap "$dn" >/dev/null 2>&1
		rm -f /tmp/cs1 /tmp/cs2
	}
	scenario interop-kernel-server-close
	kclose() { echo 1 >/sys/class/rnbd-server/ctl/devices/ram0/sessions/kcs/force_close; }
	kopen() { [ -e /sys/class/rnbd-server/ctl/devices/ram0/sessions/kcs ]; }
	close_sticks interop-kernel-server-close kcs ram0 1235 kclose kopen
	scenario interop-server-close
	truncate -s 8M /tmp/cs.img
	srv map cs /tmp/cs.img >/dev/null
	rclose() { srv device close cs --session rcs >/dev/null; }
	ropen() { srv device list --format csv --fields sessname 2>/dev/null | grep -qx rcs; }
	close_sticks interop-server-close rcs cs 1234 rclose ropen
	srv unmap cs --force >/dev/null
	rm -f /tmp/cs.img

	# The kernel's client with a filesystem on our exports: one with a
	# write cache (the default) and one made --write-through. fsync,
	# mkfs, files, fsck, remount; the server counts every flush the
	# kernel completed, and none where there is no cache to flush; the
	# backing file itself is a clean filesystem afterwards.
	for wc in back through; do
		scenario interop-kernel-client-fs-$wc
		p=interop-kernel-client-fs-$wc exp=kfs$wc
		truncate -s 64M /tmp/$exp.img
		if [ $wc = back ]; then srv map $exp /tmp/$exp.img >/dev/null; else srv map $exp /tmp/$exp.img --write-through >/dev/null; fi
		kdev=""
		if echo "sessname=kfs-$wc dest_port=1234 path=ip:10.78.0.1@ip:10.78.0.1 device_path=$exp" >/sys/class/rnbd-client/ctl/map_device 2>/tmp/kmap.err; then
			for _ in $(seq 50); do
				for b in /sys/block/rnbd*; do [ "$(cat $b/rnbd/mapping_path 2>/dev/null)" = $exp ] && kdev=${b##*/}; done
				[ -n "$kdev" ] && break
				sleep 0.1
			done
		fi
		if [ -z "$kdev" ]; then
			res $p-map FAIL "$(cat /tmp/kmap.err) $(dmesg | tail -5 | tr '\n' ' ')"
			continue
		fi
		got=$(cat /sys/block/$kdev/queue/write_cache)
		[ "$got" = "write $wc" ] && res $p-write-cache PASS "$got" || res $p-write-cache FAIL "$got, want write $wc"
		check $p-dd-fsync dd if=/tmp/pat of=/dev/$kdev bs=1M count=4 conv=fsync
		fs_check $p /dev/$kdev
		kf=$(flushes $kdev) sf=$(counter $exp flush_cnt)
		if [ $wc = back ]; then
			[ "${kf:-0}" -gt 0 ] && [ "$sf" = "$kf" ] && res $p-flushes-counted PASS "kernel completed $kf, server flushed $sf" ||
				res $p-flushes-counted FAIL "kernel completed $kf, server flushed $sf"
		else
			[ "$kf" = 0 ] && [ "$sf" = 0 ] && res $p-no-flushes PASS "" || res $p-no-flushes FAIL "kernel $kf, server $sf"
		fi
		echo normal >/sys/block/$kdev/rnbd/unmap_device
		check $p-backend-fsck /usr/sbin/e2fsck -fn /tmp/$exp.img
		srv unmap $exp >/dev/null
		rm -f /tmp/$exp.img
	done

	# Our client with a filesystem on the kernel's rnbd_server, as
	# /dev/nbdN and as /dev/ublkbN, exporting a loop device: with its
	# write cache on, then off. The loop device counts the flushes that
	# reached it, and is a clean filesystem at the end.
	truncate -s 64M /tmp/kloop.img
	if losetup /dev/loop0 /tmp/kloop.img; then
		for wc in back through; do
			echo "write $wc" >/sys/block/loop0/queue/write_cache
			for as in nbd ublk; do
				scenario interop-kernel-server-fs-$as-$wc
				p=interop-kernel-server-fs-$as-$wc
				out=$(cli map --sessname kfs$as$wc --path ip:10.78.0.1@ip:10.78.0.1 --dest-port 1235 --device-path loop0 --transport rdma --as $as 2>&1)
				dev=$(echo "$out" | awk '/mapped:/ {print $3}')
				if [ ! -b "$dev" ]; then
					res $p-map FAIL "$out $(dmesg | tail -5 | tr '\n' ' ')"
					continue
				fi
				got=$(cat /sys/block/${dev#/dev/}/queue/write_cache)
				[ "$got" = "write $wc" ] && res $p-write-cache PASS "$got" || res $p-write-cache FAIL "$got, want write $wc"
				f0=$(flushes loop0)
				check $p-dd-fsync dd if=/tmp/pat of="$dev" bs=1M count=4 conv=fsync
				fs_check $p "$dev"
				f1=$(flushes loop0)
				if [ $wc = back ]; then
					[ "$f1" -gt "$f0" ] && res $p-flushes-reached PASS "loop0 flushes $f0 -> $f1" || res $p-flushes-reached FAIL "loop0 flushes $f0 -> $f1"
				else
					[ "$f1" = "$f0" ] && res $p-no-flushes PASS "" || res $p-no-flushes FAIL "loop0 flushes $f0 -> $f1"
				fi
				check $p-unmap cli unmap "$(devname)"
			done
		done
		check interop-kernel-server-backend-fsck /usr/sbin/e2fsck -fn /dev/loop0
		# Unmapping from the kernel's server is a normal close, not a
		# lost connection (the kernel hangs up on every connection of a
		# path when one goes), in all of the mappings above.
		lost=$(tail -n +$((log0 + 1)) /tmp/client.log | grep -E 'level=(error|warning).*connection lost')
		[ -z "$lost" ] && res interop-unmap-quiet PASS "" || res interop-unmap-quiet FAIL "$(echo "$lost" | tail -1)"
		losetup -d /dev/loop0
	else
		res interop-loop FAIL "no loop device"
	fi
	rm -f /tmp/kloop.img

	# A mirror over the kernel's rnbd_server: two legs and a witness,
	# each a loop device it exports, each through a session of its own
	# (the kernel has one rnbd_server, so the legs' "storage nodes" are
	# three of its addresses: leg 1 by 10.78.0.1, leg 2 by 10.78.0.2, the
	# witness by 10.78.0.3). The mirror's metadata is ordinary RNBD IO to them. A
	# filesystem on it; leg 2's path cut silently under a writer (IO goes
	# on, the leg stale), then back (the client dials it again, a resync
	# from the bitmap); leg 1's device closed by the kernel's server
	# (force_close) under IO, and back the same way; at the end both
	# legs' data regions are equal and a clean filesystem.
	scenario interop-kernel-mirror
	kml_ok=1
	ip addr add 10.78.0.3/24 dev rxenet || kml_ok=0
	for n in 1 2 3; do
		sz=72M
		[ $n = 3 ] && sz=1M
		truncate -s $sz /tmp/kml$n.img && losetup /dev/loop$n /tmp/kml$n.img || kml_ok=0
	done
	kleg() { echo "sessname=kml$1 path=ip:10.78.0.$2@ip:10.78.0.$2 dest_port=1235 device_path=loop$1"; }
	kmstates() { cli device show "$(devname)" --format csv --fields legs 2>/dev/null | tail -1 | grep -o "state=[^,\"]*" | cut -d= -f2 | tr "\n" / ; }
	kmstate() { cli device show "$(devname)" --format csv --fields state 2>/dev/null | tail -1; }
	kmlog() { # the client's mirror lines; the kernel's blocked tasks and last lines, its CM IDs and its server's sessions
		grep -a 'mirror' /tmp/client.log | tail -30 | sed 's/^/DETAIL client: /'
		echo w >/proc/sysrq-trigger 2>/dev/null # the stacks of tasks in D state, into dmesg
		dmesg | grep -v 'I/O error\|Buffer I/O\|lost async page' | tail -80 | sed 's/^/DETAIL kernel: /'
		/usr/bin/rdma res show cm_id 2>&1 | sed 's/^/DETAIL cm_id: /'
		for p in /sys/class/rtrs-server/*/paths/*; do
			[ -d "$p" ] && echo "DETAIL rtrs-server: ${p#/sys/class/rtrs-server/} $(cat $p/hca_name $p/hca_port 2>/dev/null | tr '\n' ' ')"
		done
	}
	kmwait() { # STATE: up to 60 s for the mirror's state
		for _ in $(seq 600); do [ "$(kmstate)" = "$1" ] && return 0; sleep 0.1; done
		return 1
	}
	out=$(cli map --mirror kmir --create --leg "$(kleg 1 1)" --leg "$(kleg 2 2)" --witness "$(kleg 3 3)" \
		--transport rdma --as ublk 2>&1)
	dev=$(echo "$out" | awk '/mapped:/ {print $3}')
	if [ $kml_ok = 1 ] && [ -b "$dev" ]; then
		res interop-kernel-mirror-map PASS "$dev, legs $(kmstates)"
		size=$(/usr/sbin/blockdev --getsize64 "$dev")
		[ "$size" = "$(mb 64)" ] && res interop-kernel-mirror-size PASS "$size bytes" || res interop-kernel-mirror-size FAIL "$size bytes"
		fs_check interop-kernel-mirror "$dev"

		scenario interop-kernel-mirror-path-cut
		# The cut falls between two of the writer's requests: the writer
		# (under_io's $ddpid, and its dd) stops for half a second, so
		# nothing of leg 2 is in flight, and goes on once the address is
		# gone. A cut at the instant the kernel's rtrs_server answers a
		# request kills soft-RoCE's CM on 6.12: the server's QP fails at
		# once, it closes the path, and the CM message it sends from the
		# address just deleted puts rdma_rxe's GSI QP (QP 1) in the error
		# state for good, so no connection to any address of rxe0 is
		# made again (seen here 1 cut in 7 and 1 in 12; docs/testing.md).
		# gsi_ok below tells that case by name.
		kml_cut() {
			local d
			kill -STOP "$ddpid"
			d=$(pidof dd)
			[ -z "$d" ] || kill -STOP $d
			sleep 0.5
			ip addr del 10.78.0.2/24 dev rxenet
			kill -CONT "$ddpid" $d
		}
		t0=$(cut -d' ' -f1 /proc/uptime)
		under_io interop-kernel-mirror-path-cut "$dev" 16 kml_cut
		t1=$(cut -d' ' -f1 /proc/uptime)
		st=$(kmstate)
		[ "$st" = degraded ] && res interop-kernel-mirror-degraded PASS "writer done in $(awk "BEGIN {print $t1 - $t0}") s, legs $(kmstates)" ||
			res interop-kernel-mirror-degraded FAIL "state $st, legs $(kmstates)"
		gsi_ok interop-kernel-mirror-path-cut-gsi
		ip addr add 10.78.0.2/24 dev rxenet
		kmwait open && res interop-kernel-mirror-path-back PASS "legs $(kmstates)" ||
			{ res interop-kernel-mirror-path-back FAIL "state $(kmstate), legs $(kmstates)"; kmlog; }
		dd if="$dev" of=/tmp/backio bs=1M skip=16 count=32 iflag=direct 2>/dev/null
		check interop-kernel-mirror-path-back-data cmp /tmp/patio /tmp/backio

		scenario interop-kernel-mirror-force-close
		kml_close() { echo 1 >/sys/class/rnbd-server/ctl/devices/loop1/sessions/kml1/force_close; }
		under_io interop-kernel-mirror-force-close "$dev" 24 kml_close
		kmwait open && res interop-kernel-mirror-close-back PASS "legs $(kmstates)" ||
			{ res interop-kernel-mirror-close-back FAIL "state $(kmstate), legs $(kmstates)"; kmlog; }
		fs_check interop-kernel-mirror-after "$dev"
		check interop-kernel-mirror-unmap cli unmap "$(devname)"
		# The legs' data (past the mirror's 8 MiB of metadata) is the
		# same, and a filesystem e2fsck finds clean.
		check interop-kernel-mirror-legs-equal cmp /tmp/kml1.img /tmp/kml2.img 8388608 8388608
		if losetup -o 8388608 /dev/loop4 /tmp/kml2.img; then
			check interop-kernel-mirror-leg-fsck /usr/sbin/e2fsck -fn /dev/loop4
			losetup -d /dev/loop4
		fi
	else
		res interop-kernel-mirror-map FAIL "$out $(dmesg | tail -5 | tr '\n' ' ')"
	fi
	grep -h "mirror" /tmp/client.log | grep kmir | tail -8 | sed 's/^/DETAIL client: /'
	for n in 1 2 3; do losetup -d /dev/loop$n 2>/dev/null; done
	ip addr del 10.78.0.3/24 dev rxenet 2>/dev/null
	rm -f /tmp/kml?.img

	# A mirror over two kernels' rnbd_servers: this one's and the peer's
	# (a second guest, test/vm/run.sh VM_PEER, on the NIC they share).
	# Leg 1 is this kernel's loop5 (by 10.78.0.5), leg 2 the peer's loop1
	# (10.79.0.1 to 10.79.0.2), the witness this kernel's loop6 (by
	# 10.78.0.6); a member's path is cut by taking its client address
	# away (silent: no link goes down). TestMirrorOnKernelPair (test/e2e)
	# runs a seeded fault schedule on it, every read judged by the
	# history checker, with the stale-only-leg case, which must refuse.
	if grep -q 'vmtest\.peer=1' /proc/cmdline; then
		scenario interop-kernel-pair
		kp_ok=1
		ip link set eth0 up && ip addr add 10.79.0.1/24 dev eth0 && /usr/bin/rdma link add rxe1 type rxe netdev eth0 || kp_ok=0
		ip addr add 10.78.0.5/24 dev rxenet && ip addr add 10.78.0.6/24 dev rxenet || kp_ok=0
		truncate -s 72M /tmp/kp1.img && losetup /dev/loop5 /tmp/kp1.img || kp_ok=0
		truncate -s 1M /tmp/kpw.img && losetup /dev/loop6 /tmp/kpw.img || kp_ok=0
		for _ in $(seq 90); do ping -c1 -W1 10.79.0.2 >/dev/null 2>&1 && break; sleep 1; done
		if ping -c1 -W2 10.79.0.2 >/dev/null 2>&1; then
			res interop-kernel-pair-peer PASS ""
		else
			res interop-kernel-pair-peer FAIL "the peer (10.79.0.2) does not answer"
			kp_ok=0
		fi
		kpm() { # ADDR DEV SERVER DEVICE_PATH [witness]
			printf '{"path": "ip:%s@ip:%s", "device_path": "%s", "port": 1235, "cut": "ip addr del %s/24 dev %s", "mend": "ip addr add %s/24 dev %s"%s}' \
				"$1" "$3" "$4" "$1" "$2" "$1" "$2" "${5:+, \"witness\": true}"
		}
		if [ $kp_ok = 1 ]; then
			# The wire first: the kernel's own client maps the peer's
			# device (kernel to kernel over the NIC), then ours does.
			kdev=""
			if echo "sessname=kpk dest_port=1235 path=ip:10.79.0.1@ip:10.79.0.2 device_path=loop1 access_mode=ro" >/sys/class/rnbd-client/ctl/map_device 2>/tmp/kmap.err; then
				for b in /sys/block/rnbd*; do [ "$(cat $b/rnbd/session 2>/dev/null)" = kpk ] && kdev=${b##*/}; done
				res interop-kernel-pair-kernel-client PASS "$kdev"
			else
				res interop-kernel-pair-kernel-client FAIL "$(cat /tmp/kmap.err) $(dmesg | tail -4 | tr '\n' ' ')"
				/usr/bin/rdma link 2>&1 | sed 's/^/DETAIL rdma link: /'
				ip addr show eth0 2>&1 | sed 's/^/DETAIL eth0: /'
			fi
			[ -z "$kdev" ] || echo normal >/sys/block/$kdev/rnbd/unmap_device
			out=$(cli map --sessname kpprobe --path ip:10.79.0.1@ip:10.79.0.2 --dest-port 1235 --device-path loop1 --access-mode ro --transport rdma --as ublk 2>&1)
			if echo "$out" | grep -q 'mapped:'; then
				res interop-kernel-pair-client PASS "$out"
				check interop-kernel-pair-client-unmap cli unmap "$(echo "$out" | awk '/mapped:/ {print $1}')"
			else
				res interop-kernel-pair-client FAIL "$out"
			fi
			export RNBD_E2E_BIN=/bin
			export RNBD_KERNEL_PAIR="[$(kpm 10.78.0.5 rxenet 10.78.0.5 loop5), $(kpm 10.79.0.1 eth0 10.79.0.2 loop1), $(kpm 10.78.0.6 rxenet 10.78.0.6 loop6 w)]"
			gotest_timeout=900
			gotest interop-kernel-pair /bin/e2e.test -test.run '^TestMirrorOnKernelPair$' -test.timeout 840s
			gsi_ok interop-kernel-pair-gsi-rxe0 rxe0
			gsi_ok interop-kernel-pair-gsi-rxe1 rxe1
			unset gotest_timeout RNBD_KERNEL_PAIR
			# Its own lines on a failure (the client daemon's log,
			# which follows them, fills gotest's DETAIL tail).
			grep -q '^--- FAIL' /tmp/interop-kernel-pair.out &&
				grep -av 'level=\|^=== ' /tmp/interop-kernel-pair.out | tail -60 | sed 's/^/DETAIL pair: /'
			grep -h 'seed [0-9]*: ' /tmp/interop-kernel-pair.out | sed 's/^ *[^ ]*: /NOTE interop-kernel-pair: /'
		fi
		for n in 5 6; do losetup -d /dev/loop$n 2>/dev/null; done
		ip addr del 10.78.0.5/24 dev rxenet 2>/dev/null
		ip addr del 10.78.0.6/24 dev rxenet 2>/dev/null
		rm -f /tmp/kp1.img /tmp/kpw.img
	fi

	# Speed of the four pairings on the one soft-RoCE device, in one
	# boot: kernel client and server (kk), kernel client against
	# rnbd-server (kr), rnbd-client against the kernel's server (rk),
	# ours against ours (rr); each on a RAM disk of its server. The CPU
	# is emulated: only the ratios to kk mean anything. rnbd-server is
	# measured with always_invalidate on (the default, as the kernel's;
	# by memory windows), by re-registration, and off. Reported as TPUT
	# lines; a pairing that cannot be mapped fails. Only when named
	# (VM_ONLY=interop-perf, which runs the interop part before it): its
	# figures are measured, not judged, and take four and a half
	# minutes of the tier.
	if named interop-perf; then
		scenario interop-perf
		srv map pram /dev/ram1 >/dev/null || res interop-perf-export FAIL "srv map /dev/ram1"
		perf_fio() { # device rw bs iodepth: prints IOPS
			fio --name=p --filename="$1" --direct=1 --ioengine=libaio --rw=$2 --bs=$3 --iodepth=$4 \
				--runtime=5 --time_based --output-format=terse 2>/dev/null | awk -F';' '{print $8}'
		}
		kmap() { # sessname port device: the kernel client's /dev/rnbdN
			local d=""
			echo "sessname=$1 dest_port=$2 path=ip:10.78.0.1@ip:10.78.0.1 device_path=$3" >/sys/class/rnbd-client/ctl/map_device 2>/dev/null || return 1
			for _ in $(seq 50); do
				for b in /sys/block/rnbd*; do [ "$(cat $b/rnbd/session 2>/dev/null)" = "$1" ] && d=/dev/${b##*/}; done
				[ -n "$d" ] && break
				sleep 0.1
			done
			echo "$d"
		}
		kunmap() { echo normal >/sys/block/${1#/dev/}/rnbd/unmap_device; }
		umap() { # sessname port device: our client's /dev/nbdN
			cli map --sessname $1 --path ip:10.78.0.1@ip:10.78.0.1 --dest-port $2 --device-path $3 --transport rdma --as nbd 2>/dev/null |
				awk '/mapped:/ {print $3}'
		}
		# One emulated run of a few seconds moves by a factor of two from
		# one boot or mapping to the next: every pairing is measured in
		# perf_rounds rounds, mapped afresh in each, the pairings
		# interleaved; the medians are reported, with each round's figure.
		perf_rounds=3
		perf_pair() { # name device: one round of a pairing
			if [ ! -b "$2" ]; then
				eval "perf_${1}_fail=1"
				return
			fi
			local a b
			a=$(perf_fio $2 randread 4k 16)
			b=$(perf_fio $2 read 1M 4)
			[ -n "$a" ] && [ -n "$b" ] || eval "perf_${1}_fail=1"
			eval "perf_${1}_4k=\"\${perf_${1}_4k:-} $a\" perf_${1}_1m=\"\${perf_${1}_1m:-} $b\""
		}
		restart_server() { # extra flags of rnbd-server
			stop_server
			srv_extra="$*"
			start_server || res server-restart FAIL "no control socket"
			srv map pram /dev/ram1 >/dev/null 2>&1
		}
		for r in $(seq $perf_rounds); do
			d=$(kmap pkk$r 1235 ram0); perf_pair kk "$d"; [ -b "$d" ] && kunmap "$d"
			d=$(kmap pkr$r 1234 pram); perf_pair kr "$d"; [ -b "$d" ] && kunmap "$d"
			d=$(umap prk$r 1235 ram0); perf_pair rk "$d"; [ -b "$d" ] && cli unmap "$(devname)" >/dev/null
			d=$(umap prr$r 1234 pram); perf_pair rr "$d"; [ -b "$d" ] && cli unmap "$(devname)" >/dev/null
			restart_server --invalidate-by=registration
			d=$(kmap pkrr$r 1234 pram); perf_pair kr_reg "$d"; [ -b "$d" ] && kunmap "$d"
			restart_server --always-invalidate=false
			d=$(kmap pkrn$r 1234 pram); perf_pair kr_noinv "$d"; [ -b "$d" ] && kunmap "$d"
			d=$(umap prrn$r 1234 pram); perf_pair rr_noinv "$d"; [ -b "$d" ] && cli unmap "$(devname)" >/dev/null
			restart_server
		done
		# The middle figure; of two (a round failed), the lower.
		median() { echo "$@" | tr ' ' '\n' | grep -v '^$' | sort -n | awk '{v[NR] = $1} END { if (NR) print v[int((NR + 1) / 2)] }'; }
		ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else printf "?" }'; }
		for p in kk kr rk rr kr_reg kr_noinv rr_noinv; do
			eval "f=\${perf_${p}_fail:-} a=\${perf_${p}_4k:-} b=\${perf_${p}_1m:-}"
			if [ -n "$f" ]; then
				res interop-perf-$p FAIL "not mapped, or no figure, in every round"
			else
				res interop-perf-$p PASS "4k${a} IOPS, 1M${b} IOPS"
			fi
			eval "med_${p}_4k=\$(median \$a) med_${p}_1m=\$(median \$b)"
		done
		for w in 4k 1m; do
			eval "kk=\$med_kk_$w all=\$perf_kk_$w"
			line=""
			for p in kr rk rr kr_reg kr_noinv rr_noinv; do
				eval "v=\$med_${p}_$w all=\$perf_${p}_$w"
				line="$line $p ${v:-?} ($(ratio "$v" "$kk")x) [${all# }]"
			done
			eval "all=\$perf_kk_$w"
			what="4 KiB random read QD16"
			[ $w = 1m ] && what="1 MiB sequential read QD4"
			echo "TPUT interop-perf $what, IOPS (emulated, median of $perf_rounds rounds [each round]): kk ${kk:-?} [${all# }]$line"
		done
		eval "inv=\$med_kr_4k reg=\$med_kr_reg_4k noinv=\$med_kr_noinv_4k"
		echo "TPUT interop-perf always_invalidate cost at 4k, kernel client -> rnbd-server (medians): on/off by windows $(ratio "$inv" "$noinv")x, by registration $(ratio "$reg" "$noinv")x"
	fi
fi

# go-nbd's client (github.com/pojntfx/go-nbd v0.3.2, through tools/gonbd
# attach), a client we did not write, on rnbd-client's NBD socket: it
# negotiates (NBD_OPT_GO), attaches a free /dev/nbdN with the ioctls
# (NBD_SET_SOCK on one connection, NBD_DO_IT), and the kernel's requests
# reach our server through it. The data reads back and is in the backing
# file, the mapping is busy while attached, fio verifies, and SIGINT
# disconnects (NBD_DISCONNECT) with exit 0.
if want gonbd; then
	scenario gonbd-client
	truncate -s 64M /tmp/gonbd.img
	srv map gonbd /tmp/gonbd.img >/dev/null
	out=$(cli map --sessname gn --path ip:127.0.0.1 --device-path gonbd --as socket:/tmp/gonbd.sock 2>&1)
	gname=$(echo "$out" | awk '/mapped:/ {print $1}')
	gdev=""
	for i in $(seq 0 15); do
		[ -b /dev/nbd$i ] && [ "$(cat /sys/block/nbd$i/size)" = 0 ] && [ ! -e /sys/block/nbd$i/pid ] && gdev=/dev/nbd$i && break
	done
	if [ ! -S /tmp/gonbd.sock ] || [ -z "$gdev" ]; then
		res gonbd-attach FAIL "socket: $out; free nbd device: ${gdev:-none}"
	else
		/bin/gonbd attach -connect unix:/tmp/gonbd.sock -export gonbd -device $gdev >/tmp/gonbd.log 2>&1 &
		gpid=$!
		for _ in $(seq 100); do [ "$(cat /sys/block/${gdev#/dev/}/size)" != 0 ] && break; sleep 0.1; done
		size=$(/usr/sbin/blockdev --getsize64 $gdev)
		if [ "$size" = "$(stat -c %s /tmp/gonbd.img)" ]; then
			res gonbd-attach PASS "$gdev, $size bytes"
			dd if=/tmp/pat of=$gdev bs=1M seek=8 oflag=direct 2>/dev/null
			dd if=$gdev of=/tmp/gback bs=1M skip=8 count=16 iflag=direct 2>/dev/null
			check gonbd-direct-io cmp /tmp/pat /tmp/gback
			dd if=/tmp/gonbd.img of=/tmp/gfile bs=1M skip=8 count=16 2>/dev/null
			check gonbd-on-backend cmp /tmp/pat /tmp/gfile
			# Served by our socket: the mapping has go-nbd's connection.
			out=$(cli unmap "$gname" 2>&1) && res gonbd-busy FAIL "unmapped under go-nbd's connection" ||
				{ case $out in *"NBD connection"*) res gonbd-busy PASS "$out" ;; *) res gonbd-busy FAIL "$out" ;; esac; }
			check gonbd-fio-verify fio --name=v --filename="$gdev" --direct=1 --ioengine=libaio --rw=randwrite \
				--bsrange=4k-64k --size=32M --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=0
			throughput gonbd "$gdev"
		else
			res gonbd-attach FAIL "$gdev: $size bytes; $(tail -3 /tmp/gonbd.log)"
		fi
		# Which thread sleeps in NBD_DO_IT (ioctl, 16): the SIGINT must not
		# land on it (tools/gonbd says why).
		for t in /proc/$gpid/task/*; do
			case "$(cat $t/syscall 2>/dev/null)" in "16 "*)
				echo "NOTE gonbd: a thread in ioctl: ${t##*/}, the main thread: $gpid" ;;
			esac
		done
		kill -INT $gpid
		# Exited: gone, or a zombie (busybox kill -0 succeeds on zombies).
		for _ in $(seq 100); do grep -q ') Z' /proc/$gpid/stat 2>/dev/null || [ ! -e /proc/$gpid ] && break; sleep 0.1; done
		if grep -q ') Z' /proc/$gpid/stat 2>/dev/null || [ ! -e /proc/$gpid ]; then
			wait $gpid
			rc=$?
			[ $rc = 0 ] && [ "$(cat /sys/block/${gdev#/dev/}/size)" = 0 ] && res gonbd-disconnect PASS "" ||
				res gonbd-disconnect FAIL "exit $rc, $(cat /sys/block/${gdev#/dev/}/size) sectors left: $(tail -1 /tmp/gonbd.log); $(dmesg | grep -w ${gdev#/dev/} | tail -2 | tr '\n' ' ')"
		else
			kill -9 $gpid
			res gonbd-disconnect FAIL "still running 10 s after SIGINT"
		fi
		grep -v '^$' /tmp/gonbd.log | sed 's/^/NOTE gonbd: /'
	fi
	check gonbd-unmap cli unmap "$gname"
	srv unmap gonbd >/dev/null 2>&1
	rm -f /tmp/gonbd.img
fi
want nbd || want ublk || finish

# 1. /dev/nbdN: map with the default --as (nbd, since the module is
# loaded) through generic netlink, one socket per CPU.
scenario nbd-map-io
out=$(cli map --sessname vm --path ip:127.0.0.1 --device-path disk0 2>/dev/null)
dev=$(echo "$out" | awk '/mapped:/ {print $3}')
case $dev in /dev/nbd*) res map-as-nbd PASS "$dev" ;; *) res map-as-nbd FAIL "$out"; finish ;; esac
b=/sys/block/${dev#/dev/}
for _ in $(seq 50); do [ "$(cat $b/size)" != 0 ] && break; sleep 0.1; done
nq=$(ls $b/mq | wc -l)
[ "$nq" = "$(grep -c ^processor /proc/cpuinfo)" ] && res queue-per-cpu PASS "$nq" || res queue-per-cpu FAIL "$nq queues"
[ "$(cat $b/backend 2>/dev/null)" = rnbd:vm/disk0 ] && res backend-identifier PASS "" || res backend-identifier FAIL "$(cat $b/backend 2>&1)"
# Requests up to the daemon's 1 MiB NBD buffers, within the driver's limit.
msk=$(cat $b/queue/max_sectors_kb) hwk=$(cat $b/queue/max_hw_sectors_kb)
[ "$msk" = "$((hwk < 1024 ? hwk : 1024))" ] && res nbd-max-sectors PASS "$msk KiB (hw $hwk)" || res nbd-max-sectors FAIL "$msk KiB (hw $hwk)"
stable nbd-stable-name vm disk0 "$dev"
basic nbd "$dev" disk0 /tmp/disk0.img 4

# 2. restart of the client daemon while the device is idle: the same
# device comes back (RECONFIGURE) with the same data.
scenario nbd-restart-idle
restart_client
# The pattern's last 8 MiB (the discard took the start).
dd if=/tmp/pat of=/tmp/pat2 bs=1M skip=8 count=8 2>/dev/null
dd if="$dev" of=/tmp/back2 bs=1M skip=12 count=8 iflag=direct 2>/dev/null
check nbd-restart-reconfigure cmp /tmp/pat2 /tmp/back2
[ "$(devpath)" = "$dev" ] && res nbd-restart-same-device PASS "" || res nbd-restart-same-device FAIL "$(cli device list 2>&1)"
stable nbd-restart-stable-name vm disk0 "$dev"

# 3. a filesystem, then unmap under the mount.
scenario nbd-fs
fs nbd "$dev"
[ "$(cat $b/size)" = 0 ] && res nbd-disconnected PASS "" || res nbd-disconnected FAIL "$(cat $b/size) sectors"
[ ! -L /dev/rnbd/vm/disk0 ] && [ ! -d /dev/rnbd/vm ] && res nbd-stable-name-gone PASS "" || res nbd-stable-name-gone FAIL "$(ls -l /dev/rnbd/vm 2>&1)"

# 4. two paths (loopback and a dummy interface of the guest), fio verify.
scenario nbd-fio-two-paths
ip link add mp0 type dummy && ip addr add 10.77.0.1/24 dev mp0 && ip link set mp0 up
stop_server
listen2="--listen tcp://10.77.0.1:1234"
start_server || res server-restart FAIL "no control socket"
out=$(cli map --sessname mp --path ip:127.0.0.1 --path ip:10.77.0.1 --device-path disk1 2>/dev/null)
dev=$(echo "$out" | awk '/mapped:/ {print $3}')
case $dev in /dev/nbd*) res map-two-paths PASS "$dev" ;; *) res map-two-paths FAIL "$out"; finish ;; esac
throughput nbd "$dev"
resized nbd "$dev" disk1 $(mb 192)
check nbd-fio-verify fio --name=v --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite \
	--bsrange=4k-64k --size=32M --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=0

# 5. kill -9 of the server under IO, started again a second later, within
# no_path_timeout: the IO waits in the client and completes.
scenario nbd-server-kill
server_bounce() { stop_server -9; sleep 1; start_server || res server-restart FAIL "no control socket"; }
under_io nbd-server-kill "$dev" 0 server_bounce

# 6. one of the two paths cut under IO: no error; the client saw it.
scenario nbd-path-cut
path_cut() { ip addr del 10.77.0.1/24 dev mp0; ip link set mp0 down; }
under_io nbd-path-cut "$dev" 32 path_cut
st=$(cli path list --format csv --fields dst_addr,state,reconnects.successful,reconnects.failed 2>/dev/null | grep 10.77.0.1)
case $st in *,connected,0,0 | "") res nbd-path-cut-seen FAIL "$st" ;; *) res nbd-path-cut-seen PASS "$st" ;; esac
ip link set mp0 up
ip addr add 10.77.0.1/24 dev mp0

# 7. the client daemon stopped (SIGTERM) and started again while the
# device is busy: the kernel holds the IO (dead_conn_timeout), the new
# daemon RECONFIGUREs the same device, the writer never sees an error.
scenario nbd-restart-busy
under_io nbd-restart "$dev" 64 restart_client
[ "$(devpath)" = "$dev" ] && res nbd-restart-busy-same-device PASS "" || res nbd-restart-busy-same-device FAIL "$(cli device list 2>&1)"

# 7b. the client daemon killed (SIGKILL) under 4 KiB writes at queue
# depth 16: the requests the kernel had sent whole on the dead sockets
# wait there until nbd_io_timeout (38 s here), then go out again on the
# new daemon's. The new daemon must answer meanwhile, its mappings
# restored — a write to the device's queue attributes in sysfs would
# wait for those requests (the kernel freezes the queue for it) — take
# the same device back, and fio sees no error and reads back what it
# wrote.
scenario nbd-crash-busy
fio --name=k --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k --size=32M --iodepth=16 \
	--verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=0 >/tmp/fiok.out 2>&1 &
fpid=$!
sleep 1
kill -0 $fpid 2>/dev/null && during=1 || during=0
t0=$(cut -d. -f1 /proc/uptime)
stop_client -9
if start_client && timeout 10 /bin/rnbd-client --socket /tmp/c.sock device list >/dev/null 2>&1; then
	res nbd-client-kill-restart PASS "answering in $(($(cut -d. -f1 /proc/uptime) - t0)) s"
else
	res nbd-client-kill-restart FAIL "not answering in 10 s: $(tail -3 /tmp/client.log | tr '\n' ' ')"
	echo w >/proc/sysrq-trigger
fi
if wait $fpid && [ $during = 1 ]; then res nbd-client-kill-fio-verify PASS ""; else res nbd-client-kill-fio-verify FAIL "during=$during $(tail -3 /tmp/fiok.out | tr '\n' ' ')"; fi
[ "$(devpath)" = "$dev" ] && res nbd-client-kill-same-device PASS "" || res nbd-client-kill-same-device FAIL "$(cli device list 2>&1)"

# 8. BACKEND_IDENTIFIER: a mapping that now names another export must not
# take the old device back. The state file is edited while the daemon is
# down; the kernel refuses the RECONFIGURE and a new device is attached.
scenario nbd-backend-id
stop_client
sed -i 's/"device_path": *"disk1"/"device_path":"disk0"/' /tmp/c.json
start_client || res client-restart FAIL "no control socket"
new=$(devpath)
case $new in /dev/nbd*) [ "$new" != "$dev" ] && res nbd-backend-id-refused PASS "$dev kept, $new attached" || res nbd-backend-id-refused FAIL "$new" ;;
*) res nbd-backend-id-refused FAIL "$(cli device list 2>&1)" ;; esac
why=$(grep "could not take the device back" /tmp/client.log | tail -1 | sed -n 's/.*error="\([^"]*\)".*/\1/p')
[ -n "$why" ] && res nbd-backend-id-logged PASS "$why" || res nbd-backend-id-logged FAIL ""
check nbd-unmap-two-paths cli unmap "$(devname)"

# 9. /dev/ublkbN: --as ublk over the same session machinery.
scenario ublk-map-io
out=$(cli map --sessname ub --path ip:127.0.0.1 --path ip:10.77.0.1 --device-path disk2 --as ublk 2>&1)
dev=$(echo "$out" | awk '/mapped:/ {print $3}')
case $dev in /dev/ublkb*) res ublk-map PASS "$dev" ;; *) res ublk-map FAIL "$out"; finish ;; esac
stable ublk-stable-name ub disk2 "$dev"
# The device takes requests up to ublk_max_io_kb (default 512).
hwk=$(cat /sys/block/${dev#/dev/}/queue/max_hw_sectors_kb)
[ "$hwk" = 512 ] && res ublk-max-sectors PASS "$hwk KiB" || res ublk-max-sectors FAIL "$hwk KiB"
basic ublk "$dev" disk2 /tmp/disk2.img 2
resized ublk "$dev" disk2 $(mb 192)

# 10. restart of the client daemon while the device is idle: user
# recovery gives the same device back with the same data.
scenario ublk-restart-idle
restart_client
dd if="$dev" of=/tmp/back2 bs=1M skip=10 count=8 iflag=direct 2>/dev/null
check ublk-restart-recovered cmp /tmp/pat2 /tmp/back2
[ "$(devpath)" = "$dev" ] && res ublk-restart-same-device PASS "" || res ublk-restart-same-device FAIL "$(cli device list 2>&1)"
stable ublk-restart-stable-name ub disk2 "$dev"
grep -q "took the ublk device back" /tmp/client.log && res ublk-restart-logged PASS "" || res ublk-restart-logged FAIL ""

scenario ublk-fio
check ublk-fio-verify fio --name=v --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite \
	--bsrange=4k-64k --size=32M --iodepth=16 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --randrepeat=0
throughput rnbd-ublk "$dev"

# 11. the client daemon killed (SIGKILL) while the device is busy: the
# kernel quiesces the device, holds the IO and requeues what the dead
# daemon had; the new daemon recovers it and the writer never sees an
# error.
scenario ublk-crash-busy
under_io ublk-client-kill "$dev" 0 restart_client -9
[ "$(devpath)" = "$dev" ] && res ublk-client-kill-same-device PASS "" || res ublk-client-kill-same-device FAIL "$(cli device list 2>&1)"
stable ublk-client-kill-stable-name ub disk2 "$dev"

# 12. kill -9 of the server, and a path cut, under IO.
scenario ublk-server-kill
under_io ublk-server-kill "$dev" 32 server_bounce
scenario ublk-path-cut
under_io ublk-path-cut "$dev" 64 path_cut
ip link set mp0 up
ip addr add 10.77.0.1/24 dev mp0

# 13. a filesystem, then unmap under the mount; the device goes.
scenario ublk-fs
fs ublk "$dev"
[ ! -e "$dev" ] && res ublk-gone PASS "" || res ublk-gone FAIL "$dev still there"

# 14. stable names made by udev, as on a real node: Debian's
# systemd-udevd runs with the packages' rule (60-rnbd.rules); the client,
# started after it, leaves the links to it (a hint file and a change
# event per device). The link names the device, udev knows it as the
# device's (what systemd's .device units and fstab go by), and it goes
# with the mapping. An export name with '/' shows how it is written.
udev_link() { # NAME SESS DEVPATH DEV: udev made /dev/rnbd/SESS/DEVPATH for DEV
	local l=/dev/rnbd/$2/$3 got
	for _ in $(seq 100); do [ -L "$l" ] && break; sleep 0.1; done
	got=$(readlink -f "$l" 2>&1)
	if [ "$got" = "$4" ] && udevadm info --query=symlink --name="$4" 2>&1 | tr ' ' '\n' | grep -qx "rnbd/$2/$3"; then
		res "$1" PASS "$l -> $(readlink "$l")"
	else
		res "$1" FAIL "$l -> $got, want $4; udev: $(udevadm info --query=symlink --name="$4" 2>&1)"
	fi
}
udev_gone() { # NAME SESS DEVPATH
	for _ in $(seq 100); do [ ! -e "/dev/rnbd/$2/$3" ] && [ ! -L "/dev/rnbd/$2/$3" ] && break; sleep 0.1; done
	[ ! -L "/dev/rnbd/$2/$3" ] && res "$1" PASS "" || res "$1" FAIL "$(ls -l /dev/rnbd/$2 2>&1)"
}
if [ -x /bin/udevadm ]; then
	scenario udev-stable-names
	mkdir -p /run/udev
	/bin/systemd-udevd --daemon >>/tmp/udev.log 2>&1
	for _ in $(seq 100); do [ -e /run/udev/control ] && break; sleep 0.1; done
	[ -e /run/udev/control ] && res udevd PASS "" || res udevd FAIL "$(tail -3 /tmp/udev.log)"
	restart_client
	srv map grp/disk3 /tmp/disk3.img >/dev/null
	out=$(cli map --sessname uv --path ip:127.0.0.1 --device-path grp/disk3 --as nbd 2>/dev/null)
	dev=$(echo "$out" | awk '/mapped:/ {print $3}')
	case $dev in /dev/nbd*) udev_link udev-nbd-name uv grp/disk3 "$dev" ;; *) res udev-nbd-name FAIL "$out" ;; esac
	[ -f /run/rnbd/devlinks/${dev#/dev/} ] && res udev-hint-file PASS "" || res udev-hint-file FAIL "$(ls /run/rnbd/devlinks 2>&1)"
	cli unmap "$(devname)" >/dev/null
	udev_gone udev-nbd-name-gone uv grp/disk3
	out=$(cli map --sessname uv --path ip:127.0.0.1 --device-path disk4 --as ublk 2>/dev/null)
	dev=$(echo "$out" | awk '/mapped:/ {print $3}')
	case $dev in /dev/ublkb*) udev_link udev-ublk-name uv disk4 "$dev" ;; *) res udev-ublk-name FAIL "$out" ;; esac
	# A restart of the client: the device is taken back, the name stays.
	restart_client
	udev_link udev-ublk-name-restart uv disk4 "$dev"
	cli unmap "$(devname)" >/dev/null
	udev_gone udev-ublk-name-gone uv disk4
	udevadm control --exit 2>/dev/null || kill "$(pidof systemd-udevd)"
	rm -rf /run/udev
	restart_client
fi
finish
