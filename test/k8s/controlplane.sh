#!/usr/bin/env bash
# The Kubernetes tier's control plane, natively on this machine (a qemu
# TCG guest runs Go ~28x slower; docs/testing.md): etcd, kube-apiserver,
# kube-controller-manager and kube-scheduler, inside a network namespace
# the tier made, on that namespace's address, so nothing listens on or
# sends to any address outside it. Its PKI (openssl), the kubeconfigs of
# the admin, the controller manager, the scheduler and the node's
# kubelet, and the logs go to DIR.
#
#   test/k8s/controlplane.sh start K8S_BIN DIR NETNS ADDR NODE
#   test/k8s/controlplane.sh stop DIR
#
# start returns once the API server answers /readyz and the default
# service account exists; the four processes run on, their PIDs in
# DIR/pids. NODE is the kubelet's node name (its certificate's
# system:node:NODE). stop ends those PIDs (and only those) and waits.
set -euo pipefail

say() { printf '== [%(%H:%M:%S)T] control plane: %s\n' -1 "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

# cert DIR NAME CN [O] [SAN]: DIR/NAME.{crt,key} signed by DIR/ca.
cert() {
	local d=$1 name=$2 cn=$3 o=${4:-} san=${5:-}
	local subj="/CN=$cn"
	[ -z "$o" ] || subj="/O=$o$subj"
	openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$d/$name.key" 2>/dev/null
	chmod 600 "$d/$name.key"
	local ext=(-addext "basicConstraints=critical,CA:FALSE" -addext "keyUsage=critical,digitalSignature"
		-addext "extendedKeyUsage=serverAuth,clientAuth")
	[ -z "$san" ] || ext+=(-addext "subjectAltName=$san")
	openssl req -new -key "$d/$name.key" -subj "$subj" "${ext[@]}" -out "$d/$name.csr" 2>/dev/null
	openssl x509 -req -in "$d/$name.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 30 \
		-copy_extensions copy -out "$d/$name.crt" 2>/dev/null
	rm -f "$d/$name.csr"
}

# kubeconfig DIR NAME SERVER: DIR/NAME.kubeconfig with DIR/NAME's certificate.
kubeconfig() {
	local d=$1 name=$2 server=$3
	cat >"$d/$name.kubeconfig" <<-EOF
		apiVersion: v1
		kind: Config
		clusters:
		- name: rnbd-test
		  cluster:
		    server: $server
		    certificate-authority: $d/ca.crt
		users:
		- name: $name
		  user:
		    client-certificate: $d/$name.crt
		    client-key: $d/$name.key
		contexts:
		- name: $name
		  context: {cluster: rnbd-test, user: $name}
		current-context: $name
	EOF
}

# run DIR NAME CMD...: CMD in the background, its output in DIR/NAME.log,
# its PID in DIR/pids.
run() {
	local d=$1 name=$2
	shift 2
	"$@" >"$d/$name.log" 2>&1 &
	echo "$! $name" >>"$d/pids"
}

start() {
	local kbin=$1 d=$2 ns=$3 addr=$4 node=$5
	mkdir -p "$d/pki" "$d/etcd"
	local p=$d/pki
	say "PKI in $p"
	openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$p/ca.key" 2>/dev/null
	openssl req -x509 -new -key "$p/ca.key" -subj "/CN=rnbd test kubernetes CA" -days 30 \
		-addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$p/ca.crt"
	cert "$p" apiserver kube-apiserver "" "IP:$addr,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
	cert "$p" apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
	cert "$p" admin kubernetes-admin system:masters
	cert "$p" controller-manager system:kube-controller-manager
	cert "$p" scheduler system:kube-scheduler
	cert "$p" kubelet "system:node:$node" system:nodes "IP:$(guest_addr "$addr"),DNS:$node"
	openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$p/sa.key" 2>/dev/null
	openssl pkey -in "$p/sa.key" -pubout -out "$p/sa.pub" 2>/dev/null
	# Port 443 on every address of the namespace (it has none outside):
	# its own and the service address 10.96.0.1, where pods find it
	# without a kube-proxy (the node routes 10.96.0.0/16 to here).
	local server=https://$addr:443
	for n in admin controller-manager scheduler kubelet; do kubeconfig "$p" "$n" "$server"; done

	: >"$d/pids"
	local nsx=(ip netns exec "$ns")
	say "etcd"
	run "$d" etcd "${nsx[@]}" "$kbin/etcd" --name rnbd-test --data-dir "$d/etcd" \
		--listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
		--listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
		--initial-cluster rnbd-test=http://127.0.0.1:2380 --unsafe-no-fsync --log-level warn
	say "kube-apiserver on $server"
	run "$d" kube-apiserver "${nsx[@]}" "$kbin/kube-apiserver" \
		--etcd-servers http://127.0.0.1:2379 \
		--bind-address 0.0.0.0 --advertise-address "$addr" --secure-port 443 \
		--tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" \
		--client-ca-file "$p/ca.crt" \
		--kubelet-client-certificate "$p/apiserver-kubelet-client.crt" --kubelet-client-key "$p/apiserver-kubelet-client.key" \
		--kubelet-certificate-authority "$p/ca.crt" --kubelet-preferred-address-types InternalIP \
		--service-account-key-file "$p/sa.pub" --service-account-signing-key-file "$p/sa.key" \
		--service-account-issuer https://kubernetes.default.svc \
		--service-cluster-ip-range 10.96.0.0/16 \
		--authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
		--allow-privileged=true --profiling=false --v=1
	local kc=("$kbin/kubectl" --kubeconfig "$p/admin.kubeconfig")
	local t0=$SECONDS
	until "${nsx[@]}" "${kc[@]}" get --raw /readyz >/dev/null 2>&1; do
		[ $((SECONDS - t0)) -lt 120 ] || { tail -20 "$d/kube-apiserver.log" >&2; die "kube-apiserver not ready in 120 s"; }
		kill -0 "$(awk '$2 == "kube-apiserver" {print $1}' "$d/pids")" 2>/dev/null ||
			{ tail -20 "$d/kube-apiserver.log" >&2; die "kube-apiserver exited"; }
		sleep 1
	done
	say "kube-apiserver ready in $((SECONDS - t0)) s"
	run "$d" kube-controller-manager "${nsx[@]}" "$kbin/kube-controller-manager" \
		--kubeconfig "$p/controller-manager.kubeconfig" \
		--authentication-kubeconfig "$p/controller-manager.kubeconfig" \
		--authorization-kubeconfig "$p/controller-manager.kubeconfig" \
		--bind-address 127.0.0.1 --leader-elect=false --use-service-account-credentials \
		--service-account-private-key-file "$p/sa.key" --root-ca-file "$p/ca.crt" \
		--cluster-signing-cert-file "$p/ca.crt" --cluster-signing-key-file "$p/ca.key" \
		--controllers '*,-bootstrapsigner,-tokencleaner' --profiling=false --v=1
	run "$d" kube-scheduler "${nsx[@]}" "$kbin/kube-scheduler" \
		--kubeconfig "$p/scheduler.kubeconfig" \
		--authentication-kubeconfig "$p/scheduler.kubeconfig" \
		--authorization-kubeconfig "$p/scheduler.kubeconfig" \
		--bind-address 127.0.0.1 --leader-elect=false --profiling=false --v=1
	t0=$SECONDS
	until "${nsx[@]}" "${kc[@]}" -n default get serviceaccount default >/dev/null 2>&1; do
		[ $((SECONDS - t0)) -lt 120 ] || { tail -20 "$d/kube-controller-manager.log" >&2; die "no default service account in 120 s"; }
		sleep 1
	done
	say "ready: kubectl --kubeconfig $p/admin.kubeconfig (in netns $ns)"
}

# guest_addr ADDR: the guest's address beside the control plane's (.1 → .2).
guest_addr() { echo "${1%.*}.$((${1##*.} + 1))"; }

stop() {
	local d=$1 pid name
	[ -f "$d/pids" ] || return 0
	# The reverse order: the scheduler and controller manager, the API
	# server, etcd last.
	tac "$d/pids" | while read -r pid name; do
		kill "$pid" 2>/dev/null || continue
		for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
		kill -9 "$pid" 2>/dev/null && say "$name did not stop in 10 s: killed" || true
	done
	rm -f "$d/pids"
}

usage() { die "usage: $0 start K8S_BIN DIR NETNS ADDR NODE | stop DIR"; }
case ${1:-} in
start)
	[ $# -eq 6 ] || usage
	shift
	start "$@"
	;;
stop)
	[ $# -eq 2 ] || usage
	stop "$2"
	;;
*) usage ;;
esac
