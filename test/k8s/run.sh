#!/usr/bin/env bash
# The Kubernetes tier (make test-k8s): rnbd-csi under a real Kubernetes,
# installed as docs/kubernetes.md's install section says, step for step.
# Being built (issue 41); docs/testing.md says what it does and what is to
# come. Its steps:
#
#   build     test/k8s/build.sh: the pinned Kubernetes, etcd, containerd,
#             runc, CNI plugins and CSI sidecars from the Go module proxy,
#             cached by version (K8S_CACHE);
#   images    test/k8s/images.sh: the images, as OCI layouts (install
#             step 4);
#   pki       the certificates of install step 1, by rnbd-server cert:
#             the authority, the storage node's, the controller's, the
#             worker's (named as its Node);
#   netns     a network namespace of its own: a tap device for the guest
#             (ADDR, the control plane's address, on it) and the API
#             server's service address 10.96.0.1 on its loopback;
#   control-plane  test/k8s/controlplane.sh: etcd, kube-apiserver,
#             kube-controller-manager, kube-scheduler, natively, in it;
#   boot      test/k8s/guest.sh: the node, a qemu guest on that tap device
#             (containerd, runc, CNI, the kubelet; the storage node's
#             rnbd-server and the worker's rnbd-client, install steps 2
#             and 3: test/k8s/guest/init.sh);
#   node-ready  until the kubelet has registered the node and it is Ready;
#   install   install step 5: the snapshot CRDs and controller
#             (external-snapshotter's own manifests), the namespace, the
#             chart deploy/helm/rnbd-csi with test/k8s/values.yaml and the
#             controller's certificate by --set-file; read back;
#   pods      until every pod is Ready (K8S_POD_TIMEOUT, 900 s), or what
#             the kubelet says of those that are not;
#   volumes   ext4, xfs and raw block PVCs: a pod writes, is deleted, its
#             volume detached; another pod reads the data back;
#   resize    a bound ext4 PVC grown while its pod runs: the pod's file
#             system grows;
#   snapshot  a VolumeSnapshot, a PVC restored from it and a clone of a
#             PVC, each read back;
#   e2e       the Kubernetes storage e2e suite's external-driver tests
#             (test/k8s/testdriver.yaml), the specs test/k8s/e2e-focus.txt
#             names;
#   failure   rnbd-client killed (-9) on the node while a pod writes, then
#             the storage node's rnbd-server: fio verifies every block;
#   cleanup   everything deleted: no PV, snapshot content, volume, export,
#             grant or snapshot on the storage node, no mapping or mount on
#             the node;
#
# then everything it started is stopped and the namespace removed; the
# time of each step is printed. Root. K8S_KEEP=1 keeps the work directory;
# K8S_ONLY=e2e,cleanup (say) runs only those of the checks.
#
# K8S_PROFILE=full (the default, make test-k8s) runs every check and
# every e2e spec of test/k8s/e2e-focus.txt; K8S_PROFILE=ci (.ci/run) runs
# the e2e specs marked ci there in place of the volumes, resize and
# snapshot checks, which they cover (a pod writes, another reads back on
# ext4, xfs and raw block; a volume grown under its pod; a snapshot
# restored; a clone), then the failure case and the cleanup check.
#
# The whole script is one function, read before it runs: editing the file
# during a run does not change that run.
set -euo pipefail
shopt -s inherit_errexit

main() {
	cd "$(dirname "$0")/../.."
	local t_start=$SECONDS
	[ "$(id -u)" = 0 ] || die "the Kubernetes tier needs root (a network namespace)"
	for c in openssl jq ip mkfs.ext4 mkfs.xfs; do command -v "$c" >/dev/null || die "$c is not installed"; done
	helm=${RNBD_HELM:-bin/tools/helm-v3.22.0}
	[ -x "$helm" ] || die "no helm at $helm (make helm, or RNBD_HELM)"

	profile=${K8S_PROFILE:-full}
	case $profile in
	full | ci) say "profile $profile" ;;
	*) die "K8S_PROFILE=$profile: the profiles are full and ci" ;;
	esac

	work=$(mktemp -d /tmp/rnbd-k8s.XXXXXX)
	ns=rnbd-k8s-$$
	addr=10.231.0.1
	guest=10.231.0.2
	node=rnbd-node-1
	qemu_pid=
	trap cleanup EXIT

	step build build
	step images test/k8s/images.sh "$kbin" "$work/images"
	step pki pki
	step netns netns
	step control-plane test/k8s/controlplane.sh start "$kbin" "$work/cp" "$ns" "$addr" "$node"
	step boot boot
	step node-ready ready
	step install install
	step pods pods
	check volumes volumes
	check resize resize
	check snapshot snapshot
	check e2e e2e
	check failure failure
	check cleanup cleanup_check
	say "passed in $((SECONDS - t_start)) s ($profile): ${steps[*]}"
}

say() { printf '== [%(%H:%M:%S)T] k8s: %s\n' -1 "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

# check NAME CMD...: a step of the checks, unless K8S_ONLY (a comma list
# of their names: volumes, resize, snapshot, failure, e2e, cleanup) or
# the ci profile leaves it out. The snapshot and resize checks use the
# volumes check's PVCs.
check() {
	if [ -n "${K8S_ONLY:-}" ] && [[ ,$K8S_ONLY, != *",$1,"* ]]; then
		say "step $1: not in K8S_ONLY"
		return
	fi
	if [ "$profile" = ci ] && [[ $1 =~ ^(volumes|resize|snapshot)$ ]]; then
		say "step $1: the ci profile's e2e specs stand in for it"
		return
	fi
	step "$@"
}

steps=()
step() { # step NAME CMD...: runs CMD, its time kept for the summary
	local name=$1 t0=$SECONDS
	shift
	"$@"
	steps+=("$name $((SECONDS - t0))s")
	say "step $name: $((SECONDS - t0)) s"
}

cleanup() {
	if [ -n "$qemu_pid" ]; then
		kill "$qemu_pid" 2>/dev/null || true
		for _ in $(seq 50); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.2; done
		grep -a "^K8S-" "$work/guest/serial.log" | cut -c1-2000 >&2 || true
	fi
	test/k8s/controlplane.sh stop "$work/cp" || true
	ip netns del "$ns" 2>/dev/null || true
	if [ -n "${K8S_KEEP:-}" ]; then say "kept $work"; else rm -rf "$work"; fi
}

kbin=
build() { kbin=$(test/k8s/build.sh); }

# pki: docs/kubernetes.md's install step 1, with the package's commands:
# the authority, the storage node's certificate (the address the
# controller and the worker dial), the controller's, the worker's (named
# as its Node: the identity a volume's grant names).
pki() {
	local b=$work/bin
	CGO_ENABLED=0 go build -trimpath -o "$b/" ./cmd/rnbd-server
	local c=(--certs-dir "$work/rnbd-ca" --ca-key "$work/rnbd-ca.key")
	"$b/rnbd-server" cert create-ca "${c[@]}"
	"$b/rnbd-server" cert create-node storage-a "$guest" "${c[@]}"
	"$b/rnbd-server" cert create-client csi-controller "${c[@]}"
	"$b/rnbd-server" cert create-client "$node" "${c[@]}"
	"$b/rnbd-server" cert list --certs-dir "$work/rnbd-ca"
}

netns() {
	ip netns add "$ns"
	ip -n "$ns" link set lo up
	# The guest's network: a tap device qemu attaches to; the control
	# plane listens on its address.
	ip -n "$ns" tuntap add k8stap mode tap
	ip -n "$ns" addr add "$addr/24" dev k8stap
	ip -n "$ns" link set k8stap up
	# The API server's service address, for pods (there is no
	# kube-proxy): the node routes it here.
	ip -n "$ns" addr add 10.96.0.1/32 dev lo
}

boots=0
boot() {
	test/k8s/guest.sh "$kbin" "$work/images" "$work/cp" "$work/rnbd-ca" "$work/guest" "$ns" k8stap "$guest" "$addr" "$node"
	qemu_pid=$(cat "$work/guest/qemu.pid")
	boots=$((boots + 1))
	# Replies to pods (10.244.0.0/24, the node's bridge) go back through it.
	ip -n "$ns" route replace 10.244.0.0/24 via "$guest" dev k8stap onlink
}

kc() { ip netns exec "$ns" "$kbin/kubectl" --kubeconfig "$work/cp/pki/admin.kubeconfig" "$@"; }

# console FILE: a guest's console as a failure shows it: from the first
# line of its kernel's first oops (its cause and RIP, which the panic's
# last lines do not name), and its last lines.
console() {
	local at
	at=$(grep -anm1 -E 'BUG:|Oops|general protection fault|invalid opcode|double fault|Kernel panic|WARNING: CPU' "$1" | cut -d: -f1) || true
	if [ -n "$at" ]; then
		echo "-- the guest's console from its kernel's first oops (line $at):"
		sed -n "$((at > 3 ? at - 3 : 1)),$((at + 40))p" "$1" | cut -c1-300
		echo "-- its last lines:"
	fi
	tail -40 "$1" | cut -c1-2000
}

# guest_gone: the guest's console, and fail.
guest_gone() {
	console "$work/guest/serial.log" >&2
	die "the guest ended"
}

# panicked: the guest's kernel died (its console says so).
panicked() { grep -aq 'Kernel panic - not syncing' "$work/guest/serial.log"; }

ready() {
	local t0=$SECONDS
	until kc get node "$node" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True; do
		if ! kill -0 "$qemu_pid" 2>/dev/null; then
			# Multi-threaded TCG now and then kills the guest's kernel
			# while it starts (docs/testing.md): before the node is
			# Ready nothing of the tests has run, and it is booted once
			# more. A kernel that dies later fails the tier.
			if panicked && [ "$boots" = 1 ]; then
				console "$work/guest/serial.log" >&2
				say "the guest's kernel died $((SECONDS - t0)) s after its boot, before the node was Ready: booted once more"
				mv "$work/guest/serial.log" "$work/guest/serial-1.log"
				boot
				t0=$SECONDS
				continue
			fi
			guest_gone
		fi
		if [ $((SECONDS - t0)) -gt 900 ]; then
			tail -40 "$work/guest/serial.log" | cut -c1-2000 >&2
			kc get node -o wide >&2 || true
			die "node $node not Ready in 900 s"
		fi
		sleep 5
	done
	say "node $node Ready $((SECONDS - t0)) s after the boot"
	# Its zone, as an operator labels a node: the node plugin's topology
	# (csi.toml's topology_from_node).
	kc label node "$node" topology.kubernetes.io/zone=zone-a
}

install() {
	# The snapshot CRDs and controller, once per cluster, as
	# docs/kubernetes.md says: external-snapshotter's own manifests.
	kc apply -f "$kbin/snapshot-crd/"
	kc wait --for condition=established --timeout 60s crd/volumesnapshotclasses.snapshot.storage.k8s.io \
		crd/volumesnapshots.snapshot.storage.k8s.io crd/volumesnapshotcontents.snapshot.storage.k8s.io
	# Its manifest names an older image than the release built: the
	# controller built runs.
	local v
	v=$("$kbin/snapshot-controller" --version 2>&1 | grep -o 'v[0-9][0-9.]*' | head -1)
	kc apply -f "$kbin/snapshot-controller-deploy/rbac-snapshot-controller.yaml"
	sed "s|image: registry.k8s.io/sig-storage/snapshot-controller:.*|image: registry.k8s.io/sig-storage/snapshot-controller:$v|" \
		"$kbin/snapshot-controller-deploy/setup-snapshot-controller.yaml" | kc apply -f -
	# Install step 5, with Helm: the namespace first, then the chart with
	# the tier's values and the controller's certificate as files.
	kc apply -f deploy/kubernetes/namespace.yaml
	local ca=$work/rnbd-ca
	ip netns exec "$ns" "$helm" --kubeconfig "$work/cp/pki/admin.kubeconfig" install rnbd-csi deploy/helm/rnbd-csi \
		--namespace rnbd-csi --values test/k8s/values.yaml \
		--set-file "certificates.cert=$ca/csi-controller.crt,certificates.key=$ca/csi-controller.key,certificates.ca=$ca/ca.crt"
	# Read back as the API server holds it.
	local got
	got=$(kc get csidriver rnbd.csi.rnbd.io -o json | jq -c '.spec | {attachRequired, podInfoOnMount, storageCapacity, volumeLifecycleModes}')
	say "CSIDriver: $got"
	[ "$(jq -r .storageCapacity <<<"$got")" = true ] || die "the CSIDriver does not say storageCapacity: true"
	kc -n rnbd-csi get deployment/rnbd-csi-controller daemonset/rnbd-csi-node -o name
	[ "$(kc get storageclass rnbd rnbd-xfs -o jsonpath='{.items[*].provisioner}')" = "rnbd.csi.rnbd.io rnbd.csi.rnbd.io" ] ||
		die "the StorageClasses rnbd and rnbd-xfs are not rnbd.csi.rnbd.io's"
	kc get volumesnapshotclass rnbd -o name
	install_shell
}

# install_shell: the node's shell, for the checks and faults on the node:
# a pod in its PID namespace, privileged (chroot /proc/1/root).
install_shell() {
	jq -n --arg node "$node" '{apiVersion: "v1", kind: "Pod", metadata: {name: "node-shell", namespace: "default"},
		spec: {nodeName: $node, hostPID: true, terminationGracePeriodSeconds: 0,
			containers: [{name: "sh", image: "registry.k8s.io/e2e-test-images/busybox:1.37.0-2", imagePullPolicy: "Never",
				command: ["sleep", "86400"], securityContext: {privileged: true}}]}}' | kc apply -f -
	wait_until "node-shell running" 900 running node-shell
}

# pods: until every pod is Ready; or what the kubelet says of those that
# are not, and fail.
pods() {
	local t0=$SECONDS notready
	while :; do
		notready=$(kc get pods -A -o json | jq -r '.items[] | select(([.status.conditions[]? | select(.type == "Ready" and .status == "True")] | length) == 0) | .metadata.namespace + "/" + .metadata.name')
		[ -n "$notready" ] || break
		if [ $((SECONDS - t0)) -gt "${K8S_POD_TIMEOUT:-900}" ] || ! kill -0 "$qemu_pid" 2>/dev/null; then
			kc get pods -A -o wide >&2 || true
			local p
			for p in $notready; do
				kc -n "${p%%/*}" describe pod "${p#*/}" | sed -n '/^Containers:/,$p' | tail -40 >&2 || true
				kc -n "${p%%/*}" logs "${p#*/}" --all-containers --tail 10 >&2 || true
			done
			die "pods not Ready in $((SECONDS - t0)) s: $notready"
		fi
		sleep 10
	done
	kc get pods -A -o wide
	say "every pod Ready $((SECONDS - t0)) s after the apply"
	# Storage capacity tracking: external-provisioner publishes the
	# storage node's room per StorageClass and zone, which the scheduler
	# places WaitForFirstConsumer volumes' pods by.
	wait_until "CSIStorageCapacity of rnbd and rnbd-xfs published" 600 capacity_published
	kc -n rnbd-csi get csistoragecapacities -o json |
		jq -r '.items[] | "capacity: \(.storageClassName) \(.nodeTopology.matchLabels | tostring) \(.capacity)"' >&2
}
capacity_published() {
	[ "$(kc -n rnbd-csi get csistoragecapacities -o json |
		jq '[.items[] | select(.capacity != null and .capacity != "0") | .storageClassName] | unique | length')" = 2 ]
}

# The tests' objects, in the namespace default.
busybox=registry.k8s.io/e2e-test-images/busybox:1.37.0-2

# on_node CMD...: CMD on the node, as root in its namespaces.
on_node() { kc exec node-shell -- chroot /proc/1/root "$@"; }

# pvc NAME CLASS MODE [SIZE] [DATASOURCE_JSON]: a PersistentVolumeClaim.
pvc() {
	jq -n --arg n "$1" --arg sc "$2" --arg mode "$3" --arg size "${4:-1Gi}" --argjson ds "${5:-null}" '{
		apiVersion: "v1", kind: "PersistentVolumeClaim", metadata: {name: $n},
		spec: ({accessModes: ["ReadWriteOnce"], storageClassName: $sc, volumeMode: $mode,
			resources: {requests: {storage: $size}}} + (if $ds then {dataSource: $ds} else {} end))}' | kc apply -f -
}

# pod NAME PVC MODE SCRIPT [IMAGE]: a pod that runs SCRIPT (sh -c) once
# with PVC at /data (Filesystem) or /dev/xvda (Block).
pod() {
	jq -n --arg n "$1" --arg c "$2" --arg mode "$3" --arg script "$4" --arg image "${5:-$busybox}" '{
		apiVersion: "v1", kind: "Pod", metadata: {name: $n},
		spec: {restartPolicy: "Never", terminationGracePeriodSeconds: 5,
			containers: [({name: "c", image: $image, imagePullPolicy: "Never", command: ["sh", "-c", $script]} +
				if $mode == "Block" then {volumeDevices: [{name: "v", devicePath: "/dev/xvda"}]}
				else {volumeMounts: [{name: "v", mountPath: "/data"}]} end)],
			volumes: [{name: "v", persistentVolumeClaim: {claimName: $c}}]}}' | kc apply -f -
}

# wait_until DESC SECONDS CMD...: until CMD succeeds, at most SECONDS.
wait_until() {
	local desc=$1 max=$2 t0=$SECONDS
	shift 2
	until "$@" >/dev/null 2>&1; do
		kill -0 "$qemu_pid" 2>/dev/null || guest_gone
		[ $((SECONDS - t0)) -lt "$max" ] || die "$desc: not in $max s"
		sleep 3
	done
	say "$desc: $((SECONDS - t0)) s"
}

phase() { kc get pod "$1" -o jsonpath='{.status.phase}'; }
done_pod() { [[ $(phase "$1") == Succeeded || $(phase "$1") == Failed ]]; }
running() { [ "$(phase "$1")" = Running ]; }

# run_pod NAME PVC MODE SCRIPT [IMAGE]: the pod run to its end; its log
# on stdout; fails unless it succeeded. The pod is deleted and the
# volume's VolumeAttachment waited out: unmounted, unstaged, unpublished.
run_pod() {
	pod "$@" >/dev/null
	wait_until "pod $1 done" 900 done_pod "$1"
	local ph log
	ph=$(phase "$1")
	log=$(kc logs "$1")
	if [ "$ph" != Succeeded ]; then
		kc describe pod "$1" | tail -20 >&2
		printf '%s\n' "$log" >&2
		die "pod $1 $ph"
	fi
	kc delete pod "$1" --wait >/dev/null
	detached "$2"
	printf '%s\n' "$log"
}

# detached PVC: until no VolumeAttachment is left for PVC's volume.
detached() {
	local pv
	pv=$(kc get pvc "$1" -o jsonpath='{.spec.volumeName}')
	wait_until "$1 detached" 600 no_attachment "$pv"
}
no_attachment() { ! kc get volumeattachment -o jsonpath='{.items[*].spec.source.persistentVolumeName}' | grep -qw "$1"; }

# The data a writer leaves: 8 MiB of random bytes, their md5 in its log.
write_fs='set -e; dd if=/dev/urandom of=/data/blob bs=1M count=8 2>/dev/null; sync; echo "SUM $(md5sum </data/blob | cut -d" " -f1)"; grep " /data " /proc/mounts'
write_block='set -e; dd if=/dev/urandom of=/tmp/b bs=1M count=8 2>/dev/null; dd if=/tmp/b of=/dev/xvda bs=1M seek=1 conv=fsync 2>/dev/null; echo "SUM $(md5sum </tmp/b | cut -d" " -f1)"'
read_fs() { echo "set -e; grep \" /data $1 \" /proc/mounts; test \"\$(md5sum </data/blob | cut -d' ' -f1)\" = $2; echo READ-OK"; }
read_block() { echo "set -e; test \"\$(dd if=/dev/xvda bs=1M skip=1 count=8 2>/dev/null | md5sum | cut -d' ' -f1)\" = $1; echo READ-OK"; }
sum_of() { sed -n 's/^SUM \([0-9a-f]\{32\}\)$/\1/p' <<<"$1"; }

# volumes: for ext4, xfs and raw block, a pod writes, is deleted, and
# another reads back on a volume staged again.
volumes() {
	local fs sc out sum
	for fs in ext4 xfs; do
		sc=rnbd && [ $fs = ext4 ] || sc=rnbd-$fs
		pvc "data-$fs" "$sc" Filesystem >/dev/null
		out=$(run_pod "write-$fs" "data-$fs" Filesystem "$write_fs")
		sum=$(sum_of "$out")
		[ -n "$sum" ] || die "write-$fs: no sum in its log: $out"
		grep -q " /data $fs " <<<"$out" || die "write-$fs: /data is not $fs: $out"
		run_pod "read-$fs" "data-$fs" Filesystem "$(read_fs "$fs" "$sum")" | grep -q READ-OK
		eval "sum_$fs=$sum"
		say "$fs: written by one pod, read back by another ($sum)"
	done
	pvc data-block rnbd Block >/dev/null
	out=$(run_pod write-block data-block Block "$write_block")
	sum=$(sum_of "$out")
	[ -n "$sum" ] || die "write-block: no sum in its log: $out"
	run_pod read-block data-block Block "$(read_block "$sum")" | grep -q READ-OK
	say "raw block: written by one pod, read back by another ($sum)"
}

# resize: data-ext4 grown from 1 GiB to 2 GiB while a pod has it
# mounted: the file system in the pod grows (online expansion).
resize() {
	pod grower data-ext4 Filesystem 'sleep 86400' >/dev/null
	wait_until "pod grower running" 900 running grower
	local before
	before=$(kc exec grower -- df -k /data | awk 'NR == 2 {print $2}')
	kc patch pvc data-ext4 --type merge -p '{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}' >/dev/null
	wait_until "data-ext4 grown to 2 GiB in the running pod" 900 grown
	local after
	after=$(kc exec grower -- df -k /data | awk 'NR == 2 {print $2}')
	say "resize: /data in the running pod $before KiB -> $after KiB; the PVC says $(kc get pvc data-ext4 -o jsonpath='{.status.capacity.storage}')"
	kc delete pod grower --wait >/dev/null
	detached data-ext4
}
grown() {
	[ "$(kc exec grower -- df -k /data | awk 'NR == 2 {print $2}')" -gt 1600000 ] &&
		[ "$(kc get pvc data-ext4 -o jsonpath='{.status.capacity.storage}')" = 2Gi ]
}

# snapshot: a VolumeSnapshot of data-xfs, a PVC restored from it and a
# clone of data-ext4, each read back.
snapshot() {
	jq -n '{apiVersion: "snapshot.storage.k8s.io/v1", kind: "VolumeSnapshot", metadata: {name: "snap-xfs"},
		spec: {volumeSnapshotClassName: "rnbd", source: {persistentVolumeClaimName: "data-xfs"}}}' | kc apply -f - >/dev/null
	wait_until "snapshot snap-xfs ready" 600 snap_ready snap-xfs
	pvc restored-xfs rnbd-xfs Filesystem 1Gi '{"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap-xfs"}' >/dev/null
	run_pod read-restored restored-xfs Filesystem "$(read_fs xfs "$sum_xfs")" | grep -q READ-OK
	say "snapshot: a PVC restored from snap-xfs reads what data-xfs had"
	pvc clone-ext4 rnbd Filesystem 2Gi '{"kind": "PersistentVolumeClaim", "name": "data-ext4"}' >/dev/null
	run_pod read-clone clone-ext4 Filesystem "$(read_fs ext4 "$sum_ext4")" | grep -q READ-OK
	say "clone: clone-ext4 reads what data-ext4 had"
}
snap_ready() { [ "$(kc get volumesnapshot "$1" -o jsonpath='{.status.readyToUse}')" = true ]; }

# failure: a pod writes with fio (verify headers), the node's rnbd-client
# is killed (-9; started again as its unit does) and then the storage
# node's rnbd-server; fio reads every block back and checks it.
failure() {
	pvc fio-vol rnbd Block >/dev/null
	local job='--name=faults --filename=/dev/xvda --ioengine=psync --direct=1 --bs=4k --rw=randwrite --size=16m --verify=crc32c --verify_fatal=1'
	pod fio fio-vol Block "set -e; echo START; fio $job --do_verify=0; echo WRITTEN; fio $job --verify_only; echo VERIFIED" \
		rnbd-fio:test >/dev/null
	wait_until "fio writing" 900 log_has fio START
	sleep 3
	on_node sh -c 'kill -9 $(pidof rnbd-client)'
	say "failure: rnbd-client killed while fio writes"
	wait_until "rnbd-client started again" 120 on_node sh -c 'pidof rnbd-client'
	sleep 5
	on_node sh -c 'kill -9 $(pidof rnbd-server)'
	say "failure: rnbd-server killed while fio writes"
	! log_has fio WRITTEN || die "fio finished writing before the faults: make its job longer"
	# A request the kernel had sent on the killed client's socket waits
	# out nbd_io_timeout before it is sent again (about 2 minutes).
	wait_until "fio done" 2400 done_pod fio
	kc logs fio | tail -20
	[ "$(phase fio)" = Succeeded ] && log_has fio VERIFIED || die "fio found lost or wrong blocks (above)"
	say "failure: every block fio wrote reads back as written"
	kc delete pod fio --wait >/dev/null
	detached fio-vol
}
log_has() { kc logs "$1" 2>/dev/null | grep -qx "$2"; }

# cleanup_check: everything the tests made deleted; then nothing of it on
# the storage node (volume, export, grant, snapshot) nor on the node
# (mapping, mount, device).
cleanup_check() {
	kc delete pod --all --wait >/dev/null
	kc delete volumesnapshot --all --wait >/dev/null
	kc delete pvc --all --wait >/dev/null
	wait_until "every PV deleted" 600 none pv
	wait_until "every VolumeSnapshotContent deleted" 600 none volumesnapshotcontent
	# The node shell was deleted with the pods: the storage node's and the
	# client's own records, through a new one.
	install_shell
	local v e s d m
	v=$(on_node /opt/k8s/bin/rnbd-server volume list -f json)
	e=$(on_node /opt/k8s/bin/rnbd-server export list -f json)
	s=$(on_node /opt/k8s/bin/rnbd-server volume snapshot list -f json)
	d=$(on_node /opt/k8s/bin/rnbd-client device list -f json)
	m=$(on_node grep -E 'kubernetes.io~csi|/plugins/kubernetes.io/csi|ublkb|nbd' /proc/mounts || true)
	say "left: volumes $v, exports $e, snapshots $s, mappings $d, mounts '$m'"
	[ "$(jq length <<<"$v")" = 0 ] || die "volumes left on the storage node: $v"
	[ "$(jq length <<<"$e")" = 0 ] || die "exports left on the storage node: $e"
	[ "$(jq length <<<"$s")" = 0 ] || die "snapshots left on the storage node: $s"
	[ "$(jq length <<<"$d")" = 0 ] || die "mappings left on the node: $d"
	[ -z "$m" ] || die "mounts left on the node: $m"
	local dev
	dev=$(on_node sh -c 'ls /dev/ublkb* 2>/dev/null; for b in /sys/block/nbd*; do [ "$(cat $b/size)" = 0 ] || echo $b; done')
	[ -z "$dev" ] || die "devices left on the node: $dev"
}
none() { [ -z "$(kc get "$1" -o name)" ]; }

# e2e: the Kubernetes storage e2e suite ("External Storage") against the
# driver as installed, driven by test/k8s/testdriver.yaml, the specs of
# test/k8s/e2e-focus.txt the profile runs; the list of specs run and
# their results printed, the run's whole log in the work directory.
e2e() {
	local focus=() l p re
	while IFS= read -r l; do
		case $l in '#'* | '') continue ;; esac
		read -r p re <<<"$l"
		case $p in
		ci) ;;
		full) [ "$profile" = full ] || continue ;;
		*) die "test/k8s/e2e-focus.txt: a line's profile is ci or full: $l" ;;
		esac
		focus+=(-ginkgo.focus "External Storage \[Driver: rnbd\.csi\.rnbd\.io\] \[Testpattern: $re")
	done <test/k8s/e2e-focus.txt
	say "e2e: the $((${#focus[@]} / 2)) specs of test/k8s/e2e-focus.txt for the $profile profile"
	mkdir -p "$work/e2e"
	local rc=0
	ip netns exec "$ns" "$kbin/e2e.test" -kubeconfig "$work/cp/pki/admin.kubeconfig" -kubectl-path "$kbin/kubectl" \
		-provider skeleton -storage.testdriver "$PWD/test/k8s/testdriver.yaml" -report-dir "$work/e2e" \
		"${focus[@]}" -ginkgo.skip '\[Disruptive\]|\[Serial\]' -ginkgo.timeout 4h -ginkgo.no-color -ginkgo.v \
		-ginkgo.json-report "$work/e2e/report.json" >"$work/e2e/e2e.log" 2>&1 || rc=$?
	[ -s "$work/e2e/report.json" ] || { tail -40 "$work/e2e/e2e.log" >&2; die "the e2e suite wrote no report (exit $rc)"; }
	# One line per spec that ran: its state, time and name.
	jq -r '.[].SpecReports[] | select(.LeafNodeType == "It" and .State != "skipped") |
		"\(.State)\t\(.RunTime / 1e9 | floor) s\t\(.ContainerHierarchyTexts[1:] | join(" ")) \(.LeafNodeText)"' \
		"$work/e2e/report.json" | sed 's/^/e2e: /' >&2
	local passed failed ran
	passed=$(jq '[.[].SpecReports[] | select(.LeafNodeType == "It" and .State == "passed")] | length' "$work/e2e/report.json")
	ran=$(jq '[.[].SpecReports[] | select(.LeafNodeType == "It" and .State != "skipped")] | length' "$work/e2e/report.json")
	failed=$((ran - passed))
	say "e2e: $ran specs run, $passed passed, $failed failed (of $(jq '.[].PreRunStats.TotalSpecs' "$work/e2e/report.json") in the suite)"
	if [ "$failed" != 0 ] || [ "$rc" != 0 ] || [ "$ran" != $((${#focus[@]} / 2)) ]; then
		jq -r '.[].SpecReports[] | select(.LeafNodeType == "It" and .State != "passed" and .State != "skipped") |
			"\(.LeafNodeText): \(.Failure.Message // "" | .[0:1500])"' "$work/e2e/report.json" >&2
		die "the e2e suite: $failed of $ran failed (exit $rc; its log: $work/e2e/e2e.log)"
	fi
}

main "$@"; exit
