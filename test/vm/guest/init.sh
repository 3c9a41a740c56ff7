#!/bin/busybox sh
# /init of the VM tier's guest (busybox sh): the kernel /dev/nbdN scenarios
# against a real kernel. Both daemons run in the guest and talk RTRS over
# TCP on its loopback. Prints one "RESULT name PASS|FAIL detail" line per
# check, then "N passed, N failed" and VMTEST-DONE, and powers off.
/bin/busybox --install -s /bin
mount -t proc p /proc
mount -t sysfs s /sys
mount -t devtmpfs d /dev
mount -t tmpfs t /tmp
mkdir -p /run /mnt
ip link set lo up
pass=0 fail=0
res() { # name PASS|FAIL detail
	echo "RESULT $1 $2 $3"
	case $2 in PASS) pass=$((pass + 1)) ;; FAIL) fail=$((fail + 1)) ;; esac
}
check() { # name command... : PASS if the command succeeds
	local name=$1
	shift
	if out=$("$@" 2>&1); then res "$name" PASS ""; else res "$name" FAIL "$(echo "$out" | tail -3 | tr '\n' ' ')"; fi
}
finish() {
	echo "--- rnbd-client log"; tail -15 /tmp/client.log
	echo "--- rnbd-server log"; tail -5 /tmp/server.log
	echo "$pass passed, $fail failed"
	echo VMTEST-DONE
	poweroff -f
}
cli() { /bin/rnbd-client --socket /tmp/c.sock "$@"; }
start_client() {
	/bin/rnbd-client daemon --config /dev/null --control-socket /tmp/c.sock --state-file /tmp/c.json \
		--socket-dir /tmp --log-level info >>/tmp/client.log 2>&1 &
	for _ in $(seq 100); do [ -S /tmp/c.sock ] && return 0; sleep 0.1; done
	return 1
}
mb() { echo $(($1 * 1024 * 1024)); }
throughput() { # name dev: 64 MiB written and read with 1 MiB O_DIRECT requests (TCG: recorded, not judged)
	local t0 t1 t2
	t0=$(cut -d' ' -f1 /proc/uptime)
	dd if=/dev/zero of="$2" bs=1M count=64 oflag=direct 2>/dev/null
	t1=$(cut -d' ' -f1 /proc/uptime)
	dd if="$2" of=/dev/null bs=1M count=64 iflag=direct 2>/dev/null
	t2=$(cut -d' ' -f1 /proc/uptime)
	echo "TPUT $1 dd-1M-direct write $(awk "BEGIN {printf \"%.0f\", 64 / ($t1 - $t0)}") MB/s read $(awk "BEGIN {printf \"%.0f\", 64 / ($t2 - $t1)}") MB/s (emulated)"
}

for m in $(cat /lib/modules/order); do insmod "/lib/modules/$m" || res "insmod-$m" FAIL ""; done
[ -e /sys/module/nbd ] && res nbd-module PASS "" || { res nbd-module FAIL ""; finish; }

# ublk: pkg/blockdev/ublk on its own, over an asynchronous RAM backend
# (test/vm/ublkcheck prints its own RESULT lines).
if [ -e /dev/ublk-control ]; then
	res ublk-module PASS ""
	timeout 300 /bin/ublkcheck >/tmp/ublkcheck.out 2>&1 || res ublkcheck-exit FAIL "exit $?"
	cat /tmp/ublkcheck.out
	while read -r tag _ st _; do
		[ "$tag" = RESULT ] || continue
		case $st in PASS) pass=$((pass + 1)) ;; FAIL) fail=$((fail + 1)) ;; esac
	done </tmp/ublkcheck.out
else
	res ublk-module FAIL "no /dev/ublk-control"
fi

cd /tmp
truncate -s 256M disk0.img
/bin/rnbd-server daemon --config /dev/null --listen tcp://127.0.0.1:1234 --control-socket /tmp/s.sock \
	--state-file /tmp/s.json --log-level info >/tmp/server.log 2>&1 &
start_client || { res daemons FAIL "no control socket"; finish; }
for _ in $(seq 100); do [ -S /tmp/s.sock ] && break; sleep 0.1; done
/bin/rnbd-server --socket /tmp/s.sock map disk0 /tmp/disk0.img >/dev/null

# 1. map with the default --as: nbd, since the module is loaded.
out=$(cli map --sessname vm --path ip:127.0.0.1 --device-path disk0 2>/dev/null)
dev=$(echo "$out" | awk '/mapped:/ {print $3}')
case $dev in /dev/nbd*) res map-as-nbd PASS "$dev" ;; *) res map-as-nbd FAIL "$out"; finish ;; esac
b=/sys/block/${dev#/dev/}
for _ in $(seq 50); do [ "$(cat $b/size)" != 0 ] && break; sleep 0.1; done
[ "$(cat $b/size)" = $((256 * 2048)) ] && res size PASS "" || res size FAIL "$(cat $b/size) sectors"
nq=$(ls $b/mq | wc -l)
[ "$nq" = "$(grep -c ^processor /proc/cpuinfo)" ] && res queue-per-cpu PASS "$nq" || res queue-per-cpu FAIL "$nq queues"
[ "$(cat $b/backend 2>/dev/null)" = rnbd:vm/disk0 ] && res backend-identifier PASS "" || res backend-identifier FAIL "$(cat $b/backend 2>&1)"

# 2. O_DIRECT pattern, read back through the device and found in the file.
dd if=/dev/urandom of=/tmp/pat bs=1M count=16 2>/dev/null
dd if=/tmp/pat of="$dev" bs=1M seek=4 oflag=direct 2>/dev/null
dd if="$dev" of=/tmp/back bs=1M skip=4 count=16 iflag=direct 2>/dev/null
check direct-io cmp /tmp/pat /tmp/back
dd if=/tmp/disk0.img of=/tmp/onfile bs=1M skip=4 count=16 2>/dev/null
check on-backend cmp /tmp/pat /tmp/onfile

# 3. discard reaches the file: the range becomes a hole.
before=$(du -k /tmp/disk0.img | cut -f1)
blkdiscard -o "$(mb 4)" -l "$(mb 8)" "$dev" && sync
after=$(du -k /tmp/disk0.img | cut -f1)
[ $((before - after)) -ge 8000 ] && res discard-hole PASS "${before}K -> ${after}K" || res discard-hole FAIL "${before}K -> ${after}K"

# 4. restart of the client daemon: the same device comes back (RECONFIGURE).
kill "$(pidof rnbd-client)"
for _ in $(seq 100); do pidof rnbd-client >/dev/null || break; sleep 0.1; done
rm -f /tmp/c.sock
start_client || res restart FAIL "no control socket"
dd if="$dev" of=/tmp/back2 bs=1M skip=12 count=8 iflag=direct 2>/dev/null
dd if=/tmp/pat of=/tmp/pat2 bs=1M skip=8 count=8 2>/dev/null
check restart-reconfigure cmp /tmp/pat2 /tmp/back2
[ "$(cli device list --format csv --fields devpath 2>/dev/null | tail -1)" = "$dev" ] && res same-device PASS "" || res same-device FAIL "$(cli device list 2>&1)"

# 5. a filesystem: write, sync, unmount, mount again, compare.
if mke2fs -q "$dev" && mount -t ext4 "$dev" /mnt && cp /tmp/pat /mnt/f && sync; then
	res mkfs-mount PASS ""
	umount /mnt && mount -t ext4 "$dev" /mnt
	check remount-compare cmp /tmp/pat /mnt/f
	# 6. unmap is refused while mounted, --force takes it away.
	out=$(cli unmap rnbd0 2>&1)
	rc=$?
	[ $rc = 5 ] && res unmap-busy PASS "" || res unmap-busy FAIL "rc=$rc $out"
	check unmap-force cli unmap --force rnbd0
	cat /mnt/f >/dev/null 2>&1
	umount /mnt 2>/dev/null
else
	res mkfs-mount FAIL ""
	check unmap cli unmap rnbd0
fi
[ "$(cat $b/size)" = 0 ] && res disconnected PASS "" || res disconnected FAIL "$(cat $b/size) sectors"
[ -z "$(cli device list --format csv 2>/dev/null | tail -n +2)" ] && res unmapped PASS "" || res unmapped FAIL "$(cli device list 2>&1)"

# 7. fio with verify on the kernel device.
truncate -s 128M /tmp/disk1.img
/bin/rnbd-server --socket /tmp/s.sock map disk1 /tmp/disk1.img >/dev/null
# A second path over a dummy interface of the guest's own.
ip link add mp0 type dummy && ip addr add 10.77.0.1/24 dev mp0 && ip link set mp0 up
start_server() {
	/bin/rnbd-server daemon --config /dev/null --listen tcp://127.0.0.1:1234 --listen tcp://10.77.0.1:1234 \
		--control-socket /tmp/s.sock --state-file /tmp/s.json --log-level info >>/tmp/server.log 2>&1 &
	for _ in $(seq 100); do [ -S /tmp/s.sock ] && return 0; sleep 0.1; done
	return 1
}
kill "$(pidof rnbd-server)"
for _ in $(seq 100); do pidof rnbd-server >/dev/null || break; sleep 0.1; done
rm -f /tmp/s.sock
start_server || res server-restart FAIL "no control socket"
out=$(cli map --sessname mp --path ip:127.0.0.1 --path ip:10.77.0.1 --device-path disk1 2>/dev/null)
dev=$(echo "$out" | awk '/mapped:/ {print $3}')
case $dev in /dev/nbd*) res map-two-paths PASS "$dev" ;; *) res map-two-paths FAIL "$out"; finish ;; esac
throughput nbd "$dev"
if command -v fio >/dev/null; then
	check fio-verify fio --name=v --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite \
		--bsrange=4k-64k --size=32M --iodepth=16 --verify=crc32c --verify_fatal=1 --randrepeat=0
fi

# 8. kill -9 of the server under IO, started again within no_path_timeout:
# the IO waits in the client and completes without an error.
dd if=/dev/urandom of=/tmp/pat3 bs=1M count=32 2>/dev/null
# Four passes over the same 32 MiB, so that the fault lands mid-IO.
writer() { for _ in 1 2 3 4; do dd if="$1" of="$dev" bs=1M seek="$2" oflag=direct 2>>/tmp/dd.err || return 1; done; }
writer /tmp/pat3 0 &
ddpid=$!
sleep 0.5
kill -0 $ddpid 2>/dev/null && during=1 || during=0
kill -9 "$(pidof rnbd-server)"
sleep 1
rm -f /tmp/s.sock
start_server || res server-restart FAIL "no control socket"
if wait $ddpid && [ $during = 1 ]; then res server-kill-under-io PASS ""
else res server-kill-under-io FAIL "during=$during $(cat /tmp/dd.err)"; fi
dd if="$dev" of=/tmp/back3 bs=1M count=32 iflag=direct 2>/dev/null
check server-kill-data cmp /tmp/pat3 /tmp/back3

# 9. one of the two paths cut under IO: no error, the data is whole.
dd if=/dev/urandom of=/tmp/pat4 bs=1M count=32 2>/dev/null
: >/tmp/dd.err
writer /tmp/pat4 32 &
ddpid=$!
sleep 0.5
kill -0 $ddpid 2>/dev/null && during=1 || during=0
ip addr del 10.77.0.1/24 dev mp0
ip link set mp0 down
if wait $ddpid && [ $during = 1 ]; then res path-cut-under-io PASS ""
else res path-cut-under-io FAIL "during=$during $(cat /tmp/dd.err)"; fi
# The cut path must have noticed (not connected, or reconnected since).
st=$(cli path list --format csv --fields dst_addr,state,reconnects 2>/dev/null | grep 10.77.0.1)
case $st in *,connected,0) res path-cut-seen FAIL "$st" ;; "") res path-cut-seen FAIL "no such path" ;; *) res path-cut-seen PASS "$st" ;; esac
dd if="$dev" of=/tmp/back4 bs=1M skip=32 count=32 iflag=direct 2>/dev/null
check path-cut-data cmp /tmp/pat4 /tmp/back4
ip link set mp0 up
ip addr add 10.77.0.1/24 dev mp0

# 10. the client daemon stopped (SIGTERM) and started again while the
# device is busy: the kernel holds the IO (dead_conn_timeout), the new
# daemon RECONFIGUREs the same device, and dd ends without an error.
dd if=/dev/urandom of=/tmp/pat5 bs=1M count=32 2>/dev/null
: >/tmp/dd.err
writer /tmp/pat5 64 &
ddpid=$!
sleep 0.5
kill -0 $ddpid 2>/dev/null && during=1 || during=0
kill "$(pidof rnbd-client)"
for _ in $(seq 100); do pidof rnbd-client >/dev/null || break; sleep 0.1; done
rm -f /tmp/c.sock
start_client || res client-restart FAIL "no control socket"
if wait $ddpid && [ $during = 1 ]; then res client-restart-under-io PASS ""
else res client-restart-under-io FAIL "during=$during $(cat /tmp/dd.err)"; fi
dd if="$dev" of=/tmp/back5 bs=1M skip=64 count=32 iflag=direct 2>/dev/null
check client-restart-data cmp /tmp/pat5 /tmp/back5
[ "$(cli device list --format csv --fields devpath 2>/dev/null | tail -1)" = "$dev" ] && res client-restart-same-device PASS "" ||
	res client-restart-same-device FAIL "$(cli device list 2>&1)"

# 11. BACKEND_IDENTIFIER: a mapping that now names another export must not
# take the old device back. The state file is edited while the daemon is
# down; the kernel refuses the RECONFIGURE and a new device is attached.
kill "$(pidof rnbd-client)"
for _ in $(seq 100); do pidof rnbd-client >/dev/null || break; sleep 0.1; done
rm -f /tmp/c.sock
sed -i 's/"device_path": *"disk1"/"device_path":"disk0"/' /tmp/c.json
start_client || res client-restart FAIL "no control socket"
new=$(cli device list --format csv --fields devpath 2>/dev/null | tail -1)
case $new in /dev/nbd*) [ "$new" != "$dev" ] && res backend-id-refused PASS "$dev kept, $new attached" || res backend-id-refused FAIL "$new" ;;
*) res backend-id-refused FAIL "$(cli device list 2>&1)" ;; esac
why=$(grep "could not take the device back" /tmp/client.log | tail -1 | sed -n 's/.*error="\([^"]*\)".*/\1/p')
[ -n "$why" ] && res backend-id-logged PASS "$why" || res backend-id-logged FAIL ""
check unmap-two-paths cli unmap "$(cli device list --format csv --fields devname 2>/dev/null | tail -1)"

# 12. the same device as ublk: --as ublk makes /dev/ublkbN.
out=$(cli map --sessname ub --path ip:127.0.0.1 --device-path disk1 --as ublk 2>&1)
dev=$(echo "$out" | awk '/mapped:/ {print $3}')
case $dev in /dev/ublkb*) res ublk-map PASS "$dev" ;; *) res ublk-map FAIL "$out"; finish ;; esac
ub=/sys/block/${dev#/dev/}
[ "$(cat $ub/size)" = $((128 * 2048)) ] && res ublk-size PASS "" || res ublk-size FAIL "$(cat $ub/size) sectors"
dd if=/tmp/pat of="$dev" bs=1M seek=2 oflag=direct 2>/dev/null
dd if="$dev" of=/tmp/uback bs=1M skip=2 count=16 iflag=direct 2>/dev/null
check ublk-direct-io cmp /tmp/pat /tmp/uback
dd if=/tmp/disk1.img of=/tmp/uonfile bs=1M skip=2 count=16 2>/dev/null
check ublk-on-backend cmp /tmp/pat /tmp/uonfile
before=$(du -k /tmp/disk1.img | cut -f1)
blkdiscard -o "$(mb 2)" -l "$(mb 8)" "$dev" && sync
after=$(du -k /tmp/disk1.img | cut -f1)
[ $((before - after)) -ge 8000 ] && res ublk-discard-hole PASS "${before}K -> ${after}K" || res ublk-discard-hole FAIL "${before}K -> ${after}K"
if command -v fio >/dev/null; then
	check ublk-fio-verify fio --name=v --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite \
		--bsrange=4k-64k --size=32M --iodepth=16 --verify=crc32c --verify_fatal=1 --randrepeat=0
fi
throughput rnbd-ublk "$dev"
if mke2fs -q "$dev" && mount -t ext4 "$dev" /mnt && cp /tmp/pat /mnt/f && sync; then
	umount /mnt && mount -t ext4 "$dev" /mnt
	check ublk-fs cmp /tmp/pat /mnt/f
	out=$(cli unmap "$(cli device list --format csv --fields devname 2>/dev/null | tail -1)" 2>&1)
	rc=$?
	[ $rc = 5 ] && res ublk-unmap-busy PASS "" || res ublk-unmap-busy FAIL "rc=$rc $out"
	check ublk-unmap-force cli unmap --force "$(cli device list --format csv --fields devname 2>/dev/null | tail -1)"
	cat /mnt/f >/dev/null 2>&1
	umount /mnt 2>/dev/null
else
	res ublk-fs FAIL "mkfs or mount"
	check ublk-unmap cli unmap "$(cli device list --format csv --fields devname 2>/dev/null | tail -1)"
fi
[ ! -e "$dev" ] && res ublk-gone PASS "" || res ublk-gone FAIL "$dev still there"
finish
