#!/usr/bin/env bash
# kmods.sh KVER OUTDIR: builds the kernel's own RTRS and RNBD modules
# (rtrs-core, rtrs-server, rtrs-client, rnbd-server, rnbd-client) for the
# VM tier's kernel KVER into OUTDIR. Debian configures its kernels without
# them (CONFIG_INFINIBAND_RTRS_*, CONFIG_BLK_DEV_RNBD_* not set), but ships
# the same version's source (linux-source-X.Y) and headers: the modules are
# built out of tree from those, with the packages unpacked in a private
# directory (the host's installed packages are not touched). The apt state
# is run.sh's (APT_OPTS). Called by run.sh; prints the reason and exits
# non-zero if it cannot.
set -euo pipefail
kv=$1 out=$2
cache=${VM_CACHE:-/var/cache/rnbd-vm}
read -r -a apt <<<"${APT_OPTS:?run.sh sets APT_OPTS}"
log() { printf '== [%(%T)T] kmods: %s\n' -1 "$*" >&2; }
mods=(rtrs-core rtrs-server rtrs-client rnbd-server rnbd-client)
have() { for m in "${mods[@]}"; do [ -f "$out/$m.ko" ] || return 1; done; }
if have; then
	log "cached in $out"
	exit 0
fi
flavour=${kv##*-} # amd64
series=$(echo "$kv" | cut -d. -f1,2)
abi=${kv%-"$flavour"}
pkgs=(linux-source-"$series" linux-headers-"$kv" linux-headers-"$abi"-common linux-kbuild-"$abi")
command -v pahole >/dev/null || {
	log "apt-get install pahole (BTF of the modules)"
	DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq pahole >/dev/null
}
w=$cache/kmods-$kv
mkdir -p "$w/debs" "$w/root"
(cd "$w/debs" && for p in "${pkgs[@]}"; do
	ls "${p}"_*.deb >/dev/null 2>&1 || timeout 600 apt-get "${apt[@]}" download "$p" >/dev/null 2>&1 ||
		{ log "apt-get download $p failed"; exit 1; }
done)
for d in "$w"/debs/*.deb; do dpkg-deb -x "$d" "$w/root"; done
src=$w/src
rm -rf "$src"
mkdir -p "$src"
tar -xJf "$w/root/usr/src/linux-source-$series.tar.xz" -C "$src" --strip-components=1 \
	"linux-source-$series/drivers/infiniband/ulp/rtrs" "linux-source-$series/drivers/block/rnbd"
# The headers' Makefile includes the common part by its installed path.
kdir=$w/root/usr/src/linux-headers-$kv
sed -i "s|^include /usr/src/|include $w/root/usr/src/|" "$kdir/Makefile"
rtrs=$src/drivers/infiniband/ulp/rtrs
make -s -C "$kdir" M="$rtrs" CONFIG_INFINIBAND_RTRS=m CONFIG_INFINIBAND_RTRS_CLIENT=m \
	CONFIG_INFINIBAND_RTRS_SERVER=m modules -j"$(nproc)" >"$w/build.log" 2>&1 ||
	{ tail -20 "$w/build.log" >&2; log "building rtrs failed"; exit 1; }
make -s -C "$kdir" M="$src/drivers/block/rnbd" CONFIG_BLK_DEV_RNBD_CLIENT=m CONFIG_BLK_DEV_RNBD_SERVER=m \
	"ccflags-y=-I$rtrs" KBUILD_EXTRA_SYMBOLS="$rtrs/Module.symvers" modules -j"$(nproc)" >>"$w/build.log" 2>&1 ||
	{ tail -20 "$w/build.log" >&2; log "building rnbd failed"; exit 1; }
mkdir -p "$out"
cp "$rtrs"/*.ko "$src"/drivers/block/rnbd/*.ko "$out/"
have || { log "modules missing after the build"; exit 1; }
log "built ${mods[*]} for $kv from linux-source-$series"
