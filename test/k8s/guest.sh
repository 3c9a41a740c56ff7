#!/usr/bin/env bash
# The Kubernetes tier's node: a qemu guest on the VM tier's Debian kernel
# (test/vm/run.sh VM_KERNEL_ONLY=1, which installs qemu and the rest the
# VM tier needs, and fetches the kernel, the first time), its NIC the tap device of the tier's
# network namespace. What it runs is test/k8s/guest/init.sh; what it runs
# it from is a disk made here (read-only ext4, mkfs.ext4 -d): the
# node's binaries, the images (test/k8s/images.sh), containerd's, the
# CNI's and the kubelet's configuration, the kubelet's certificate from
# the control plane's PKI; the storage node's and the worker's
# certificates from RNBD_PKI (docs/kubernetes.md's install steps 1–3).
# A second disk, XFS (reflink: snapshots and clones share blocks), is the
# storage node's pool.
#
#   test/k8s/guest.sh K8S_BIN IMAGES CP_DIR RNBD_PKI WORK NETNS TAP ADDR GW NODE
#
# Starts qemu in the background (its console in WORK/serial.log, its PID
# in WORK/qemu.pid) and returns; the caller ends it by that PID.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
[ $# -eq 10 ] || { echo "usage: $0 K8S_BIN IMAGES CP_DIR RNBD_PKI WORK NETNS TAP ADDR GW NODE" >&2; exit 2; }
kbin=$1 images=$2 cp=$3 pki=$4 work=$5 ns=$6 tap=$7 addr=$8 gw=$9 node=${10}
say() { printf '== [%(%H:%M:%S)T] k8s guest: %s\n' -1 "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

read -r vmlinuz kr kv < <(VM_KERNEL_ONLY=1 test/vm/run.sh) || die "no kernel (test/vm/run.sh)"
mkdir -p "$work"

# The initramfs: busybox, util-linux's mount tools (the kubelet's and
# mount-utils' mount, losetup for raw block volumes), the modules.
root=$work/root
rm -rf "$root" && mkdir -p "$root"/{bin,usr/bin,lib/modules,etc,proc,sys,dev}
cp /bin/busybox "$root/bin/busybox"
copy_elf() {
	local f=$1 as=${2:-$1}
	mkdir -p "$root$(dirname "$as")"
	cp -L "$f" "$root$as"
	ldd "$f" 2>/dev/null | awk '/=> \// {print $3} /^\t\/.*ld-linux/ {print $1}' | while read -r lib; do
		[ -e "$root$lib" ] || { mkdir -p "$root$(dirname "$lib")"; cp -L "$lib" "$root$lib"; }
	done
}
for t in mount umount losetup blkid blockdev findmnt nsenter mkfs.ext4 mkfs.xfs e2fsck fio; do
	p=$(command -v "$t") || die "$t is not installed"
	copy_elf "$(readlink -f "$p")" "/usr/bin/$t"
done
copy_elf "$(readlink -f "$(command -v ip)")" /usr/bin/ip
: >"$root/lib/modules/order"
i=0
for m in virtio_net virtio_blk ext4 xfs loop bridge veth nbd ublk_drv; do
	for ko in $(modprobe -C /nonexistent -d "$kr" -S "$kv" --show-depends "$m" | awk '$1 == "insmod" {print $2}'); do
		name=$(basename "${ko%.xz}")
		grep -q -- "-$name\$" "$root/lib/modules/order" && continue
		i=$((i + 1))
		n=$(printf '%02d' $i)-$name
		case $ko in *.xz) xz -dc "$ko" >"$root/lib/modules/$n" ;; *) cp "$ko" "$root/lib/modules/$n" ;; esac
		echo "$n" >>"$root/lib/modules/order"
	done
done
/bin/busybox sh -n test/k8s/guest/init.sh || die "test/k8s/guest/init.sh does not parse"
cp test/k8s/guest/init.sh "$root/init"
chmod +x "$root/init"
(cd "$root" && find . -print0 | cpio --null -o -H newc --owner=0:0 --quiet | gzip -1) >"$work/initrd.gz"

# The disk: binaries, images, configuration, the kubelet's PKI.
disk=$work/disk
rm -rf "$disk" && mkdir -p "$disk"/{bin,images,etc,pki,rnbd/tls}
for b in kubelet kubectl containerd containerd-shim-runc-v2 ctr runc bridge host-local loopback; do
	cp -L "$kbin/$b" "$disk/bin/"
done
CGO_ENABLED=0 go build -trimpath -ldflags "$(scripts/version.sh)" -o "$disk/bin/" ./cmd/rnbd-server ./cmd/rnbd-client
cp "$images"/*.tar "$disk/images/"
cp "$cp/pki/ca.crt" "$cp/pki/kubelet.crt" "$cp/pki/kubelet.key" "$disk/pki/"
printf 'NODE=%s\nADDR=%s\nGW=%s\n' "$node" "$addr" "$gw" >"$disk/etc/node.env"
# The storage node (install step 2) and the worker (step 3): the one
# machine is both, as a small cluster's may be.
cp "$pki/ca.crt" "$pki/storage-a.crt" "$pki/storage-a.key" "$pki/$node.crt" "$pki/$node.key" "$disk/rnbd/tls/"
cat >"$disk/rnbd/server.toml" <<-EOF
	# The tier's storage node, as docs/kubernetes.md's install step 2.
	listen = ["tcp://$addr:1234"]
	control_socket = "/run/rnbd/server.sock"
	state_file = "/var/lib/rnbd/server.json"
	[tls]
	cert = "/opt/k8s/rnbd/tls/storage-a.crt"
	key = "/opt/k8s/rnbd/tls/storage-a.key"
	ca = "/opt/k8s/rnbd/tls/ca.crt"
	[admin]
	listen = ["$addr"]
	provisioners = ["csi-controller"]
	# A handshake on this emulated node may take longer than the 2 s
	# a real one is given.
	handshake_timeout = "10s"
	[[pool]]
	name = "fast"
	type = "dir"
	path = "/srv/pool"
EOF
sed -e "s|$cp/pki/|/var/lib/kubelet/pki/|g" "$cp/pki/kubelet.kubeconfig" >"$disk/etc/kubelet.kubeconfig"
cat >"$disk/etc/containerd.toml" <<-'EOF'
	# containerd 2.x for the tier's node: the CRI plugin, the native
	# snapshotter (no overlayfs on the tmpfs root needed), the images
	# imported from the disk only (nothing is pulled: there is no registry).
	version = 3
	root = "/var/lib/containerd"
	state = "/run/containerd"
	[grpc]
	  address = "/run/containerd/containerd.sock"
	[plugins.'io.containerd.cri.v1.images']
	  snapshotter = "native"
	  [plugins.'io.containerd.cri.v1.images'.pinned_images]
	    sandbox = "registry.k8s.io/pause:3.10.2"
	[plugins.'io.containerd.cri.v1.runtime'.cni]
	  bin_dirs = ["/opt/cni/bin"]
	  conf_dir = "/etc/cni/net.d"
	[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
	  runtime_type = "io.containerd.runc.v2"
	  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
	    BinaryName = "/opt/k8s/bin/runc"
	    SystemdCgroup = false
EOF
cat >"$disk/etc/10-bridge.conflist" <<-'EOF'
	{
	  "cniVersion": "1.0.0",
	  "name": "rnbd-k8s",
	  "plugins": [
	    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
	     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
	    {"type": "loopback"}
	  ]
	}
EOF
cat >"$disk/etc/kubelet-config.yaml" <<-'EOF'
	apiVersion: kubelet.config.k8s.io/v1beta1
	kind: KubeletConfiguration
	authentication:
	  anonymous: {enabled: false}
	  webhook: {enabled: true}
	  x509: {clientCAFile: /var/lib/kubelet/pki/ca.crt}
	authorization: {mode: Webhook}
	tlsCertFile: /var/lib/kubelet/pki/kubelet.crt
	tlsPrivateKeyFile: /var/lib/kubelet/pki/kubelet.key
	cgroupDriver: cgroupfs
	containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
	failSwapOn: false
	resolvConf: ""
	# Nothing is pulled (no registry): the images the disk brought stay.
	imageGCHighThresholdPercent: 100
	imageGCLowThresholdPercent: 99
	evictionHard: {memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%"}
	serializeImagePulls: false
	# A TCG guest is slow: no timeouts of a fast machine.
	runtimeRequestTimeout: 10m
	nodeStatusUpdateFrequency: 20s
	syncFrequency: 30s
EOF
mkfs.ext4 -q -F -L k8s -d "$disk" "$work/k8s.img" "$(($(du -sm "$disk" | cut -f1) * 12 / 10 + 64))M"
rm -rf "$disk" "$root"
truncate -s 16G "$work/pool.img"
mkfs.xfs -q -f -m reflink=1 "$work/pool.img"

# Multi-threaded TCG: each of the two vCPUs a host thread. The node runs
# a dozen Go processes at once; on one host thread (thread=single) a pod
# took 60–100 s to start and an e2e spec 6–9 minutes, on two 30 s and
# about 90 s (docs/testing.md). K8S_TCG_THREAD=single for the old way.
tcg=${K8S_TCG_THREAD:-multi}
say "boot $kv (qemu TCG thread=$tcg, 4 GiB, NIC $tap in netns $ns)"
ip netns exec "$ns" qemu-system-x86_64 -kernel "$vmlinuz" -initrd "$work/initrd.gz" \
	-nographic -m 4G -smp 2 -no-reboot -accel "tcg,thread=$tcg" -cpu max \
	-netdev "tap,id=n0,ifname=$tap,script=no,downscript=no" -device virtio-net-pci,netdev=n0 \
	-drive "file=$work/k8s.img,if=virtio,format=raw,readonly=on" \
	-drive "file=$work/pool.img,if=virtio,format=raw,cache=unsafe" \
	-append "console=ttyS0 panic=-1 quiet" </dev/null >"$work/serial.log" 2>&1 &
echo $! >"$work/qemu.pid"
