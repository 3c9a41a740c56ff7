// Package csi is rnbd-csi, the Container Storage Interface driver of
// rnbd (issue 34): its identity, controller and node services over the
// storage nodes' admin API (rnbd-server [admin]) and each worker node's
// rnbd-client daemon. docs/kubernetes.md describes it.
package csi

import (
	// The CSI spec's Go bindings, gRPC, the conformance suite and the
	// node's mount work: pinned here until the services use them.
	_ "github.com/container-storage-interface/spec/lib/go/csi"
	_ "google.golang.org/grpc"
	_ "k8s.io/mount-utils"
)
