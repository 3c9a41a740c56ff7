#!/usr/bin/env bash
# Print the -ldflags that stamp the binaries with their version from git
# (internal/version): the newest tag and the commit's date and hash
# (1.2+git20261127.741447f), or 0.0 without a tag
# (0.0~git20261127.741447f), the commit, and whether the tree has
# changes. scripts/version.sh -v prints the version alone. RNBD_VERSION
# overrides the version (scripts/mkdeb.sh gives the package's).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${RNBD_VERSION:-}" ]; then
	version=$RNBD_VERSION
elif ! git rev-parse HEAD >/dev/null 2>&1; then
	version=devel
elif tag=$(git describe --tags --abbrev=0 2>/dev/null); then
	version="${tag#v}+git$(git log -1 --format=%cd --date=format:%Y%m%d).$(git rev-parse --short HEAD)"
else
	version="0.0~git$(git log -1 --format=%cd --date=format:%Y%m%d).$(git rev-parse --short HEAD)"
fi
if [ "${1:-}" = -v ]; then
	echo "$version"
	exit 0
fi
pkg=github.com/rnbd/rnbd/internal/version
flags="-X $pkg.Version=$version"
if rev=$(git rev-parse HEAD 2>/dev/null); then
	modified=false
	[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || modified=true
	flags+=" -X $pkg.Revision=$rev -X $pkg.Modified=$modified"
fi
echo "$flags"
