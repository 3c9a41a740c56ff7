#!/bin/busybox sh
# /init of the Kubernetes tier's guest (busybox sh): a Kubernetes node.
# The control plane runs on the host, in the tier's network namespace, at
# the gateway's address; this guest runs containerd, runc and the CNI
# plugins, the kubelet joined to it, and (as on a real node) the host
# daemons rnbd-client and the storage nodes' rnbd-server. Its binaries,
# images and configuration are on its one disk, /dev/vda (read-only
# ext4), made by test/k8s/guest.sh; its logs go to /var/log and the lines
# the host waits for ("K8S-…") to the console. The host ends the guest
# when its tests are done.
#
# Stage 1 (in the initramfs): the kernel modules, then a copy of the
# initramfs on a tmpfs and switch_root into it: runc's pivot_root cannot
# leave an initramfs root. Stage 2 (/init again, on the tmpfs): the node.
/bin/busybox --install -s /bin 2>/dev/null
export PATH=/usr/local/bin:/usr/bin:/usr/sbin:/bin:/sbin:/opt/k8s/bin
if [ ! -e /.stage2 ]; then
	mount -t proc p /proc
	mount -t sysfs s /sys
	mount -t devtmpfs d /dev
	echo K8S-INIT
	for m in $(cat /lib/modules/order); do insmod "/lib/modules/$m" || echo "K8S-NOTE insmod $m failed"; done
	mkdir -p /newroot
	mount -t tmpfs -o size=3G,mode=755 root /newroot
	for d in bin sbin lib lib64 usr etc init; do [ -e "/$d" ] && cp -a "/$d" /newroot/; done
	mkdir -p /newroot/proc /newroot/sys /newroot/dev /newroot/tmp /newroot/run /newroot/var/log /newroot/opt/k8s
	touch /newroot/.stage2
	umount /proc /sys
	mount --move /dev /newroot/dev
	exec switch_root /newroot /init
fi

mount -t proc p /proc
mount -t sysfs s /sys
[ -e /dev/null ] || mount -t devtmpfs d /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs shm /dev/shm
mount -t tmpfs -o mode=1777 t /tmp
mount -t tmpfs -o mode=755 r /run
# cgroup v2 with the controllers the kubelet and runc use.
mkdir -p /sys/fs/cgroup
mount -t cgroup2 none /sys/fs/cgroup
for c in cpuset cpu io memory pids hugetlb; do echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; done
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
# Mounts propagate, as the kubelet's and CSI's bidirectional mounts need.
mount --make-rshared /
mount -o ro /dev/vda /opt/k8s || { echo "K8S-FAIL no k8s disk"; poweroff -f; }
. /opt/k8s/etc/node.env # NODE ADDR GW: written by guest.sh
hostname "$NODE"
echo "root:x:0:0:root:/root:/bin/sh" >/etc/passwd
echo "root:x:0:" >/etc/group
echo "127.0.0.1 localhost" >/etc/hosts
echo "$ADDR $NODE" >>/etc/hosts
: >/etc/resolv.conf
ip link set lo up
ip link set eth0 up
ip addr add "$ADDR/24" dev eth0
ip route add default via "$GW"
sysctl -qw net.ipv4.ip_forward=1
echo "K8S-NET $ADDR via $GW"

# containerd, its configuration and the images from the disk.
mkdir -p /etc/containerd /etc/cni/net.d /opt/cni/bin /var/lib/kubelet /var/log/pods /var/lib/containerd
cp /opt/k8s/etc/containerd.toml /etc/containerd/config.toml
cp /opt/k8s/etc/10-bridge.conflist /etc/cni/net.d/
for p in bridge host-local loopback; do ln -s "/opt/k8s/bin/$p" "/opt/cni/bin/$p"; done
containerd --config /etc/containerd/config.toml >/var/log/containerd.log 2>&1 &
for _ in $(seq 600); do [ -S /run/containerd/containerd.sock ] && break; sleep 0.2; done
[ -S /run/containerd/containerd.sock ] || { tail -20 /var/log/containerd.log; echo "K8S-FAIL containerd"; poweroff -f; }
for i in /opt/k8s/images/*.tar; do
	ctr -n k8s.io images import --local --snapshotter native "$i" >/dev/null 2>>/var/log/images.log ||
		{ echo "K8S-FAIL import $i: $(tail -1 /var/log/images.log)"; poweroff -f; }
done
echo "K8S-IMAGES $(ctr -n k8s.io images list -q | grep -vc '^sha256:')"

# The storage node's rnbd-server (its pool on the second disk) and the
# worker's rnbd-client, the host daemon the node plugin drives, as their
# packages run them (their control sockets in /run/rnbd), and started
# again when they exit, as their units are (Restart=on-failure).
mkdir -p /run/rnbd /var/lib/rnbd /srv/pool
mount /dev/vdb /srv/pool || { echo "K8S-FAIL no pool disk"; poweroff -f; }
start_rnbd() {
	case $1 in
	rnbd-server) /opt/k8s/bin/rnbd-server daemon --config /opt/k8s/rnbd/server.toml >>/var/log/rnbd-server.log 2>&1 & ;;
	rnbd-client) /opt/k8s/bin/rnbd-client daemon --config /dev/null --control-socket /run/rnbd/client.sock \
		--state-file /var/lib/rnbd/client.json --socket-dir /run/rnbd --log-level info \
		--tls-cert "/opt/k8s/rnbd/tls/$NODE.crt" --tls-key "/opt/k8s/rnbd/tls/$NODE.key" \
		--tls-ca /opt/k8s/rnbd/tls/ca.crt >>/var/log/rnbd-client.log 2>&1 & ;;
	esac
	echo "K8S-RNBD $1 started"
}
start_rnbd rnbd-server
start_rnbd rnbd-client

# The kubelet.
mkdir -p /var/lib/kubelet/pki
cp /opt/k8s/etc/kubelet.kubeconfig /opt/k8s/etc/kubelet-config.yaml /var/lib/kubelet/
cp /opt/k8s/pki/ca.crt /opt/k8s/pki/kubelet.crt /opt/k8s/pki/kubelet.key /var/lib/kubelet/pki/
kubelet --config /var/lib/kubelet/kubelet-config.yaml --kubeconfig /var/lib/kubelet/kubelet.kubeconfig \
	--hostname-override "$NODE" --node-ip "$ADDR" --v=1 >/var/log/kubelet.log 2>&1 &
echo "K8S-KUBELET started"

# A kubelet or containerd that exits ends the guest, its last words on
# the console; an rnbd daemon is started again, as its unit; every 60 s
# the kubelet's last lines, for a failure's diagnosis.
n=0
while sleep 2; do
	for p in kubelet containerd; do
		pidof "$p" >/dev/null && continue
		echo "K8S-FAIL $p exited: $(tail -5 "/var/log/$p.log" | tr '\n' ' ' | cut -c1-1500)"
		poweroff -f
	done
	for p in rnbd-server rnbd-client; do
		pidof "$p" >/dev/null || start_rnbd "$p"
	done
	n=$((n + 1))
	[ $((n % 30)) -ne 0 ] || echo "K8S-TAIL kubelet: $(tail -3 /var/log/kubelet.log | tr '\n' ' ' | cut -c1-600)"
done
