#!/usr/bin/env bash
# The Kubernetes tier (make test-k8s): rnbd-csi under a real Kubernetes.
# Being built (issue 41); docs/testing.md says what it does and what is to
# come. What it does today:
#
#   build     test/k8s/build.sh: the pinned Kubernetes, etcd, containerd,
#             runc, CNI plugins and CSI sidecars from the Go module proxy,
#             cached by version (K8S_CACHE);
#   images    test/k8s/images.sh: the images, as OCI layouts;
#   netns     a network namespace of its own: a tap device for the guest
#             (ADDR, the control plane's address, on it) and the API
#             server's service address 10.96.0.1 on its loopback;
#   control-plane  test/k8s/controlplane.sh: etcd, kube-apiserver,
#             kube-controller-manager, kube-scheduler, natively, in it;
#   boot      test/k8s/guest.sh: the node, a qemu guest on that tap device
#             (containerd, runc, CNI, the kubelet: test/k8s/guest/init.sh);
#   node-ready  until the kubelet has registered the node and it is Ready;
#   apply     deploy/ as users apply it: the snapshot CRDs and controller
#             (external-snapshotter's own manifests), deploy/kubernetes,
#             the controller's certificate as a Secret, the example
#             StorageClass and VolumeSnapshotClass;
#   check     read back as the API server holds them;
#   pods      until every pod is Ready (K8S_POD_TIMEOUT, 900 s), or what
#             the kubelet says of those that are not;
#
# then everything it started is stopped and the namespace removed; the
# time of each step is printed. Root. K8S_KEEP=1 keeps the work directory.
#
# The whole script is one function, read before it runs: editing the file
# during a run does not change that run.
set -euo pipefail

main() {
	cd "$(dirname "$0")/../.."
	local t_start=$SECONDS
	[ "$(id -u)" = 0 ] || die "the Kubernetes tier needs root (a network namespace)"
	for c in openssl jq ip mkfs.ext4; do command -v "$c" >/dev/null || die "$c is not installed"; done

	work=$(mktemp -d /tmp/rnbd-k8s.XXXXXX)
	ns=rnbd-k8s-$$
	addr=10.231.0.1
	guest=10.231.0.2
	node=rnbd-node-1
	qemu_pid=
	trap cleanup EXIT

	step build build
	step images test/k8s/images.sh "$kbin" "$work/images"
	step netns netns
	step control-plane test/k8s/controlplane.sh start "$kbin" "$work/cp" "$ns" "$addr" "$node"
	step boot boot
	step node-ready ready
	step apply apply
	step check check
	step pods pods
	say "passed in $((SECONDS - t_start)) s: ${steps[*]}"
}

say() { printf '== [%(%H:%M:%S)T] k8s: %s\n' -1 "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

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

boot() {
	test/k8s/guest.sh "$kbin" "$work/images" "$work/cp" "$work/guest" "$ns" k8stap "$guest" "$addr" "$node"
	qemu_pid=$(cat "$work/guest/qemu.pid")
	# Replies to pods (10.244.0.0/24, the node's bridge) go back through it.
	ip -n "$ns" route add 10.244.0.0/24 via "$guest" dev k8stap onlink
}

kc() { ip netns exec "$ns" "$kbin/kubectl" --kubeconfig "$work/cp/pki/admin.kubeconfig" "$@"; }

# guest_gone: the guest's last console lines, and fail.
guest_gone() {
	tail -40 "$work/guest/serial.log" | cut -c1-2000 >&2
	die "the guest ended"
}

ready() {
	local t0=$SECONDS
	until kc get node "$node" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True; do
		kill -0 "$qemu_pid" 2>/dev/null || guest_gone
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

apply() {
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
	# deploy/kubernetes as the install section says: the namespace first.
	kc apply -f deploy/kubernetes/namespace.yaml
	kc apply -f deploy/kubernetes/
	# The controller's certificate, made as docs/kubernetes.md says
	# (examples/secret.yaml only shows the Secret's layout).
	scripts/test-ca.sh "$work/rnbd-pki" ca >/dev/null
	scripts/test-ca.sh "$work/rnbd-pki" client csi-controller >/dev/null
	kc -n rnbd-csi create secret generic rnbd-csi-provisioner --from-file=tls.crt="$work/rnbd-pki/csi-controller.crt" \
		--from-file=tls.key="$work/rnbd-pki/csi-controller.key" --from-file=ca.crt="$work/rnbd-pki/ca.crt"
	kc apply -f deploy/kubernetes/examples/storageclass.yaml -f deploy/kubernetes/examples/volumesnapshotclass.yaml
}

check() {
	local got
	got=$(kc get csidriver rnbd.csi.rnbd.io -o json | jq -c '.spec | {attachRequired, podInfoOnMount, storageCapacity, volumeLifecycleModes}')
	say "CSIDriver: $got"
	[ "$(jq -r .storageCapacity <<<"$got")" = true ] || die "the CSIDriver does not say storageCapacity: true"
	kc -n rnbd-csi get deployment/rnbd-csi-controller daemonset/rnbd-csi-node -o name
	local sc
	sc=$(kc get storageclass -o jsonpath='{.items[*].provisioner}')
	[[ $sc == *rnbd.csi.rnbd.io* ]] || die "no StorageClass of rnbd.csi.rnbd.io ($sc)"
	kc get volumesnapshotclass -o name | grep -q . || die "no VolumeSnapshotClass"
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
}

main "$@"; exit
