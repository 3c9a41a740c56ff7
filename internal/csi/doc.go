// Package csi is rnbd-csi, the Container Storage Interface driver of
// rnbd: its identity, controller and node services over the storage
// nodes' admin API (rnbd-server [admin], through package api's typed
// client) and each worker node's rnbd-client daemon (its control
// socket). docs/kubernetes.md describes it.
//
// Files, by service:
//
//	driver.go     Driver: the services on a unix socket, the metrics endpoint
//	identity.go   the identity service: name, capabilities, Probe
//	config.go     csi.toml: storage nodes, [controller], [node], [workers]; keys.go its reference
//	params.go     what a request asks, checked: parameters, capabilities, the access
//	              policy (accessFor), capacity ranges, storage names and ids
//	locks.go      one operation per volume or snapshot at a time (Aborted beside it)
//	errors.go     the control API's error classes as gRPC codes
//	metrics.go    the driver's metrics: calls, storage nodes' calls, queues, duplicates
//
//	controller.go the controller service and what its calls share
//	storage.go    a storage node as the controller calls it: a deadline and a turn per call
//	create.go     CreateVolume: a retry found, or a volume placed and made
//	placement.go  which storage node a new volume goes to
//	publish.go    ControllerPublishVolume and Unpublish: grants, topology
//	list.go       ListVolumes, GetCapacity, ListSnapshots over the nodes that answer
//	snapshot.go   CreateSnapshot and DeleteSnapshot
//	reclaim.go    a name's copies made while a node did not answer, found and reclaimed
//	workers.go    which worker nodes exist, and their topology; kube.go the API client
//
//	node.go       the node service: stage (map, format, mount) and unstage
//	node_publish.go  publish and unpublish, expansion, stats and health
//
// Concurrency: a Driver serves calls concurrently (gRPC); its services
// are safe for concurrent use. The controller serializes the calls of
// one volume or snapshot with opLocks (a second is Aborted, as the spec
// asks), each storage node bounds its own calls (callQueue), and the
// reconciler runs in a goroutine of its own from newController to
// close. Locks, in the order they may be taken: a CSI name's (opLocks,
// CreateVolume and the reconciler), then a volume id's (opLocks:
// DeleteVolume and the reclaim of an older copy); opLocks.mu and
// Driver.mu are held over no call.
package csi
