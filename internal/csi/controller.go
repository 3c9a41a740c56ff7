// The controller service: volumes and snapshots on the storage nodes,
// through their admin API with the provisioner's certificate. This file
// has the service and what its calls share; create.go, publish.go,
// list.go, snapshot.go and reclaim.go the calls; mirror.go and
// mirror_publish.go those of replicated volumes.

package csi

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/log"
)

// Labels the controller keeps with each volume it makes: the CSI name
// (a retry finds the volume by it; another name mapped to the same
// volume name is told apart), the parameters it was made with (a name
// reused with others is AlreadyExists), when the controller asked for
// it, and the storage nodes that did not answer when it looked for the
// name before making it (reclaim.go).
const (
	labelName      = "csi.name"
	labelParams    = "csi.params"
	labelMade      = "csi.made"
	labelUnchecked = "csi.unchecked"
)

// controller is the controller service. It is safe for concurrent use:
// calls of one volume or snapshot are serialized by locks (one at a
// time, another Aborted), the storage nodes are each safe for
// concurrent use, and the reconciler runs in a goroutine of its own
// until close.
type controller struct {
	csi.UnimplementedControllerServer
	cfg   Config
	log   *log.Entry
	m     *rpcMetrics
	nodes []*storageNode
	// workers are the worker nodes a volume may be published to.
	workers workers

	// locks are the volumes (CSI names, volume and snapshot ids) with
	// an operation under way: another on the same is Aborted.
	locks opLocks

	// wake asks the reconciler for a round now (a node answers again);
	// stop ends it, done is closed when it has.
	wake chan struct{}
	stop context.CancelFunc
	done chan struct{}
	once sync.Once
}

func newController(cfg Config, l *log.Entry, m *rpcMetrics) (*controller, error) {
	tc, err := cfg.TLS.Config()
	if err != nil {
		return nil, err
	}
	w, err := newWorkers(cfg.Workers, cfg.Kubernetes, cfg.DriverName)
	if err != nil {
		return nil, err
	}
	c := &controller{cfg: cfg, log: l, m: m, workers: w, wake: make(chan struct{}, 1), done: make(chan struct{})}
	for i := range cfg.StorageNodes {
		n := &cfg.StorageNodes[i]
		cl, err := ctl.DialTLS(n.Admin, tc)
		if err != nil {
			return nil, fmt.Errorf("storage_node %s: %w", n.Name, err)
		}
		c.nodes = append(c.nodes, newStorageNode(n, cl, cfg.Controller, m, c.nodeChanged))
	}
	ctx, cancel := context.WithCancel(context.Background())
	c.stop = cancel
	go c.reconciler(ctx)
	return c, nil
}

// close stops the reconciler and closes the idle connections.
func (c *controller) close() {
	c.once.Do(func() {
		c.stop()
		<-c.done
		for _, n := range c.nodes {
			n.c.Close()
		}
	})
}

// nodeChanged logs a storage node that stops or starts answering, and
// has the reconciler look at one that answers again.
func (c *controller) nodeChanged(n *storageNode, up bool) {
	if !up {
		c.log.WithField("storage_node", n.cfg.Name).Warn("storage node does not answer: left out of placement, listing and capacity until it does")
		return
	}
	c.log.WithField("storage_node", n.cfg.Name).Info("storage node answers again")
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

func (c *controller) node(name string) *storageNode {
	for _, n := range c.nodes {
		if n.cfg.Name == name {
			return n
		}
	}
	return nil
}

// nodeResult is what one storage node answered a call asked of every
// node (each).
type nodeResult[T any] struct {
	n   *storageNode
	v   T
	err error
}

// each asks f of every storage node at once, and answers in the nodes'
// order. A node that does not answer costs its call's deadline, not the
// others'.
func each[T any](ctx context.Context, nodes []*storageNode, f func(context.Context, *storageNode) (T, error)) []nodeResult[T] {
	out := make([]nodeResult[T], len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			v, err := f(ctx, n)
			out[i] = nodeResult[T]{n: n, v: v, err: err}
		}()
	}
	wg.Wait()
	return out
}

func (c *controller) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_READONLY,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// volumeOf finds the storage node and the record of a volume id:
// InvalidArgument without one, NotFound where there is no such volume
// (an id not of this driver's form, a storage node not configured).
func (c *controller) volumeOf(ctx context.Context, id string) (*storageNode, *api.VolumeRecord, error) {
	if id == "" {
		return nil, nil, status.Error(codes.InvalidArgument, "no volume id")
	}
	nodeName, name, ok := parseID(id)
	n := c.node(nodeName)
	if !ok || n == nil {
		return nil, nil, status.Errorf(codes.NotFound, "no volume %s", id)
	}
	v, err := n.volume(ctx, name)
	if err != nil {
		return nil, nil, toStatus(err, "volume "+id)
	}
	return n, v, nil
}

// DeleteVolume deletes a volume the driver made; one that is gone, or
// whose id is none of this driver's, is success. One the driver did not
// make (no csi.name label) is not deleted: FailedPrecondition. One made
// while a storage node did not answer is deleted once that node answers
// and has no copy of its name left (reclaim.go).
func (c *controller) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume id")
	}
	if vname, ok := parseMirrorID(req.GetVolumeId()); ok {
		return c.deleteMirror(ctx, req.GetVolumeId(), vname)
	}
	nodeName, name, ok := parseID(req.GetVolumeId())
	n := c.node(nodeName)
	if !ok || n == nil {
		return &csi.DeleteVolumeResponse{}, nil // never one of ours: gone
	}
	unlock, err := c.locks.lockByVolumeID(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := n.volume(ctx, name)
	if isNotFound(err) {
		return &csi.DeleteVolumeResponse{}, nil
	}
	if err != nil {
		return nil, toStatus(err, "volume "+req.GetVolumeId())
	}
	if v.State == api.VolumeCreating {
		return nil, status.Errorf(codes.Unavailable, "volume %s is being made on its storage node: a change of it is under way; try again", req.GetVolumeId())
	}
	if v.Labels[labelName] == "" {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s was not made by rnbd-csi (it has no %s label): not deleted; "+
			"delete it on the storage node (rnbd-server volume delete) if it is to go", req.GetVolumeId(), labelName)
	}
	if err := c.reclaimUnchecked(ctx, n, v); err != nil {
		return nil, err
	}
	if err := n.deleteVolume(ctx, name); err != nil {
		return nil, toStatus(err, "deleting volume "+req.GetVolumeId())
	}
	c.log.WithField("volume", req.GetVolumeId()).Info("volume deleted")
	return &csi.DeleteVolumeResponse{}, nil
}

func (c *controller) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume id")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "no volume capabilities")
	}
	if vname, ok := parseMirrorID(req.GetVolumeId()); ok {
		if _, err := c.findMirror(ctx, vname); err != nil {
			return nil, err
		}
		for _, vc := range req.GetVolumeCapabilities() {
			if !singleNode(vc) {
				return &csi.ValidateVolumeCapabilitiesResponse{Message: fmt.Sprintf("access mode %s: a replicated volume has one writer, on one node at a time",
					vc.GetAccessMode().GetMode())}, nil
			}
		}
	} else if _, _, err := c.volumeOf(ctx, req.GetVolumeId()); err != nil {
		return nil, err
	}
	if _, err := parseParams(req.GetParameters()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	if err := checkCaps(req.GetVolumeCapabilities()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext: req.GetVolumeContext(), VolumeCapabilities: req.GetVolumeCapabilities(), Parameters: req.GetParameters()}}, nil
}

// ControllerExpandVolume grows a volume; the size it has already is
// success (a retry), a smaller one OutOfRange: a volume does not shrink.
func (c *controller) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	if req.GetCapacityRange() == nil {
		return nil, status.Error(codes.InvalidArgument, "no capacity range")
	}
	if req.GetVolumeCapability() != nil {
		if err := checkCap(req.GetVolumeCapability()); err != nil {
			return nil, err
		}
	}
	if vname, ok := parseMirrorID(req.GetVolumeId()); ok {
		return c.expandMirror(ctx, req, vname)
	}
	n, v, err := c.volumeOf(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	size, err := sizeOf(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	unlock, err := c.locks.lockByVolumeID(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	nodeExpansion := req.GetVolumeCapability().GetBlock() == nil
	if v.Size != nil {
		switch {
		case *v.Size == size:
			return &csi.ControllerExpandVolumeResponse{CapacityBytes: *v.Size, NodeExpansionRequired: nodeExpansion}, nil
		case *v.Size > size:
			return nil, status.Errorf(codes.OutOfRange, "volume %s has %d bytes, asked %d: a volume grows only", req.GetVolumeId(), *v.Size, size)
		}
	}
	if err := n.resizeVolume(ctx, v.Name, size); err != nil {
		return nil, toStatus(err, fmt.Sprintf("growing volume %s to %d bytes", req.GetVolumeId(), size))
	}
	c.log.WithFields(log.Fields{"volume": req.GetVolumeId(), "size": size}).Info("volume expanded")
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: size, NodeExpansionRequired: nodeExpansion}, nil
}

// madeAt is when the controller asked for a volume (its csi.made
// label), else when its pool made it; zero if neither is known.
func madeAt(v api.VolumeRecord) time.Time {
	if t, err := time.Parse(time.RFC3339Nano, v.Labels[labelMade]); err == nil {
		return t
	}
	t, _ := time.Parse(time.RFC3339, v.Created)
	return t
}
