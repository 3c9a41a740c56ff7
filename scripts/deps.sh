#!/usr/bin/env bash
# Install what rnbd's build and tests need: Go modules always; Debian
# packages when running as root on Debian. Elsewhere, say what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need_go="1.26"
if ! command -v go >/dev/null 2>&1; then
	echo "deps: Go $need_go or newer is needed and 'go' is not on PATH (https://go.dev/dl/)" >&2
	exit 1
fi
have_go=$(go env GOVERSION | sed 's/^go//')
if [ "$(printf '%s\n%s\n' "$need_go" "$have_go" | sort -V | head -1)" != "$need_go" ]; then
	echo "deps: Go $need_go or newer is needed, found $have_go" >&2
	exit 1
fi

# command -> Debian package
declare -A pkgs=(
	[ip]=iproute2
	[qemu-io]=qemu-utils
	[nbdinfo]=libnbd-bin
	[fio]=fio
	[nbdkit]=nbdkit
	[jq]=jq
	[openssl]=openssl
	[curl]=curl
	[systemd-analyze]=systemd
	[gcc]=gcc
	[mkfs.xfs]=xfsprogs
)
missing=()
for cmd in "${!pkgs[@]}"; do
	command -v "$cmd" >/dev/null 2>&1 || missing+=("${pkgs[$cmd]}")
done
# pkg/ibverbs is cgo against rdma-core: its headers to build (a machine
# without them can still build with CGO_ENABLED=0, without RDMA).
[ -e /usr/include/infiniband/verbs.h ] || missing+=(libibverbs-dev)
[ -e /usr/include/rdma/rdma_cma.h ] || missing+=(librdmacm-dev)
if [ ${#missing[@]} -gt 0 ]; then
	if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
		echo "deps: installing ${missing[*]}"
		export DEBIAN_FRONTEND=noninteractive
		apt-get update -qq >/dev/null || true
		apt-get install -y -qq "${missing[@]}" >/dev/null
	else
		echo "deps: missing (install them to run every test): ${missing[*]}" >&2
	fi
fi

# promtool, to check the daemons' /metrics as Prometheus would: taken
# out of Debian's prometheus package into .tools/, not installed (the
# package would start a Prometheus server on this machine).
if [ ! -x .tools/promtool ] && ! command -v promtool >/dev/null 2>&1; then
	if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
		tmp=$(mktemp -d)
		if (cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 ||
			{ apt-get update -qq >/dev/null && apt-get download prometheus >/dev/null 2>&1; }; } &&
			dpkg-deb -x prometheus_*.deb x && [ -x x/usr/bin/promtool ]); then
			mkdir -p .tools
			cp "$tmp/x/usr/bin/promtool" .tools/promtool
			echo "deps: promtool from Debian's prometheus package in .tools/"
		else
			echo "deps: could not get promtool (Debian's prometheus package); the metrics tests use promlint alone" >&2
		fi
		rm -rf "$tmp"
	else
		echo "deps: missing promtool (Debian's prometheus package); the metrics tests use promlint alone" >&2
	fi
fi

go mod download
