// ControllerPublishVolume and ControllerUnpublishVolume: a volume's
// export granted to a worker's identity, and the grant revoked.

package csi

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/pkg/log"
)

func (c *controller) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "no volume id")
	case req.GetNodeId() == "":
		return nil, status.Error(codes.InvalidArgument, "no node id")
	case req.GetVolumeCapability() == nil:
		return nil, status.Error(codes.InvalidArgument, "no volume capability")
	}
	if err := checkCap(req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	if vname, ok := parseMirrorID(req.GetVolumeId()); ok {
		return c.publishMirror(ctx, req, vname)
	}
	n, v, err := c.volumeOf(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	switch ok, err := c.workers.has(ctx, req.GetNodeId()); {
	case err != nil:
		return nil, status.Errorf(codes.Unavailable, "is node %s a worker: %v", req.GetNodeId(), err)
	case !ok:
		return nil, status.Errorf(codes.NotFound, "no worker node %s: %s", req.GetNodeId(), c.workers)
	}
	if err := c.reachable(ctx, n, req.GetNodeId()); err != nil {
		return nil, err
	}
	unlock, err := c.locks.lockByVolumeID(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	// The grant: what the capability asks (accessFor). The storage node
	// takes two writers of a device at most (RNBD's migration access),
	// so a third multi-node writer is refused here rather than at its
	// OPEN.
	access := accessFor(req.GetVolumeCapability(), req.GetReadonly())
	grants, err := n.grants(ctx, v.Name)
	if err != nil {
		return nil, toStatus(err, "grants of "+req.GetVolumeId())
	}
	have, writers := false, 0
	for _, g := range grants {
		if g.Identity != req.GetNodeId() && g.Access != accessRO {
			writers++
		}
		switch {
		case g.Identity == req.GetNodeId() && g.Access != access:
			return nil, status.Errorf(codes.AlreadyExists, "volume %s is published to node %s %s, asked %s", req.GetVolumeId(), g.Identity, g.Access, access)
		case g.Identity == req.GetNodeId():
			have = true
		case singleNode(req.GetVolumeCapability()):
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is published to node %s: a single-node access mode allows one node", req.GetVolumeId(), g.Identity)
		}
	}
	if !have && access == accessMigration && writers >= 2 {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s has two writers already: a storage node takes two at most (RNBD's migration access)", req.GetVolumeId())
	}
	if !have {
		if err := n.grant(ctx, v.Name, req.GetNodeId(), access); err != nil {
			return nil, toStatus(err, fmt.Sprintf("granting volume %s to node %s", req.GetVolumeId(), req.GetNodeId()))
		}
		c.log.WithFields(log.Fields{"volume": req.GetVolumeId(), "node": req.GetNodeId(), "access": access}).Info("volume published")
	}
	paths := n.cfg.Paths
	if s := req.GetVolumeContext()[PCPaths]; s != "" {
		paths = strings.Split(s, ",")
	}
	pc := map[string]string{PCStorageNode: n.cfg.Name, PCExport: v.Name, PCPaths: strings.Join(paths, ","),
		PCPort: strconv.Itoa(n.cfg.Port), PCAccess: access}
	for _, k := range []string{PCTransport, PCMpathPolicy, PCFrontend} {
		if s := req.GetVolumeContext()[k]; s != "" {
			pc[k] = s
		}
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: pc}, nil
}

// reachable refuses a publish to a worker outside the volume's
// topology: one whose topology (as the workers source knows it) has not
// the storage node's value of each of the node's topology keys. Where
// the source cannot tell (a list of workers), the publish is not held
// to it.
func (c *controller) reachable(ctx context.Context, n *storageNode, nodeID string) error {
	return c.reachableIn(ctx, n.cfg.Labels, "volumes on "+n.String(), nodeID)
}

// reachableIn refuses a publish to a worker whose topology has not
// labels' values (what: whose topology they are).
func (c *controller) reachableIn(ctx context.Context, labels map[string]string, what, nodeID string) error {
	if len(labels) == 0 {
		return nil
	}
	topo, known, err := c.workers.topology(ctx, nodeID)
	switch {
	case err != nil:
		return status.Errorf(codes.Unavailable, "the topology of node %s: %v", nodeID, err)
	case !known:
		return nil
	}
	var keys []string
	for k := range labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if topo[k] != labels[k] {
			return status.Errorf(codes.FailedPrecondition, "node %s is not in the topology of %s: its %s is %q, theirs %q",
				nodeID, what, k, topo[k], labels[k])
		}
	}
	return nil
}

// ControllerUnpublishVolume revokes the node's grant (every node's
// where none is named). A volume that is no more is unpublished from
// every node: success, as the spec asks.
func (c *controller) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if vname, ok := parseMirrorID(req.GetVolumeId()); ok {
		return c.unpublishMirror(ctx, req, vname)
	}
	n, v, err := c.volumeOf(ctx, req.GetVolumeId())
	if status.Code(err) == codes.NotFound {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	unlock, err := c.locks.lockByVolumeID(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	ids := []string{req.GetNodeId()}
	if req.GetNodeId() == "" { // every node
		grants, err := n.grants(ctx, v.Name)
		if err != nil {
			return nil, toStatus(err, "grants of "+req.GetVolumeId())
		}
		ids = ids[:0]
		for _, g := range grants {
			ids = append(ids, g.Identity)
		}
	}
	for _, id := range ids {
		if err := n.revoke(ctx, v.Name, id); err != nil {
			return nil, toStatus(err, fmt.Sprintf("revoking volume %s from node %s", req.GetVolumeId(), id))
		}
		c.log.WithFields(log.Fields{"volume": req.GetVolumeId(), "node": id}).Info("volume unpublished")
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}
