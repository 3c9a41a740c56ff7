// Package csi is rnbd-csi, the Container Storage Interface driver of
// rnbd: its identity, controller and node services over the
// storage nodes' admin API (rnbd-server [admin]) and each worker node's
// rnbd-client daemon. docs/kubernetes.md describes it.
package csi
