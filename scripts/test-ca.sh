#!/bin/bash
# test-ca.sh — a small certificate authority for trying rnbd with TLS, and
# for the tests. Not for production: use your organisation's CA there.
#
#   scripts/test-ca.sh DIR ca                     DIR/ca.crt, DIR/ca.key
#   scripts/test-ca.sh DIR server NAME ADDR...    DIR/NAME.crt, DIR/NAME.key
#   scripts/test-ca.sh DIR client NAME [DNS...]   DIR/NAME.crt, DIR/NAME.key
#   scripts/test-ca.sh DIR nameless NAME          DIR/NAME.crt, DIR/NAME.key
#   scripts/test-ca.sh DIR admin NAME [DNS...]    DIR/NAME.crt, DIR/NAME.key
#
# A server's certificate names the addresses clients dial (IP subject
# alternative names; host names as DNS ones), since rnbd-client checks it
# against the address unless tls.server_name is set. A client's common
# name (and DNS names) are its identity: what an export's
# allow_identities names. A nameless certificate is a client's that names
# no identity (a subject of O=rnbd test only, no alternative names): a
# server refuses it unless tls.allow_anonymous_clients. An admin
# certificate is a client's too, for an operator or an orchestrator on
# the server's admin listener (rnbd-server --server https://HOST:1235
# --cert NAME.crt ...): its names are what [admin]'s role lists name.
# Keys are ECDSA P-256, certificates valid for DAYS (default 365) days.
set -euo pipefail

usage() { sed -n '2,21p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
dir=$1 kind=$2
shift 2
days=${DAYS:-365}
mkdir -p "$dir"

newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; chmod 600 "$1"; }

case $kind in
ca)
	newkey "$dir/ca.key"
	openssl req -x509 -new -key "$dir/ca.key" -subj "/CN=rnbd test CA" -days "$days" \
		-addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
		-out "$dir/ca.crt"
	;;
server | client | admin | nameless)
	[ $# -ge 1 ] || usage
	name=$1
	shift
	[ -f "$dir/ca.key" ] || { echo "test-ca.sh: no $dir/ca.key: run '$0 $dir ca' first" >&2; exit 1; }
	[ "$kind" != server ] || [ $# -ge 1 ] || { echo "test-ca.sh: a server certificate needs the addresses clients dial" >&2; exit 2; }
	[ "$kind" != nameless ] || [ $# -eq 0 ] || { echo "test-ca.sh: a nameless certificate has no alternative names" >&2; exit 2; }
	subj="/CN=$name"
	[ "$kind" = nameless ] && subj="/O=rnbd test"
	san=()
	for a in "$@"; do
		if [[ $a =~ ^[0-9.]+$ || $a == *:* ]]; then san+=("IP:$a"); else san+=("DNS:$a"); fi
	done
	usage=serverAuth
	[ "$kind" != server ] && usage=clientAuth
	ext=$(mktemp)
	trap 'rm -f "$ext" "$dir/$name.csr"' EXIT
	{
		echo "basicConstraints=critical,CA:FALSE"
		echo "keyUsage=critical,digitalSignature"
		echo "extendedKeyUsage=$usage"
		if [ ${#san[@]} -gt 0 ]; then (IFS=,; echo "subjectAltName=${san[*]}"); fi
	} >"$ext"
	newkey "$dir/$name.key"
	openssl req -new -key "$dir/$name.key" -subj "$subj" -out "$dir/$name.csr"
	openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
		-days "$days" -extfile "$ext" -out "$dir/$name.crt" 2>/dev/null
	;;
*)
	usage
	;;
esac
