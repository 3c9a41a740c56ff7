#!/usr/bin/env bash
# Build the rnbd-server, rnbd-client and rnbd-csi Debian packages from
# this tree:
#   scripts/mkdeb.sh [OUTDIR]        (default build/deb)
# The daemons' binaries in /usr/sbin, units in /lib/systemd/system,
# /etc/rnbd/*.toml as conffiles, modules-load.d, man pages and bash
# completions generated from the commands, the docs. rnbd-csi, the CSI
# driver, is a package of its own (csipkg below): what a Kubernetes
# node's image installs, apart from the storage daemons. The version comes from git (scripts/version.sh):
# the newest tag, or 0.0 and the commit's date and hash
# (0.0~git20261125.4951b1b-1); RNBD_DEB_VERSION overrides it. The
# binaries and the man pages say the same. Needs dpkg-dev
# (dpkg-shlibdeps).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${1:-build/deb}
mkdir -p "$out"
out=$(cd "$out" && pwd)

version=${RNBD_DEB_VERSION:-$(scripts/version.sh -v)-1}
arch=$(dpkg --print-architecture)
maint="rnbd developers <rnbd@example.org>"
date=$(git log -1 --format=%cD)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The binaries say the package's version (rnbd-server --version).
CGO_ENABLED=1 go build -trimpath -buildmode=pie -ldflags "-s -w $(RNBD_VERSION=$version scripts/version.sh)" \
	-o "$work/bin/" ./cmd/rnbd-server ./cmd/rnbd-client ./cmd/rnbd-csi
# The man pages carry the commit's date, not the build's.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}
"$work/bin/rnbd-server" man "$work/man"
"$work/bin/rnbd-client" man "$work/man"
"$work/bin/rnbd-csi" man "$work/man"

# depends BINARY: the shared libraries' packages (dpkg-shlibdeps wants a
# debian/control to look at).
depends() {
	mkdir -p "$work/shl/debian"
	printf 'Source: rnbd\n\nPackage: rnbd\nArchitecture: any\n' >"$work/shl/debian/control"
	local d
	d=$(cd "$work/shl" && dpkg-shlibdeps -O -e "$1" 2>"$work/shl/err" | sed -n 's/^shlibs:Depends=//p')
	[ -n "$d" ] || { cat "$work/shl/err" >&2; echo "mkdeb: dpkg-shlibdeps found no dependencies of $1" >&2; exit 1; }
	echo "$d"
}

# pkg NAME DESCRIPTION-LINE: one package; the rest of the description
# comes on stdin.
pkg() {
	local name=$1 short=$2 root=$work/$1 doc
	local long
	long=$(cat)
	doc=$root/usr/share/doc/$name
	install -d "$root/DEBIAN" "$root/usr/sbin" "$root/lib/systemd/system" "$root/etc/rnbd" \
		"$root/usr/lib/modules-load.d" "$root/usr/share/man/man5" "$root/usr/share/man/man8" \
		"$root/usr/share/bash-completion/completions" "$doc"
	install -m 0755 "$work/bin/$name" "$root/usr/sbin/"
	install -m 0644 "deploy/$name".service "deploy/$name"-*.service "$root/lib/systemd/system/" 2>/dev/null ||
		install -m 0644 "deploy/$name.service" "$root/lib/systemd/system/"
	install -m 0644 "deploy/${name#rnbd-}.toml" "$root/etc/rnbd/"
	install -m 0644 "deploy/modules-load.d/$name.conf" "$root/usr/lib/modules-load.d/"
	for m in "$work/man/$name".8 "$work/man/$name"-*.8; do
		gzip -9n <"$m" >"$root/usr/share/man/man8/$(basename "$m").gz"
	done
	gzip -9n <"$work/man/$name.toml.5" >"$root/usr/share/man/man5/$name.toml.5.gz"
	"$work/bin/$name" completion bash >"$root/usr/share/bash-completion/completions/$name"
	if [ "$name" = rnbd-client ]; then
		install -d "$root/lib/udev/rules.d"
		install -m 0644 deploy/udev/60-rnbd.rules "$root/lib/udev/rules.d/"
	fi
	for d in README.md docs/operations.md docs/metrics.md docs/control-api.md "docs/${name#rnbd-}.md"; do
		gzip -9n <"$d" >"$doc/$(basename "$d").gz"
	done
	debian_docs "$name" "$doc"
	echo "/etc/rnbd/${name#rnbd-}.toml" >"$root/DEBIAN/conffiles"
	local deps
	deps=$(depends "$root/usr/sbin/$name")
	# The server's pools: lvm2 drives an LVM thin pool; a directory
	# pool's clones and snapshots want a file system with reflinks.
	local suggests=""
	[ "$name" != rnbd-server ] || suggests=$'\nSuggests: lvm2, thin-provisioning-tools, xfsprogs'
	cat >"$root/DEBIAN/control" <<EOF
Package: $name
Version: $version
Architecture: $arch
Maintainer: $maint
Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)
Depends: $deps, kmod${suggests}
Section: admin
Priority: optional
Homepage: https://github.com/rnbd/rnbd
Description: $short
$long
EOF
	maintscripts "$name"
	build "$name"
}

# debian_docs NAME DOCDIR: the copyright and changelog every package has.
debian_docs() {
	local name=$1 doc=$2
	cat >"$doc/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: rnbd
Comment: a userspace Go implementation of the Linux RNBD/RTRS block
 transport. The project has not chosen a license yet: all rights are
 reserved by its authors until it does.

Files: *
Copyright: 2026 the rnbd developers
License: none
 No license has been granted yet.
EOF
	{
		echo "$name ($version) unstable; urgency=medium"
		echo
		echo "  * Built from git $(git rev-parse --short HEAD): $(git log -1 --format=%s | cut -c1-44)."
		echo
		echo " -- $maint  $date"
	} | gzip -9n >"$doc/changelog.Debian.gz"
}

# build NAME: the .deb of the tree $work/NAME, its DEBIAN/control written.
build() {
	local name=$1 root=$work/$1
	(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum >DEBIAN/md5sums)
	dpkg-deb --root-owner-group -Zxz --build "$root" "$out/${name}_${version}_${arch}.deb" >/dev/null
	echo "$out/${name}_${version}_${arch}.deb"
}

# csipkg: rnbd-csi, the CSI driver. Kubernetes runs it in a container
# (deploy/kubernetes), so no unit, no conffile and no maintainer scripts:
# the binary in /usr/bin (where the Containerfile's image has it), its man
# pages, docs/kubernetes.md, and the example configuration, which is
# deploy/kubernetes/config.yaml's csi.toml (the ConfigMap's;
# internal/csi's TestKubernetesConfigMapLoads loads it).
# Depends are what the node plugin runs for the default ext4 volumes:
# mkfs.ext4 and resize2fs (e2fsprogs), mount and umount (mount); blkid is
# util-linux's, which is essential. xfsprogs (mkfs.xfs, xfs_growfs) is
# only for StorageClasses with fsType xfs: Recommends. The controller
# needs none of them, nor rnbd-client, which the node plugin drives on
# the host (Suggests).
csipkg() {
	local name=rnbd-csi root=$work/rnbd-csi
	local doc=$root/usr/share/doc/$name
	install -d "$root/DEBIAN" "$root/usr/bin" "$root/usr/share/man/man5" "$root/usr/share/man/man8" "$doc/examples"
	install -m 0755 "$work/bin/$name" "$root/usr/bin/"
	gzip -9n <"$work/man/$name.8" >"$root/usr/share/man/man8/$name.8.gz"
	gzip -9n <"$work/man/$name.toml.5" >"$root/usr/share/man/man5/$name.toml.5.gz"
	{
		echo "# rnbd-csi's configuration, /etc/rnbd/csi.toml (rnbd-csi.toml(5)):"
		echo "# the csi.toml of deploy/kubernetes/config.yaml, the ConfigMap rnbd-csi-config."
		echo
		awk '/^  csi\.toml: \|$/ { f = 1; next } f && NF && !/^    / { exit } f { sub(/^    /, ""); print }' \
			deploy/kubernetes/config.yaml
	} >"$work/csi.toml"
	for t in '[tls]' '[[storage_node]]' '[node]'; do
		grep -qxF "$t" "$work/csi.toml" || { echo "mkdeb: no $t in deploy/kubernetes/config.yaml's csi.toml" >&2; exit 1; }
	done
	install -m 0644 "$work/csi.toml" "$doc/examples/csi.toml"
	for d in README.md docs/kubernetes.md; do
		gzip -9n <"$d" >"$doc/$(basename "$d").gz"
	done
	debian_docs "$name" "$doc"
	local deps
	deps=$(depends "$root/usr/bin/$name")
	cat >"$root/DEBIAN/control" <<EOF
Package: $name
Version: $version
Architecture: $arch
Maintainer: $maint
Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)
Depends: $deps, e2fsprogs, mount
Recommends: xfsprogs
Suggests: rnbd-client
Section: admin
Priority: optional
Homepage: https://github.com/rnbd/rnbd
Description: RNBD CSI driver: Kubernetes volumes on rnbd storage nodes
 rnbd-csi is the Container Storage Interface driver of rnbd. Its
 controller creates, publishes, expands, snapshots and deletes volumes on
 rnbd-server storage nodes through their admin API (mutual TLS); its node
 plugin maps them on each worker through the worker's rnbd-client daemon,
 formats them (ext4 or xfs) only when they hold no file system, and
 mounts them. Kubernetes runs it in containers with the standard CSI
 sidecars (deploy/kubernetes in the source, docs/kubernetes.md here).
EOF
	build "$name"
}

# The daemons' data, beside their units' (maintscripts below): what the
# configure step makes, and what purge removes (Debian policy: purge
# removes what the package and its daemons created; remove keeps it, so
# that a reinstall serves the same exports and mappings). Both daemons
# keep their state in /var/lib/rnbd; each package removes its own file,
# and the directory goes with the last. /srv/rnbd, where rnbd-server's
# unit may write, goes only while it is empty: exported files are never
# removed. A state_file set elsewhere is left where it is.
#
# data_configure NAME: shell for postinst.
data_configure() {
	[ "$1" = rnbd-server ] || return 0
	cat <<'EOF'
# The export directory the unit may write (ReadWritePaths=-/srv/rnbd),
# 0700 as the state directory; one that is there is left as it is.
if [ "$1" = configure ] && [ ! -e /srv/rnbd ]; then
	install -d -m 0700 /srv/rnbd
fi
EOF
}

# data_purge NAME: shell for postrm's purge, after the daemon stopped.
data_purge() {
	local state=${1#rnbd-} other=rnbd-client
	[ "$1" = rnbd-server ] || other=rnbd-server
	echo "	rm -f /var/lib/rnbd/$state.json /run/rnbd/$state.sock"
	if [ "$1" = rnbd-server ]; then
		echo '	rmdir /srv/rnbd 2>/dev/null || true'
	else
		echo '	rm -rf /run/rnbd/devlinks'
	fi
	cat <<EOF
	# A state save's temporary file, left by a daemon that died in it:
	# only when the other daemon is not installed (it may be saving).
	if [ ! -e /usr/sbin/$other ]; then
		rm -f /var/lib/rnbd/.state-*
	fi
	rmdir /var/lib/rnbd /run/rnbd 2>/dev/null || true
EOF
}

# maintscripts NAME: enable the unit on install and restart it on upgrade
# (as debhelper's snippets do, with deb-systemd-helper/-invoke, which do
# nothing where systemd is not running); stop it on removal, forget it
# on purge. A first install does not start the daemon: its configuration
# (listen addresses, TLS) is for the operator to set first.
maintscripts() {
	local name=$1 root=$work/$1 unit
	unit=$(cd "$root/lib/systemd/system" && echo *.service)
	cat >"$root/DEBIAN/postinst" <<EOF
#!/bin/sh
set -e
$(data_configure "$name")
if [ "\$1" = configure ] || [ "\$1" = abort-upgrade ] || [ "\$1" = abort-deconfigure ] || [ "\$1" = abort-remove ]; then
	for u in $unit; do
		if deb-systemd-helper debian-installed \$u; then
			# An upgrade: the unit keeps its enablement.
			deb-systemd-helper unmask \$u >/dev/null || true
		else
			deb-systemd-helper enable \$u >/dev/null || true
		fi
	done
	if [ -d /run/systemd/system ]; then
		systemctl --system daemon-reload >/dev/null || true
		if [ -n "\$2" ]; then
			# A running daemon restarts on the new binary (the
			# client's mappings come back from its state file).
			for u in $unit; do
				deb-systemd-invoke try-restart \$u >/dev/null || true
			done
		fi
	fi
fi
EOF
	cat >"$root/DEBIAN/prerm" <<EOF
#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "\$1" = remove ]; then
	for u in $unit; do
		deb-systemd-invoke stop \$u >/dev/null || true
	done
fi
EOF
	cat >"$root/DEBIAN/postrm" <<EOF
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
	systemctl --system daemon-reload >/dev/null || true
fi
for u in $unit; do
	if [ "\$1" = remove ] && [ -x "/usr/bin/deb-systemd-helper" ]; then
		deb-systemd-helper mask \$u >/dev/null || true
	fi
	if [ "\$1" = purge ] && [ -x "/usr/bin/deb-systemd-helper" ]; then
		deb-systemd-helper purge \$u >/dev/null || true
		deb-systemd-helper unmask \$u >/dev/null || true
	fi
done
if [ "\$1" = purge ]; then
$(data_purge "$name")
fi
EOF
	chmod 0755 "$root/DEBIAN/postinst" "$root/DEBIAN/prerm" "$root/DEBIAN/postrm"
}

pkg rnbd-server "RNBD block device server (userspace, RTRS over RDMA or TCP)" <<'EOF'
 rnbd-server exports files and block devices over RNBD, the Linux kernel's
 RDMA network block device protocol, with its RTRS transport implemented
 in userspace: several paths per session, per-IO multipath, heartbeats
 and reconnects, over RDMA verbs or TCP (optionally TLS 1.3 with client
 certificates). It interoperates with the kernel's rnbd_client.
EOF
pkg rnbd-client "RNBD block device client (userspace, RTRS over RDMA or TCP)" <<'EOF'
 rnbd-client maps devices exported by an RNBD server (rnbd-server or the
 kernel's rnbd_server) as /dev/nbdN, /dev/ublkbN or NBD sockets, with its
 RTRS transport implemented in userspace: several paths per session,
 per-IO multipath with failover, heartbeats and reconnects, over RDMA
 verbs or TCP (optionally TLS 1.3).
EOF
csipkg
