// CreateVolume: a volume of a CSI name, found where a retry made it
// already, else made on a storage node placed by topology and room,
// empty or a clone of its content source.

package csi

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/log"
)

// createRequest is a CreateVolume request, checked.
type createRequest struct {
	*csi.CreateVolumeRequest
	p     volumeParams
	size  int64
	vname string // the name on the storage node
	src   *contentSource
}

// contentSource is the volume or snapshot a new volume is a clone of,
// on its storage node, which is where the clone is made.
type contentSource struct {
	node *storageNode
	// id is its CSI id, what "volume" or "snapshot", size its size.
	id, what string
	size     int64
	// fromVol or fromSnap is its name on node (api.VolumeRequest's).
	fromVol, fromSnap string
}

func (c *controller) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	r, err := checkCreate(req)
	if err != nil {
		return nil, err
	}
	unlock, err := c.locks.lockByName(req.GetName())
	if err != nil {
		return nil, err
	}
	defer unlock()
	if r.p.replicas > 0 {
		return c.createMirror(ctx, r)
	}
	if err := c.resolveSource(ctx, &r); err != nil {
		return nil, err
	}
	// A retry: the volume is on one of the storage nodes already.
	found, unchecked, err := c.lookup(ctx, r.vname, req.GetName())
	if err != nil {
		return nil, err
	}
	if len(found) > 0 {
		if len(found) > 1 {
			c.wakeReconciler() // the older copies are reclaimed there
		}
		return c.existing(ctx, r, newest(found))
	}
	return c.makeVolume(ctx, r, unchecked)
}

// checkCreate checks a CreateVolume request.
func checkCreate(req *csi.CreateVolumeRequest) (createRequest, error) {
	r := createRequest{CreateVolumeRequest: req}
	if req.GetName() == "" {
		return r, status.Error(codes.InvalidArgument, "no name")
	}
	if err := checkCaps(req.GetVolumeCapabilities()); err != nil {
		return r, err
	}
	var err error
	if r.p, err = parseParams(req.GetParameters()); err != nil {
		return r, err
	}
	if r.size, err = sizeOf(req.GetCapacityRange()); err != nil {
		return r, err
	}
	r.vname = storageName(req.GetName())
	return r, nil
}

// resolveSource finds the request's content source, and sizes the new
// volume after it: its source's size where the request asks none, and
// never less than it.
func (c *controller) resolveSource(ctx context.Context, r *createRequest) error {
	src := r.GetVolumeContentSource()
	if src == nil {
		return nil
	}
	s := &contentSource{what: "volume"}
	switch {
	case src.GetSnapshot() != nil:
		s.id, s.what = src.GetSnapshot().GetSnapshotId(), "snapshot"
	case src.GetVolume() != nil:
		s.id = src.GetVolume().GetVolumeId()
	default:
		return status.Error(codes.InvalidArgument, "a volume content source of neither a snapshot nor a volume")
	}
	if _, ok := parseMirrorID(s.id); ok {
		// Its members' snapshots are one point in time (mirror_snapshot.go);
		// assembling new legs from them under a new mirror is what is
		// missing.
		return status.Errorf(codes.InvalidArgument, "content source %s is a replicated volume's %s: a volume from one is not implemented yet", s.id, s.what)
	}
	nodeName, name, ok := parseID(s.id)
	if s.node = c.node(nodeName); !ok || s.node == nil {
		return status.Errorf(codes.NotFound, "content source %q: no such %s", s.id, s.what)
	}
	if s.what == "snapshot" {
		rec, err := s.node.snapshot(ctx, name)
		if err != nil {
			return toStatus(err, "content source snapshot "+s.id)
		}
		s.size, s.fromSnap = rec.Size, name
	} else {
		rec, err := s.node.volume(ctx, name)
		if err != nil {
			return toStatus(err, "content source volume "+s.id)
		}
		if rec.Size != nil {
			s.size = *rec.Size
		}
		s.fromVol = name
	}
	cr := r.GetCapacityRange()
	if cr.GetRequiredBytes() == 0 && s.size > 0 && (cr.GetLimitBytes() == 0 || s.size <= cr.GetLimitBytes()) {
		r.size = s.size
	}
	if s.size > r.size {
		return status.Errorf(codes.OutOfRange, "%s %s has %d bytes: more than the %d asked", s.what, s.id, s.size, r.size)
	}
	r.src = s
	return nil
}

// found is a copy of a CSI name on a storage node.
type found struct {
	n *storageNode
	v api.VolumeRecord
}

// newest is the copy the controller asked for last: the one a CO that
// retried holds (reclaim.go).
func newest(fs []found) found {
	best := fs[0]
	for _, f := range fs[1:] {
		if madeAt(f.v).After(madeAt(best.v)) {
			best = f
		}
	}
	return best
}

// lookup asks every storage node at once for volume vname: the copies
// of CSI name csiName found, and the nodes that could not say (did not
// answer, or failed). A volume of that name made for another CSI name
// is AlreadyExists. The name is looked for everywhere so that a retry
// never makes it twice; a node that does not answer does not stop the
// others, and the volume made meanwhile remembers it (labelUnchecked).
func (c *controller) lookup(ctx context.Context, vname, csiName string) ([]found, []string, error) {
	results := each(ctx, c.nodes, func(ctx context.Context, n *storageNode) (*api.VolumeRecord, error) { return n.volume(ctx, vname) })
	var out []found
	var unchecked []string
	for _, r := range results {
		switch {
		case isNotFound(r.err):
		case r.err != nil:
			unchecked = append(unchecked, r.n.cfg.Name)
			c.m.leftOut.WithLabelValues(r.n.cfg.Name, "CreateVolume").Inc()
			c.log.WithError(r.err).WithFields(log.Fields{"storage_node": r.n.cfg.Name, "volume": vname}).
				Warn("looking for a volume: this storage node cannot say whether it has it; placed on the others, and looked at again when it answers")
		case r.v.Labels[labelName] != csiName:
			return nil, nil, status.Errorf(codes.AlreadyExists, "volume %s on %s is not the volume of CSI name %q (its %s is %q)",
				vname, r.n, csiName, labelName, r.v.Labels[labelName])
		default:
			out = append(out, found{r.n, *r.v})
		}
	}
	return out, unchecked, nil
}

// existing answers a retry with the volume found, if it is what the
// request asks: the same parameters, a size in its capacity range, a
// storage node in its topology, the same content source (else
// AlreadyExists, as the spec asks). One whose create was interrupted
// (not served yet) is finished first.
func (c *controller) existing(ctx context.Context, r createRequest, f found) (*csi.CreateVolumeResponse, error) {
	n, v := f.n, f.v
	if v.State == api.VolumeCreating || v.State == api.VolumeDeleting {
		return nil, status.Errorf(codes.Unavailable, "volume %s (CSI name %q) on %s is %s there: a change of it is under way; try again", v.Name, r.GetName(), n, v.State)
	}
	var why []string
	if got, want := v.Labels[labelParams], r.p.canonical(); got != want {
		why = append(why, fmt.Sprintf("parameters %q (asked %q)", got, want))
	}
	if v.Size != nil && !fits(*v.Size, r.GetCapacityRange()) {
		why = append(why, fmt.Sprintf("%d bytes, outside the capacity range asked [%d, %d]", *v.Size,
			r.GetCapacityRange().GetRequiredBytes(), r.GetCapacityRange().GetLimitBytes()))
	}
	if !eligible(n.cfg.Labels, r.GetAccessibilityRequirements()) {
		why = append(why, fmt.Sprintf("on %s, whose topology %v is none of those asked", n, n.cfg.Labels))
	}
	if s := r.src; s == nil && (v.Source != "" || v.SourceSnapshot != "") ||
		s != nil && (s.node != n || v.Source != s.fromVol || v.SourceSnapshot != s.fromSnap) {
		why = append(why, fmt.Sprintf("another content source (volume %q, snapshot %q)", v.Source, v.SourceSnapshot))
	}
	if len(why) > 0 {
		return nil, status.Errorf(codes.AlreadyExists, "volume %s (CSI name %q) exists on %s with %s", v.Name, r.GetName(), n, strings.Join(why, "; "))
	}
	if v.State != api.VolumeServed {
		rec, err := finish(ctx, f, r.p.writeThrough)
		if err != nil {
			return nil, toStatus(err, fmt.Sprintf("finishing volume %s (CSI name %q) on %s", v.Name, r.GetName(), n))
		}
		v = rec
	}
	// The copy answered is the one the CO holds from now: it is made
	// the newest (reclaim.go), so that a copy of the name a node that
	// does not answer now may hold is the older one, whenever it is
	// made.
	labels := maps.Clone(v.Labels)
	labels[labelMade] = time.Now().UTC().Format(time.RFC3339Nano)
	if err := n.setLabels(ctx, v.Name, labels); err != nil {
		return nil, toStatus(err, fmt.Sprintf("volume %s (CSI name %q) on %s", v.Name, r.GetName(), n))
	}
	return &csi.CreateVolumeResponse{Volume: c.csiVolume(n, v, r.p, r.GetVolumeContentSource())}, nil
}

// finish finishes volume f, made but not exported yet (or its daemon
// restarted between): the same create again, as it was made.
func finish(ctx context.Context, f found, writeThrough bool) (api.VolumeRecord, error) {
	v := f.v
	req := api.VolumeRequest{Name: v.Name, Pool: v.Pool, Labels: v.Labels, FromVolume: v.Source, FromSnapshot: v.SourceSnapshot,
		Export: api.MapRequest{GrantsOnly: ptr(true), WriteThrough: writeThrough}}
	if v.Size != nil {
		req.Size = strconv.FormatInt(*v.Size, 10)
	}
	return f.n.createVolume(ctx, req)
}

// makeVolume makes the volume on the best storage node that has room
// (its content source's, for a clone). unchecked are the nodes that
// could not say whether they had it: it is labelled with them.
func (c *controller) makeVolume(ctx context.Context, r createRequest, unchecked []string) (*csi.CreateVolumeResponse, error) {
	var only *storageNode
	if r.src != nil {
		only = r.src.node
		if slices.Contains(unchecked, only.cfg.Name) {
			return nil, status.Errorf(codes.Unavailable, "a clone of %s %s is made on %s, which does not answer", r.src.what, r.src.id, only)
		}
	}
	cands, err := c.candidates(ctx, r.p, r.GetAccessibilityRequirements(), only, r.size, unchecked)
	if err != nil {
		return nil, err
	}
	labels := map[string]string{labelName: r.GetName(), labelParams: r.p.canonical(), labelMade: time.Now().UTC().Format(time.RFC3339Nano)}
	if len(unchecked) > 0 {
		labels[labelUnchecked] = strings.Join(unchecked, ",")
	}
	body := api.VolumeRequest{Name: r.vname, Size: strconv.FormatInt(r.size, 10), Labels: labels,
		Export: api.MapRequest{GrantsOnly: ptr(true), WriteThrough: r.p.writeThrough}}
	if r.src != nil {
		body.FromVolume, body.FromSnapshot = r.src.fromVol, r.src.fromSnap
	}
	var errs []error
	for _, cd := range cands {
		body.Pool = r.p.poolOn(cd.node.cfg)
		rec, err := cd.node.createVolume(ctx, body)
		if ctl.Classify(err) == ctl.CodeNoSpace {
			errs = append(errs, err)
			continue // taken since we asked: the next one
		}
		if err != nil {
			return nil, toStatus(err, fmt.Sprintf("creating volume %s on %s", r.vname, cd.node))
		}
		fields := log.Fields{"volume": makeID(cd.node.cfg.Name, r.vname), "csi_name": r.GetName(), "size": r.size}
		if len(unchecked) > 0 {
			fields["unchecked"] = labels[labelUnchecked]
		}
		c.log.WithFields(fields).Info("volume created")
		return &csi.CreateVolumeResponse{Volume: c.csiVolume(cd.node, rec, r.p, r.GetVolumeContentSource())}, nil
	}
	return nil, status.Errorf(codes.ResourceExhausted, "no storage node had room for %d bytes: %v", r.size, errors.Join(errs...))
}

// csiVolume is the CSI volume of a record on n.
func (c *controller) csiVolume(n *storageNode, rec api.VolumeRecord, p volumeParams, src *csi.VolumeContentSource) *csi.Volume {
	var size int64
	if rec.Size != nil {
		size = *rec.Size
	}
	paths, _ := p.pathsOn(n.cfg)
	vc := map[string]string{"storageNode": n.cfg.Name, "pool": rec.Pool, "paths": strings.Join(paths, ","),
		"port": strconv.Itoa(n.cfg.Port), "writeThrough": strconv.FormatBool(p.writeThrough)}
	for k, v := range map[string]string{VCFsType: p.fsType, "transport": p.transport, "mpathPolicy": p.mpathPolicy, PCFrontend: p.frontend} {
		if v != "" {
			vc[k] = v
		}
	}
	return &csi.Volume{VolumeId: makeID(n.cfg.Name, rec.Name), CapacityBytes: size, VolumeContext: vc,
		ContentSource: src, AccessibleTopology: topologyOf(n.cfg)}
}

func ptr[T any](v T) *T { return &v }

// deref is what p points at, or T's zero for nil.
func deref[T any](p *T) T {
	if p == nil {
		var z T
		return z
	}
	return *p
}
