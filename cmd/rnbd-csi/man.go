package main

import (
	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/csi"
)

// man is what rnbd-csi's man pages say beyond the command's help.
var man = cli.Man{
	RootIsDaemon: true,
	Files: `*/etc/rnbd/csi.toml*
: the configuration (**rnbd-csi.toml**(5)); in Kubernetes the ConfigMap rnbd-csi-config mounted there

*/csi/csi.sock*
: the CSI socket (**--endpoint**) the sidecars and the kubelet call

*` + csi.DefaultClientSocket + `*
: the control socket of the worker's rnbd-client daemon (` + "`[node] client_socket`" + `), through which the node plugin maps volumes

*/etc/rnbd/tls/*
: the controller's certificate, key and authority, as the example configuration names them (in Kubernetes the Secret rnbd-csi-provisioner)

*/usr/share/doc/rnbd-csi/examples/csi.toml*
: the example configuration (deploy/kubernetes/config.yaml's)`,
	Signals: `**SIGTERM**, **SIGINT**
: stop taking calls, let those under way end, remove the socket and exit 0. Nothing is unmapped or unmounted: the mappings are the rnbd-client daemon's, the mounts the kernel's`,
	DaemonExit: `**0**
: stopped by SIGTERM or SIGINT

**1**
: it could not serve (its endpoint) or failed while serving; the last line on standard error says why

**2**
: the configuration is wrong: an unknown key or table (named with its line), a bad value, what **--mode** needs missing (storage nodes and ` + "`[tls]`" + ` for the controller, a node id for the node plugin), a TLS file that does not load; or a bad flag

**3**
: the configuration file named by **--config** does not exist

**7**
: it cannot be read`,
	Config: cli.ConfigPage{
		Name:  "rnbd-csi.toml",
		Short: "the configuration of rnbd-csi",
		Path:  defaultConfig,
		Description: `**rnbd-csi** reads its configuration from ` + defaultConfig + ` (or **--config FILE**), a TOML file. The controller (**--mode controller**) reads the storage nodes it places volumes on and its certificate; the node plugin (**--mode node**) reads ` + "`[node]`" + `; one file serves both, and every worker: **--node-id** gives each its identity. In Kubernetes the file is the ConfigMap rnbd-csi-config (deploy/kubernetes/config.yaml; docs/kubernetes.md).

A key or table the driver does not know is an error naming its line, and the driver does not start. A file of a newer ` + "`version`" + ` than the driver understands is refused.`,
		Keys: csi.ConfigKeys,
		Example: `version = 1

[tls]
cert = "/etc/rnbd/tls/tls.crt"
key = "/etc/rnbd/tls/tls.key"
ca = "/etc/rnbd/tls/ca.crt"

[[storage_node]]
name = "storage-a"
admin = "https://10.0.9.5:1235"
paths = ["ip:10.0.9.5", "ip:10.0.10.5"]
pool = "fast"
labels = { "topology.kubernetes.io/zone" = "zone-a" }

[node]
client_socket = "/run/rnbd/client.sock"`,
		SeeAlso: []string{"rnbd-csi(8)", "rnbd-server.toml(5)", "rnbd-client(8)"},
	},
}
