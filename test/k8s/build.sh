#!/usr/bin/env bash
# Builds the pinned Kubernetes the Kubernetes tier runs (make test-k8s)
# from the Go module proxy: the control plane and kubelet, the e2e suite's
# storage tests for external drivers, etcd, containerd and runc, the CNI
# plugins, the CSI sidecars and the snapshot controller with its CRDs. Each component goes to a directory of the
# cache named by its version, built once: a warm run builds nothing.
#
#   test/k8s/build.sh            build what is missing; print the bin dir
#   test/k8s/build.sh --deps     install what the build needs from apt
#                                and exit (.ci/run, before it starts the
#                                build beside steps that use apt too)
#   K8S_CACHE=DIR                the cache (default /var/cache/rnbd-k8s, as
#                                the VM tier keeps its own in /var/cache/rnbd-vm)
#
# Every binary is built with -trimpath and says its version. The cold
# build takes about 1,900 CPU-seconds by its parts' figures (about 18–20
# minutes on 2 idle cores; docs/testing.md).
set -euo pipefail

K8S_VERSION=v1.37.2        # k8s.io/kubernetes; its staging modules are v0.37.2
K8S_STAGING=v0.37.2
ETCD_VERSION=v3.6.16
CONTAINERD_VERSION=v2.4.2
RUNC_VERSION=v1.5.3
CNI_VERSION=v1.10.0
PROVISIONER_VERSION=v6.4.0
ATTACHER_VERSION=v4.13.0
RESIZER_VERSION=v2.3.0
SNAPSHOTTER_VERSION=v8.7.0

# runc's seccomp: libseccomp's static library (Debian's libseccomp-dev).
if [ ! -e /usr/lib/x86_64-linux-gnu/libseccomp.a ]; then
	[ "$(id -u)" = 0 ] || { echo "k8s build: libseccomp-dev is needed (runc with seccomp)" >&2; exit 1; }
	DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq libseccomp-dev >/dev/null
fi
[ "${1:-}" != --deps ] || exit 0
[ $# = 0 ] || { echo "usage: test/k8s/build.sh [--deps]" >&2; exit 2; }

CACHE=${K8S_CACHE:-/var/cache/rnbd-k8s}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
BIN=$CACHE/bin
mkdir -p "$BIN"
export GOTOOLCHAIN=local GOWORK=off GOFLAGS=
ldflags="-s -w"

say() { printf '== [%(%H:%M:%S)T] k8s build: %s\n' -1 "$*" >&2; }

# built NAME VERSION: whether $CACHE/NAME-VERSION is complete.
built() { [ -e "$CACHE/$1-$2/.done" ]; }

# finish NAME VERSION DIR: DIR becomes $CACHE/NAME-VERSION, complete.
finish() {
	touch "$3/.done"
	rm -rf "${CACHE:?}/$1-$2"
	mv "$3" "$CACHE/$1-$2"
}

# moddir MODULE@VERSION: the module's directory in the module cache.
moddir() { go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'; }

# timed NAME CMD...: runs CMD, saying how long it took.
timed() {
	local name=$1 t0=$SECONDS
	shift
	say "$name"
	"$@"
	say "$name: $((SECONDS - t0)) s"
}

# kmod DIR: a scratch module in DIR requiring k8s.io/kubernetes, its
# staging modules at their release; kflags: the version stamp.
kmod() {
	local d=$1 gomod
	gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
	{
		echo "module rnbd.test/k8s"
		echo
		echo "go 1.26"
		echo
		echo "require k8s.io/kubernetes $K8S_VERSION"
		echo
		echo "replace ("
		# Each staging module at its release: the same list as
		# k8s.io/kubernetes's own replace block, less the samples
		# (not served, not needed).
		sed -n '/^replace (/,/^)/p' "$gomod" | awk '$2 == "=>" && $1 !~ /sample-(cli-plugin|controller)$/ {print "\t" $1 " => " $1 " '"$K8S_STAGING"'"}'
		echo ")"
	} >"$d/go.mod"
	local major=${K8S_VERSION#v} minor
	minor=${major#*.}
	minor=${minor%%.*}
	major=${major%%.*}
	local v=k8s.io/component-base/version
	kflags="$ldflags -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=$major -X $v.gitMinor=$minor -X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z"
	kflags="$kflags -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=$major -X k8s.io/client-go/pkg/version.gitMinor=$minor"
}

kubernetes() {
	local d=$CACHE/.work/kubernetes
	rm -rf "$d" && mkdir -p "$d/out"
	kmod "$d"
	(cd "$d" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags "$kflags" -o out/ \
		k8s.io/kubernetes/cmd/kubelet \
		k8s.io/kubernetes/cmd/kube-apiserver \
		k8s.io/kubernetes/cmd/kube-controller-manager \
		k8s.io/kubernetes/cmd/kube-scheduler \
		k8s.io/kubernetes/cmd/kubectl)
	finish kubernetes "$K8S_VERSION" "$d/out"
}

# e2e: the Kubernetes e2e suite's binary with only its storage tests for
# external drivers (test/e2e/storage/external, driven by a test-driver
# file): the suite's own main files, every other test package left out.
e2e() {
	local d=$CACHE/.work/e2e
	rm -rf "$d" && mkdir -p "$d/out" "$d/e2e"
	kmod "$d"
	local src
	src=$(moddir "k8s.io/kubernetes@$K8S_VERSION")/test/e2e
	cp "$src/e2e.go" "$src/suites.go" "$d/e2e/"
	# The test packages it imports for their specs, but external.
	sed -E '/^\s*_ "k8s\.io\/kubernetes\/test\/e2e\/(apimachinery|apps|architecture|auth|autoscaling|common|dra|instrumentation|invariants|kubectl|network|node|scheduling|storage|storage\/csimock|windows)"$/d' \
		"$src/e2e_test.go" >"$d/e2e/e2e_test.go"
	chmod u+w "$d"/e2e/*
	grep -q '_ "k8s.io/kubernetes/test/e2e/storage/external"' "$d/e2e/e2e_test.go" ||
		{ echo "k8s build: e2e_test.go does not import the external storage tests" >&2; return 1; }
	(cd "$d" && CGO_ENABLED=0 GOFLAGS=-mod=mod go test -c -trimpath -ldflags "$kflags" -o out/e2e.test ./e2e)
	finish e2e "$K8S_VERSION" "$d/out"
}

etcd() {
	local d=$CACHE/.work/etcd
	rm -rf "$d" && mkdir -p "$d/out"
	cat >"$d/go.mod" <<-EOF
		module rnbd.test/etcd

		go 1.26

		require go.etcd.io/etcd/server/v3 $ETCD_VERSION
	EOF
	cat >"$d/main.go" <<-'EOF'
		// etcd's own main: the server of go.etcd.io/etcd/server/v3.
		package main

		import (
			"os"

			"go.etcd.io/etcd/server/v3/etcdmain"
		)

		func main() { etcdmain.Main(os.Args) }
	EOF
	(cd "$d" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags "$ldflags" -o out/etcd .)
	finish etcd "$ETCD_VERSION" "$d/out"
}

containerd() {
	local d=$CACHE/.work/containerd
	rm -rf "$d" && mkdir -p "$d/out"
	local m=github.com/containerd/containerd/v2
	CGO_ENABLED=0 GOBIN=$d/out go install -trimpath \
		-ldflags "$ldflags -X $m/version.Version=$CONTAINERD_VERSION -X $m/version.Revision=release" \
		"$m/cmd/containerd@$CONTAINERD_VERSION" \
		"$m/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
		"$m/cmd/ctr@$CONTAINERD_VERSION"
	finish containerd "$CONTAINERD_VERSION" "$d/out"
}

runc() {
	local d=$CACHE/.work/runc
	rm -rf "$d" && mkdir -p "$d/out"
	# cgo (nsenter, libseccomp), static: deploy/ runs every container
	# with the RuntimeDefault seccomp profile, which a runc without
	# seccomp refuses.
	CGO_ENABLED=1 GOBIN=$d/out go install -trimpath -tags "seccomp netgo osusergo" \
		-ldflags "$ldflags -X main.version=${RUNC_VERSION#v} -extldflags -static" \
		"github.com/opencontainers/runc@$RUNC_VERSION"
	finish runc "$RUNC_VERSION-seccomp" "$d/out"
}

cni() {
	local d=$CACHE/.work/cni
	rm -rf "$d" && mkdir -p "$d/out"
	local m=github.com/containernetworking/plugins
	CGO_ENABLED=0 GOBIN=$d/out go install -trimpath \
		-ldflags "$ldflags -X $m/pkg/utils/buildversion.BuildVersion=$CNI_VERSION" \
		"$m/plugins/main/bridge@$CNI_VERSION" \
		"$m/plugins/main/loopback@$CNI_VERSION" \
		"$m/plugins/ipam/host-local@$CNI_VERSION"
	finish cni "$CNI_VERSION" "$d/out"
}

# sidecar NAME MODULE VERSION CMD...: a kubernetes-csi sidecar's
# commands, built as dependencies of one scratch module: Kubernetes' (as
# kmod makes it) requiring every sidecar the tier runs. The sidecars'
# own modules carry replace directives, which a dependency's do not
# apply: the Kubernetes libraries are those of the Kubernetes built
# (v0.37.2, where the sidecars ask v0.37.0 or v0.37.1), so most of their
# compilation is Kubernetes', already in the build cache.
sidecar() {
	local name=$1 mod=$2 ver=$3
	shift 3
	local d=$CACHE/.work/$name
	rm -rf "$d" && mkdir -p "$d/out"
	kmod "$d"
	(cd "$d" && go mod edit "${SIDECARS[@]/#/-require=}")
	local c
	for c in "$@"; do
		(cd "$d" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags "$ldflags -X main.version=$ver" -o out/ "$mod/cmd/$c")
	done
	if [ "$name" = external-snapshotter ]; then
		local src
		src=$(moddir "$mod@$ver")
		mkdir -p "$d/out/crd"
		# (its kustomization.yaml is no object to apply)
		cp "$(moddir "${mod%/v8}/client/v8@$ver")"/config/crd/*storage.k8s.io_*.yaml "$d/out/crd/"
		# The snapshot controller's own deployment and RBAC.
		mkdir -p "$d/out/snapshot-controller-deploy"
		cp "$src"/deploy/kubernetes/snapshot-controller/{rbac,setup}-snapshot-controller.yaml "$d/out/snapshot-controller-deploy/"
		chmod u+w "$d/out/crd/"* "$d/out/snapshot-controller-deploy/"*
	fi
	finish "$name" "$ver+k8s$K8S_STAGING" "$d/out"
}
SIDECARS=(
	"github.com/kubernetes-csi/external-provisioner/v6@$PROVISIONER_VERSION"
	"github.com/kubernetes-csi/external-attacher/v4@$ATTACHER_VERSION"
	"github.com/kubernetes-csi/external-resizer/v2@$RESIZER_VERSION"
	"github.com/kubernetes-csi/external-snapshotter/v8@$SNAPSHOTTER_VERSION"
	"github.com/kubernetes-csi/external-snapshotter/client/v8@$SNAPSHOTTER_VERSION"
)

total=$SECONDS
built kubernetes "$K8S_VERSION" || timed "kubernetes $K8S_VERSION" kubernetes
built e2e "$K8S_VERSION" || timed "the e2e suite (storage, external) $K8S_VERSION" e2e
built etcd "$ETCD_VERSION" || timed "etcd $ETCD_VERSION" etcd
built containerd "$CONTAINERD_VERSION" || timed "containerd $CONTAINERD_VERSION" containerd
built runc "$RUNC_VERSION-seccomp" || timed "runc $RUNC_VERSION" runc
built cni "$CNI_VERSION" || timed "cni plugins $CNI_VERSION" cni
built external-provisioner "$PROVISIONER_VERSION+k8s$K8S_STAGING" ||
	timed "external-provisioner $PROVISIONER_VERSION" sidecar external-provisioner \
		github.com/kubernetes-csi/external-provisioner/v6 "$PROVISIONER_VERSION" csi-provisioner
built external-attacher "$ATTACHER_VERSION+k8s$K8S_STAGING" ||
	timed "external-attacher $ATTACHER_VERSION" sidecar external-attacher \
		github.com/kubernetes-csi/external-attacher/v4 "$ATTACHER_VERSION" csi-attacher
built external-resizer "$RESIZER_VERSION+k8s$K8S_STAGING" ||
	timed "external-resizer $RESIZER_VERSION" sidecar external-resizer \
		github.com/kubernetes-csi/external-resizer/v2 "$RESIZER_VERSION" csi-resizer
built external-snapshotter "$SNAPSHOTTER_VERSION+k8s$K8S_STAGING" ||
	timed "external-snapshotter $SNAPSHOTTER_VERSION" sidecar external-snapshotter \
		github.com/kubernetes-csi/external-snapshotter/v8 "$SNAPSHOTTER_VERSION" csi-snapshotter snapshot-controller
rm -rf "$CACHE/.work"

# One directory of links, for PATH.
for c in "kubernetes-$K8S_VERSION" "e2e-$K8S_VERSION" "etcd-$ETCD_VERSION" "containerd-$CONTAINERD_VERSION" \
	"runc-$RUNC_VERSION-seccomp" "cni-$CNI_VERSION" "external-provisioner-$PROVISIONER_VERSION+k8s$K8S_STAGING" \
	"external-attacher-$ATTACHER_VERSION+k8s$K8S_STAGING" "external-resizer-$RESIZER_VERSION+k8s$K8S_STAGING" \
	"external-snapshotter-$SNAPSHOTTER_VERSION+k8s$K8S_STAGING"; do
	for f in "$CACHE/$c"/*; do
		[ -f "$f" ] && [ -x "$f" ] && ln -sfn "$f" "$BIN/$(basename "$f")"
	done
done
ln -sfn "$CACHE/external-snapshotter-$SNAPSHOTTER_VERSION+k8s$K8S_STAGING/crd" "$BIN/snapshot-crd"
ln -sfn "$CACHE/external-snapshotter-$SNAPSHOTTER_VERSION+k8s$K8S_STAGING/snapshot-controller-deploy" "$BIN/snapshot-controller-deploy"
say "done in $((SECONDS - total)) s: $BIN"
echo "$BIN"
