// CreateSnapshot and DeleteSnapshot: a snapshot of a volume on its
// storage node. Snapshot names are a storage node's across its pools,
// and the driver's across the storage nodes (a replicated volume's
// snapshot has one of the name on each member's node:
// mirror_snapshot.go).

package csi

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/rnbd/rnbd/internal/api"
)

func (c *controller) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "no name")
	}
	if req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no source volume id")
	}
	for k := range req.GetParameters() {
		if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
			return nil, status.Errorf(codes.InvalidArgument, "unknown snapshot parameter %q: rnbd-csi takes none", k)
		}
	}
	if vname, ok := parseMirrorID(req.GetSourceVolumeId()); ok {
		return c.createMirrorSnapshot(ctx, req, vname)
	}
	n, v, err := c.volumeOf(ctx, req.GetSourceVolumeId())
	if err != nil {
		return nil, err
	}
	unlock, err := c.locks.lockBySnapshotName(req.GetName())
	if err != nil {
		return nil, err
	}
	defer unlock()
	sname := storageName(req.GetName())
	// The snapshot name taken on another storage node, by a snapshot of
	// another volume: AlreadyExists as the spec asks. An earlier try of
	// this one is on n, so another node that does not answer can hold
	// only another volume's: it is left out, as a list leaves it out,
	// and not a reason to refuse a snapshot of a volume elsewhere.
	var skipped []nodeResult[*api.SnapshotRecord]
	for _, r := range each(ctx, c.nodes, func(ctx context.Context, o *storageNode) (*api.SnapshotRecord, error) {
		if o == n {
			return nil, nil
		}
		return o.snapshot(ctx, sname)
	}) {
		switch {
		case r.n == n || isNotFound(r.err):
		case r.err != nil:
			skipped = append(skipped, r)
		case r.v.Labels[labelMember] != "":
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %s exists, of replicated volume %s", req.GetName(), mirrorID(r.v.Volume))
		default:
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %s exists on %s, of volume %s", req.GetName(), r.n, r.v.Volume)
		}
	}
	leaveOut(ctx, c, "CreateSnapshot", skipped)
	rec, err := n.createSnapshot(ctx, sname, v.Name)
	if err != nil {
		return nil, toStatus(err, fmt.Sprintf("snapshot %s of volume %s", req.GetName(), req.GetSourceVolumeId()))
	}
	return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(n, rec)}, nil
}

func csiSnapshot(n *storageNode, s api.SnapshotRecord) *csi.Snapshot {
	out := &csi.Snapshot{SnapshotId: makeID(n.cfg.Name, s.Name), SourceVolumeId: makeID(n.cfg.Name, s.Volume), SizeBytes: s.Size, ReadyToUse: true}
	if t, err := time.Parse(time.RFC3339Nano, s.Created); err == nil {
		out.CreationTime = timestamppb.New(t)
	}
	return out
}

func (c *controller) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if req.GetSnapshotId() == "" {
		return nil, status.Error(codes.InvalidArgument, "no snapshot id")
	}
	if sname, ok := parseMirrorID(req.GetSnapshotId()); ok {
		unlock, err := c.locks.lockBySnapshotID(req.GetSnapshotId())
		if err != nil {
			return nil, err
		}
		defer unlock()
		if err := c.deleteMirrorSnapshot(ctx, sname); err != nil {
			return nil, err
		}
		return &csi.DeleteSnapshotResponse{}, nil
	}
	nodeName, name, ok := parseID(req.GetSnapshotId())
	n := c.node(nodeName)
	if !ok || n == nil {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	unlock, err := c.locks.lockBySnapshotID(req.GetSnapshotId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := n.deleteSnapshot(ctx, name); err != nil {
		return nil, toStatus(err, "deleting snapshot "+req.GetSnapshotId())
	}
	return &csi.DeleteSnapshotResponse{}, nil
}
