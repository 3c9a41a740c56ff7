// ListVolumes, GetCapacity and ListSnapshots: what the storage nodes
// that answer have, each asked at once. A node that does not answer is
// left out, never silently: a warning, rnbd_csi_storage_node_left_out_total,
// and the gRPC header rnbd-left-out naming it.

package csi

import (
	"context"
	"slices"
	"sort"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/pkg/log"
)

// LeftOutHeader is the gRPC header of a list or capacity answered
// without storage nodes that did not answer: their names, comma-joined.
const LeftOutHeader = "rnbd-left-out"

// leftOut notes the storage nodes a call of method was answered
// without, and says which in the call's header; none answering is
// Unavailable (what there is cannot be told).
func leftOut[T any](ctx context.Context, c *controller, method string, results []nodeResult[T]) error {
	var failed []nodeResult[T]
	for _, r := range results {
		if r.err != nil {
			failed = append(failed, r)
		}
	}
	leaveOut(ctx, c, method, failed)
	if len(failed) > 0 && len(failed) == len(results) {
		return status.Errorf(codes.Unavailable, "no storage node answered: %v", results[0].err)
	}
	return nil
}

// leaveOut says that method answered without the nodes of failed: a
// warning each, rnbd_csi_storage_node_left_out_total and the gRPC
// header LeftOutHeader naming them.
func leaveOut[T any](ctx context.Context, c *controller, method string, failed []nodeResult[T]) {
	var names []string
	for _, r := range failed {
		names = append(names, r.n.cfg.Name)
		c.m.leftOut.WithLabelValues(r.n.cfg.Name, method).Inc()
		c.log.WithError(r.err).WithFields(log.Fields{"storage_node": r.n.cfg.Name, "method": method}).Warn("answered without a storage node that did not answer")
	}
	if len(names) > 0 {
		// Only a gRPC call has a header to set (not a test calling
		// the method).
		_ = grpc.SetHeader(ctx, metadata.Pairs(LeftOutHeader, strings.Join(names, ",")))
	}
}

// page is one page of a sorted list of ids: from after the token (the
// last id of the page before), at most max entries; the next token, ""
// at the end. A token that is not one of ours is Aborted (the spec's).
func page(ids []string, token string, max int32) (from, to int, next string, err error) {
	if max < 0 {
		return 0, 0, "", status.Error(codes.InvalidArgument, "negative max_entries")
	}
	if token != "" {
		after, ok := strings.CutPrefix(token, "after:")
		if !ok {
			return 0, 0, "", status.Errorf(codes.Aborted, "starting_token %q is not one this driver gave", token)
		}
		from = sort.SearchStrings(ids, after)
		if from < len(ids) && ids[from] == after {
			from++
		}
	}
	to = len(ids)
	if max > 0 && from+int(max) < to {
		to = from + int(max)
		next = "after:" + ids[to-1]
	}
	return from, to, next, nil
}

// ListVolumes lists the driver's volumes (those with a csi.name label)
// of the storage nodes that answer.
func (c *controller) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	results := each(ctx, c.nodes, func(ctx context.Context, n *storageNode) ([]api.VolumeRecord, error) { return n.volumes(ctx) })
	if err := leftOut(ctx, c, "ListVolumes", results); err != nil {
		return nil, err
	}
	byID := map[string]found{}
	mirrors := c.mirrorEntries(results)
	var ids []string
	for id := range mirrors {
		ids = append(ids, id)
	}
	for _, r := range results {
		for _, v := range r.v {
			if v.Labels[labelName] == "" || v.Labels[labelMember] != "" {
				continue // not one of the driver's, or a replicated volume's member
			}
			id := makeID(r.n.cfg.Name, v.Name)
			byID[id] = found{r.n, v}
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	from, to, next, err := page(ids, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListVolumesResponse{NextToken: next}
	for _, id := range ids[from:to] {
		if m, ok := mirrors[id]; ok {
			resp.Entries = append(resp.Entries, m)
			continue
		}
		e := byID[id]
		var size int64
		if e.v.Size != nil {
			size = *e.v.Size
		}
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: &csi.Volume{VolumeId: id, CapacityBytes: size, AccessibleTopology: topologyOf(e.n.cfg)},
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: e.v.AllowIdentities.Identities()}})
	}
	return resp, nil
}

// GetCapacity is what the storage nodes of a topology segment (every one
// where none is given) that answer may still give new volumes in the
// pool of the parameters: the sum, and the most one volume may have.
func (c *controller) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	for _, vc := range req.GetVolumeCapabilities() {
		if err := checkCap(vc); err != nil {
			return nil, err
		}
	}
	p, err := parseParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	var nodes []*storageNode
	for _, n := range c.nodes {
		if req.GetAccessibleTopology() != nil && !matches(n.cfg.Labels, req.GetAccessibleTopology()) {
			continue
		}
		if _, ok := p.pathsOn(n.cfg); ok {
			nodes = append(nodes, n)
		}
	}
	results := each(ctx, nodes, func(ctx context.Context, n *storageNode) (int64, error) { return n.allocatable(ctx, p.poolOn(n.cfg)) })
	var sum, most int64
	var answered []nodeResult[int64]
	for _, r := range results {
		if r.err == nil {
			sum += r.v
			most = max(most, r.v)
		}
		answered = append(answered, r)
	}
	// No node of the segment answering is capacity 0 (nothing can be
	// placed there now), not an error: the scheduler then looks
	// elsewhere. Each is still a warning and a count.
	if err := leftOut(ctx, c, "GetCapacity", answered); err != nil && status.Code(err) != codes.Unavailable {
		return nil, err
	}
	return &csi.GetCapacityResponse{AvailableCapacity: sum, MaximumVolumeSize: wrapperspb.Int64(most)}, nil
}

func (c *controller) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	byID := map[string]*csi.Snapshot{}
	var ids []string
	add := func(n *storageNode, ss ...api.SnapshotRecord) {
		for _, s := range ss {
			if s.Labels[labelMember] != "" {
				continue // a replicated volume's (mirrors below)
			}
			id := makeID(n.cfg.Name, s.Name)
			byID[id] = csiSnapshot(n, s)
			ids = append(ids, id)
		}
	}
	mirrors := func(results []nodeResult[[]api.SnapshotRecord]) {
		for id, s := range mirrorSnapshotEntries(results) {
			byID[id] = s
			ids = append(ids, id)
		}
	}
	// A replicated volume's snapshots, or a snapshot of one: its members
	// are on several nodes.
	mirrorSnap, isMirrorSnap := parseMirrorID(req.GetSnapshotId())
	mirrorVol, isMirrorVol := parseMirrorID(req.GetSourceVolumeId())
	switch {
	case isMirrorSnap || isMirrorVol:
		results := each(ctx, c.nodes, func(ctx context.Context, n *storageNode) ([]api.SnapshotRecord, error) {
			if isMirrorSnap {
				s, err := n.snapshot(ctx, mirrorSnap)
				if err != nil || s == nil {
					return nil, err
				}
				return []api.SnapshotRecord{*s}, nil
			}
			return n.snapshots(ctx, mirrorVol)
		})
		for i := range results {
			if isNotFound(results[i].err) {
				results[i].err = nil
			}
		}
		if err := leftOut(ctx, c, "ListSnapshots", results); err != nil {
			return nil, err
		}
		mirrors(results)
		for id, s := range byID {
			if (isMirrorSnap && id != req.GetSnapshotId()) || (req.GetSourceVolumeId() != "" && s.SourceVolumeId != req.GetSourceVolumeId()) {
				delete(byID, id)
				ids = slices.DeleteFunc(ids, func(x string) bool { return x == id })
			}
		}
	case req.GetSnapshotId() != "":
		nodeName, name, ok := parseID(req.GetSnapshotId())
		if n := c.node(nodeName); ok && n != nil {
			s, err := n.snapshot(ctx, name)
			if err != nil && !isNotFound(err) {
				return nil, toStatus(err, "snapshot "+req.GetSnapshotId())
			}
			if err == nil && (req.GetSourceVolumeId() == "" || req.GetSourceVolumeId() == makeID(nodeName, s.Volume)) {
				add(n, *s)
			}
		}
	case req.GetSourceVolumeId() != "":
		nodeName, name, ok := parseID(req.GetSourceVolumeId())
		if n := c.node(nodeName); ok && n != nil {
			ss, err := n.snapshots(ctx, name)
			if err != nil && !isNotFound(err) {
				return nil, toStatus(err, "snapshots of "+req.GetSourceVolumeId())
			}
			add(n, ss...)
		}
	default:
		results := each(ctx, c.nodes, func(ctx context.Context, n *storageNode) ([]api.SnapshotRecord, error) { return n.snapshots(ctx, "") })
		if err := leftOut(ctx, c, "ListSnapshots", results); err != nil {
			return nil, err
		}
		for _, r := range results {
			add(r.n, r.v...)
		}
		mirrors(results)
	}
	sort.Strings(ids)
	from, to, next, err := page(ids, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, id := range ids[from:to] {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: byID[id]})
	}
	return resp, nil
}
