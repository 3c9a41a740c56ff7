#!/usr/bin/env bash
# CI's packaging check, as root on Debian: build the packages (the two
# daemons' and rnbd-csi's), lintian (no errors), install them,
# systemd-analyze verify the installed units, render every man page,
# upgrade to a newer build (a changed conffile is kept), remove (the
# daemons' state kept) and purge (nothing left behind: the state files
# the daemons would have written go too). The server's
# package makes /srv/rnbd (0700) and its purge removes it while empty.
# Installs lintian and
# man-db from apt if missing. Starts no daemon on this machine (its init
# is not systemd: the maintainer scripts find none); then
# scripts/test-deb-systemd.sh runs the packages' whole life under systemd
# in a container.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '== [%(%T)T] %s\n' -1 "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (dpkg -i)"
need=()
for c in lintian:lintian man:man-db dpkg-shlibdeps:dpkg-dev systemd-analyze:systemd; do
	command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
done
if [ ${#need[@]} -gt 0 ] || ! dpkg -s kmod >/dev/null 2>&1; then
	log "apt-get update"
	DEBIAN_FRONTEND=noninteractive timeout 600 apt-get update -qq >/dev/null || die "apt-get update"
fi
if [ ${#need[@]} -gt 0 ]; then
	log "apt-get install ${need[*]}"
	DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
		die "apt-get install ${need[*]}"
fi
for p in rnbd-server rnbd-client rnbd-csi; do
	! dpkg -s "$p" >/dev/null 2>&1 || die "$p is installed already: this check installs and purges it"
done
# The purge takes the daemons' state files, a daemon's from the tree too
# (rnbd-server daemon --config /dev/null keeps its exports there).
[ ! -e /var/lib/rnbd ] || die "/var/lib/rnbd exists: the purge this check makes would remove its state files; move it away first"
# /srv/rnbd is made by the install and removed by the purge if empty; one
# that is there already (the README's example makes it) is not checked.
srv=; [ -e /srv/rnbd ] || srv=1
out=$(mktemp -d /tmp/rnbd-deb.XXXXXX)
# Whatever happens, the machine is left without the packages.
trap 'dpkg -P rnbd-server rnbd-client rnbd-csi >/dev/null 2>&1 || true; rm -rf "$out"' EXIT
RNBD_DEB_VERSION=0.0~test1-1 scripts/mkdeb.sh "$out/1" >/dev/null
RNBD_DEB_VERSION=0.0~test2-1 scripts/mkdeb.sh "$out/2" >/dev/null
log "lintian"
lintian --fail-on error --suppress-tags initial-upload-closes-no-bugs "$out"/1/*.deb || die "lintian"

# apt resolves the packages' dependencies (kmod; e2fsprogs and mount for
# rnbd-csi), which a fresh machine may lack.
log "install"
DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends "$out"/1/*.deb >/dev/null ||
	die "apt-get install of the packages"
for p in rnbd-server rnbd-client; do
	[ -x /usr/sbin/$p ] || die "/usr/sbin/$p"
	/usr/sbin/$p --help >/dev/null || die "$p --help"
	v=$(/usr/sbin/$p --version | head -1)
	[ "$v" = "$p 0.0~test1-1" ] || die "$p --version says \"$v\", not the package's version 0.0~test1-1"
	[ -f /lib/systemd/system/$p.service ] || die "no unit $p.service"
	[ -f /usr/share/bash-completion/completions/$p ] || die "no completion for $p"
	man -l /usr/share/man/man8/$p.8.gz 2>/dev/null | grep -q "^NAME" || die "man -l $p.8"
	man -l /usr/share/man/man8/$p.8.gz 2>/dev/null | tail -1 | grep -q "^rnbd 0.0~test1-1 " || die "$p.8 does not carry the package's version"
	man -l /usr/share/man/man5/$p.toml.5.gz 2>/dev/null | grep -q "^KEYS" || die "man -l $p.toml.5"
	for m in /usr/share/man/man8/$p-*.8.gz; do
		man -l "$m" >/dev/null 2>&1 || die "man -l $m"
	done
done
[ -f /etc/rnbd/server.toml ] && [ -f /etc/rnbd/client.toml ] || die "no configuration in /etc/rnbd"
# rnbd-csi: the binary where the image has it, its two man pages found by
# man, the example configuration; no unit, no conffile (Kubernetes gives
# the configuration, a ConfigMap).
[ -x /usr/bin/rnbd-csi ] || die "/usr/bin/rnbd-csi"
v=$(/usr/bin/rnbd-csi --version | head -1)
[ "$v" = "rnbd-csi 0.0~test1-1" ] || die "rnbd-csi --version says \"$v\", not the package's version 0.0~test1-1"
[ "$(man -w rnbd-csi 2>&1)" = /usr/share/man/man8/rnbd-csi.8.gz ] || die "man -w rnbd-csi: $(man -w rnbd-csi 2>&1)"
[ "$(man -w 5 rnbd-csi.toml 2>&1)" = /usr/share/man/man5/rnbd-csi.toml.5.gz ] || die "man -w 5 rnbd-csi.toml: $(man -w 5 rnbd-csi.toml 2>&1)"
man -l /usr/share/man/man8/rnbd-csi.8.gz 2>/dev/null | grep -q "^EXIT STATUS" || die "man -l rnbd-csi.8"
man -l /usr/share/man/man8/rnbd-csi.8.gz 2>/dev/null | tail -1 | grep -q "^rnbd 0.0~test1-1 " || die "rnbd-csi.8 does not carry the package's version"
man -l /usr/share/man/man5/rnbd-csi.toml.5.gz 2>/dev/null | grep -q "^KEYS" || die "man -l rnbd-csi.toml.5"
grep -qxF '[[storage_node]]' /usr/share/doc/rnbd-csi/examples/csi.toml || die "no example configuration of rnbd-csi"
[ ! -e /etc/rnbd/csi.toml ] && [ -z "$(ls /lib/systemd/system/rnbd-csi* 2>/dev/null)" ] || die "rnbd-csi installed a configuration or a unit"
[ -f /lib/udev/rules.d/60-rnbd.rules ] || die "no udev rule"
[ -z "$srv" ] || [ "$(stat -c %a:%U /srv/rnbd 2>&1)" = 700:root ] || die "/srv/rnbd after install: $(stat -c %a:%U /srv/rnbd 2>&1)"
log "systemd-analyze verify"
systemd-analyze verify /lib/systemd/system/rnbd-server.service /lib/systemd/system/rnbd-client.service \
	/lib/systemd/system/rnbd-client-wait.service || die "systemd-analyze verify"
# In every boot (multi-user.target wants it), and it pulls in the passive
# remote-fs-pre.target it is ordered before.
[ -L /etc/systemd/system/multi-user.target.wants/rnbd-client-wait.service ] || die "rnbd-client-wait.service not enabled"
[ -L /etc/systemd/system/multi-user.target.wants/rnbd-client.service ] || die "rnbd-client.service not enabled"

log "upgrade"
echo "# changed by the operator" >>/etc/rnbd/client.toml
dpkg -i --force-confold "$out"/2/*.deb >/dev/null || die "dpkg -i (upgrade)"
[ "$(dpkg-query -W -f '${Version}' rnbd-client)" = 0.0~test2-1 ] || die "not upgraded"
[ "$(/usr/sbin/rnbd-client version -f json | sed -n 's/^  "version": "\(.*\)",$/\1/p')" = 0.0~test2-1 ] || die "the upgraded binary does not say 0.0~test2-1"
[ "$(/usr/bin/rnbd-csi --version | head -1)" = "rnbd-csi 0.0~test2-1" ] || die "rnbd-csi was not upgraded to 0.0~test2-1"
grep -q "changed by the operator" /etc/rnbd/client.toml || die "the changed conffile was replaced"

log "remove and purge"
# What the daemons leave in their state directory (no daemon runs here:
# test-deb-systemd.sh has them write it): the state files, and the
# temporary file of a save a crash interrupted.
install -d -m 0700 /var/lib/rnbd
echo '{"version": 1}' >/var/lib/rnbd/server.json
echo '{"version": 1}' >/var/lib/rnbd/client.json
: >/var/lib/rnbd/.state-123
dpkg -r rnbd-server rnbd-client rnbd-csi >/dev/null || die "dpkg -r"
[ ! -e /usr/sbin/rnbd-server ] && [ ! -e /usr/sbin/rnbd-client ] && [ ! -e /usr/bin/rnbd-csi ] || die "binaries left after remove"
[ -f /etc/rnbd/client.toml ] || die "remove took the conffile (only purge may)"
[ -f /var/lib/rnbd/server.json ] && [ -f /var/lib/rnbd/client.json ] || die "remove took the state (only purge may)"
# rnbd-csi has no conffile and makes nothing: removed, it is gone whole.
[ -z "$(dpkg-query -W -f '${db:Status-Status}' rnbd-csi 2>/dev/null | grep -v '^not-installed$')" ] ||
	die "rnbd-csi after remove: $(dpkg-query -W -f '${db:Status-Status}' rnbd-csi)"
dpkg -P rnbd-server rnbd-client >/dev/null || die "dpkg -P"
left=$(ls -d /etc/rnbd /usr/share/doc/rnbd-server /usr/share/doc/rnbd-client /usr/share/doc/rnbd-csi /usr/share/man/*/rnbd-csi* \
	/lib/systemd/system/rnbd-*.service \
	/etc/systemd/system/*.wants/rnbd-* /var/lib/rnbd ${srv:+/srv/rnbd} 2>/dev/null || true)
[ -z "$left" ] || die "left after purge: $left"
log "packages: lintian clean, installed, verified, upgraded, removed (state kept) and purged (state gone)"

# The daemons' packages under systemd, in a container that boots it.
scripts/test-deb-systemd.sh "$out/1" "$out/2"
