#!/usr/bin/env bash
# The container images of the Kubernetes tier, without a registry: each an
# OCI image layout of one layer, written as a tar that containerd imports
# (ctr -n k8s.io images import --local). They carry the names the
# manifests in deploy/ and the Kubernetes e2e suite use, so what runs is
# what users apply:
#
#   registry.k8s.io/pause:3.10.2            Kubernetes' own pause.c, static
#   registry.k8s.io/e2e-test-images/busybox:1.37.0-2   busybox-static
#   registry.k8s.io/e2e-test-images/{glibc-dns-testing:2.1.1,nginx:1.27.0-2}
#                                           the same busybox: the storage e2e
#                                           specs start them only for a shell
#   registry.k8s.io/e2e-test-images/agnhost:2.66.1
#                                           the same busybox with a /agnhost
#                                           that does pause (the specs'
#                                           host-exec pod)
#   docker.io/library/rnbd-csi:dev          rnbd-csi (deploy/ says rnbd-csi:dev) with what its node plugin
#                                           runs (mkfs, blkid, mount, …) from
#                                           this machine's Debian packages
#   docker.io/library/rnbd-fio:test         fio on busybox: the tier's own
#                                           failure case
#   registry.k8s.io/sig-storage/…           the sidecars test/k8s/build.sh
#                                           built; node-driver-registrar and
#                                           livenessprobe are tools/k8s's
#
#   test/k8s/images.sh K8S_BIN OUT    K8S_BIN: build.sh's bin directory
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
kbin=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
work=$(mktemp -d /tmp/rnbd-k8s-images.XXXXXX)
trap 'rm -rf "$work"' EXIT

say() { printf '== [%(%H:%M:%S)T] k8s images: %s\n' -1 "$*" >&2; }

# image NAME ROOT ENTRYPOINT...: $out/<NAME with / and : as _>.tar, an OCI
# layout of ROOT as one layer whose entry point is ENTRYPOINT.
image() {
	local name=$1 root=$2
	shift 2
	local d=$work/layout
	rm -rf "$d" && mkdir -p "$d/blobs/sha256"
	# A layer the same for the same files: sorted, owned by root, time 0.
	tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$root" -cf "$d/layer.tar" .
	local layer size
	layer=$(sha256sum "$d/layer.tar" | cut -d' ' -f1)
	size=$(stat -c %s "$d/layer.tar")
	mv "$d/layer.tar" "$d/blobs/sha256/$layer"
	local ep
	ep=$(printf '%s\n' "$@" | jq -R . | jq -s -c .)
	jq -n -c --arg diff "sha256:$layer" --argjson ep "$ep" '{
		created: "1970-01-01T00:00:00Z", architecture: "amd64", os: "linux",
		config: {Entrypoint: $ep, Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], WorkingDir: "/"},
		rootfs: {type: "layers", diff_ids: [$diff]},
		history: [{created: "1970-01-01T00:00:00Z", created_by: "rnbd test/k8s/images.sh"}]
	}' >"$d/config.json"
	local config csize
	config=$(sha256sum "$d/config.json" | cut -d' ' -f1)
	csize=$(stat -c %s "$d/config.json")
	mv "$d/config.json" "$d/blobs/sha256/$config"
	jq -n -c --arg c "sha256:$config" --argjson cs "$csize" --arg l "sha256:$layer" --argjson ls "$size" '{
		schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
		config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $c, size: $cs},
		layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar", digest: $l, size: $ls}]
	}' >"$d/manifest.json"
	local manifest msize
	manifest=$(sha256sum "$d/manifest.json" | cut -d' ' -f1)
	msize=$(stat -c %s "$d/manifest.json")
	mv "$d/manifest.json" "$d/blobs/sha256/$manifest"
	jq -n -c --arg m "sha256:$manifest" --argjson ms "$msize" --arg name "$name" '{
		schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json",
		manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $m, size: $ms,
			platform: {architecture: "amd64", os: "linux"},
			annotations: {"io.containerd.image.name": $name, "org.opencontainers.image.ref.name": ($name | sub("^.*:"; ""))}}]
	}' >"$d/index.json"
	echo '{"imageLayoutVersion":"1.0.0"}' >"$d/oci-layout"
	local file=$out/$(echo "$name" | tr '/:' '__').tar
	tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$d" -cf "$file" oci-layout index.json blobs
	say "$name ($(du -h "$file" | cut -f1))"
}

# elf ROOT FILE [AS]: FILE (at AS in ROOT, default its own path) with the
# shared libraries it needs.
elf() {
	local root=$1 f=$2 as=${3:-$2}
	mkdir -p "$root$(dirname "$as")"
	cp -L "$f" "$root$as"
	ldd "$f" 2>/dev/null | awk '/=> \// {print $3} /^\t\/.*ld-linux/ {print $1}' | while read -r lib; do
		[ -e "$root$lib" ] || { mkdir -p "$root$(dirname "$lib")"; cp -L "$lib" "$root$lib"; }
	done
}

# minimal ROOT: the directories and files every image has.
minimal() {
	mkdir -p "$1"/{etc,tmp,proc,sys,dev,run,var/run}
	chmod 1777 "$1/tmp"
	echo "root:x:0:0:root:/:/bin/sh" >"$1/etc/passwd"
	echo "root:x:0:" >"$1/etc/group"
}

# pause: Kubernetes' own, from the module the control plane was built from.
kdir=$(go mod download -json "k8s.io/kubernetes@$("$kbin/kubelet" --version | awk '{print $2}')" |
	sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
r=$work/pause && minimal "$r"
gcc -Os -static -DVERSION=3.10.2 -o "$r/pause" "$kdir/build/pause/linux/pause.c"
strip "$r/pause"
image registry.k8s.io/pause:3.10.2 "$r" /pause

# busybox: busybox-static with its applets as links.
r=$work/busybox && minimal "$r"
mkdir -p "$r/bin"
cp /bin/busybox "$r/bin/busybox"
for a in $(/bin/busybox --list); do [ -e "$r/bin/$a" ] || ln -s busybox "$r/bin/$a"; done
image registry.k8s.io/e2e-test-images/busybox:1.37.0-2 "$r" /bin/sh
# The storage e2e specs start these only for a shell (multiVolume's pods,
# the exec check's script): busybox under their names.
image registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1 "$r" /bin/sh
image registry.k8s.io/e2e-test-images/nginx:1.27.0-2 "$r" /bin/sh
# agnhost: the storage specs' host-exec pod (privileged, the node's root
# at /rootfs) runs agnhost's default, pause, and is exec'd into for
# `nsenter --mount=/rootfs/proc/1/ns/mnt -- sh -c CMD`: busybox has both;
# /agnhost does pause and says so of any other subcommand.
cat >"$r/agnhost" <<'AGNHOST'
#!/bin/sh
# rnbd's Kubernetes tier: a stand-in for agnhost with its pause only.
case ${1:-pause} in
pause)
	trap 'exit 0' TERM INT
	while :; do sleep 3600 & wait $!; done
	;;
*)
	echo "agnhost: this stand-in (rnbd test/k8s/images.sh) has pause only, not $1" >&2
	exit 2
	;;
esac
AGNHOST
chmod 755 "$r/agnhost"
image registry.k8s.io/e2e-test-images/agnhost:2.66.1 "$r" /agnhost
rm "$r/agnhost"

# rnbd-csi: the Containerfile's image, from this machine's packages.
r=$work/rnbd-csi && minimal "$r"
mkdir -p "$r/usr/bin"
CGO_ENABLED=0 go build -trimpath -ldflags "$(scripts/version.sh)" -o "$r/usr/bin/" ./cmd/rnbd-csi
for t in mkfs.ext4 mke2fs e2fsck resize2fs dumpe2fs mkfs.xfs xfs_growfs xfs_io xfs_repair blkid blockdev mount umount fsck findmnt; do
	p=$(command -v "$t") || { echo "images: $t is not installed (e2fsprogs, xfsprogs, util-linux, mount)" >&2; exit 1; }
	elf "$r" "$(readlink -f "$p")" "$p"
done
ln -sf "$(command -v e2fsck)" "$r$(dirname "$(command -v fsck)")/fsck.ext4"
cp /etc/mke2fs.conf "$r/etc/"
# deploy/ says rnbd-csi:dev, which the kubelet asks of containerd as the
# name it normalises to.
image docker.io/library/rnbd-csi:dev "$r" /usr/bin/rnbd-csi

# rnbd-fio:test: fio on busybox, for the tier's failure case (fio's
# verify in a pod); the tests' own image, named nowhere in deploy/.
r=$work/rnbd-fio && minimal "$r"
mkdir -p "$r/bin"
cp /bin/busybox "$r/bin/busybox"
for a in $(/bin/busybox --list); do [ -e "$r/bin/$a" ] || ln -s busybox "$r/bin/$a"; done
p=$(command -v fio) || { echo "images: fio is not installed" >&2; exit 1; }
elf "$r" "$(readlink -f "$p")" /usr/bin/fio
image docker.io/library/rnbd-fio:test "$r" /bin/sh

# The sidecars: static binaries at the paths their images have them,
# under the names deploy/ gives them; a version there that
# is not the one build.sh built is an error (the image would lie).
reg=registry.k8s.io/sig-storage
named() {
	local n
	n=$(grep -ho "image: $reg/$1:v[0-9.]*" "$repo"/deploy/kubernetes/*.yaml | head -1 | sed 's/^image: //')
	[ -n "$n" ] || { echo "images: deploy/ names no $reg/$1 image" >&2; exit 1; }
	echo "$n"
}
# sidecar IMAGE BIN AT: the sidecar BIN at AT in image IMAGE (as deploy/
# names it); with a version, BIN must say it.
sidecar() {
	local name=$1 bin=$2 at=$3 want
	want=$(named "$name")
	local got
	got=$("$bin" --version 2>&1 | grep -o 'v[0-9][0-9.]*' | head -1 || true)
	if [ -n "$got" ] && [ "${want##*:}" != "$got" ]; then
		echo "images: deploy/ runs $want, test/k8s/build.sh built $got" >&2
		exit 1
	fi
	local r=$work/$name && minimal "$r"
	cp "$bin" "$r$at"
	image "$want" "$r" "$at"
}
sidecar csi-provisioner "$kbin/csi-provisioner" /csi-provisioner
sidecar csi-attacher "$kbin/csi-attacher" /csi-attacher
sidecar csi-resizer "$kbin/csi-resizer" /csi-resizer
sidecar csi-snapshotter "$kbin/csi-snapshotter" /csi-snapshotter
# external-snapshotter v8.7.0's own manifest still names v8.6.0's image:
# the tier runs the one it built, under its own version (run.sh sets it).
r=$work/snapshot-controller && minimal "$r"
cp "$kbin/snapshot-controller" "$r/snapshot-controller"
image "$reg/snapshot-controller:$("$kbin/snapshot-controller" --version 2>&1 | grep -o 'v[0-9][0-9.]*' | head -1)" "$r" /snapshot-controller
# Ours (tools/k8s), under the names deploy/ gives the real ones; they say
# no version.
CGO_ENABLED=0 go build -trimpath -o "$work/bin/" ./tools/k8s/registrar ./tools/k8s/livenessprobe
sidecar csi-node-driver-registrar "$work/bin/registrar" /csi-node-driver-registrar
sidecar livenessprobe "$work/bin/livenessprobe" /livenessprobe
