// A replicated volume's publish (mirror.go has the design): the worker
// granted on every member's node that answers, every member in the
// publish context, the publish recorded on the members, and the
// reconciler's mending of the grants of a member whose node was away.

package csi

import (
	"context"
	"encoding/json"
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
	"github.com/rnbd/rnbd/pkg/mirror"
)

// legContext is a member as the publish context gives it to the node.
type legContext struct {
	StorageNode string   `json:"storageNode"`
	Export      string   `json:"export"`
	Paths       []string `json:"paths"`
	Port        int      `json:"port"`
}

// publishMirror is ControllerPublishVolume of a replicated volume: the
// worker granted read-write on every member's node that answers (one
// writer: the mirror's), every member in the publish context.
func (c *controller) publishMirror(ctx context.Context, req *csi.ControllerPublishVolumeRequest, vname string) (*csi.ControllerPublishVolumeResponse, error) {
	id, node := req.GetVolumeId(), req.GetNodeId()
	if !singleNode(req.GetVolumeCapability()) || req.GetReadonly() {
		return nil, status.Errorf(codes.InvalidArgument, "volume %s is replicated: published read-write to one node (its mirror has one writer, which also resyncs its legs)", id)
	}
	mv, err := c.findMirror(ctx, vname)
	if err != nil {
		return nil, err
	}
	switch ok, err := c.workers.has(ctx, node); {
	case err != nil:
		return nil, status.Errorf(codes.Unavailable, "is node %s a worker: %v", node, err)
	case !ok:
		return nil, status.Errorf(codes.NotFound, "no worker node %s: %s", node, c.workers)
	}
	unlock, err := c.locks.lockByVolumeID(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	// The worker must be where every member's node is: in the labels
	// they share (those spreadBy spread them over are none of them).
	if t := c.sharedTopology(mv.place); len(t) > 0 {
		if err := c.reachableIn(ctx, t[0].GetSegments(), "replicated volume "+id+"'s storage nodes", node); err != nil {
			return nil, err
		}
	}
	var granted []string
	for _, m := range mv.place.members() {
		f, ok := mv.found[m.part]
		if !ok {
			continue
		}
		grants, err := f.n.grants(ctx, f.v.Name)
		if err != nil {
			if ctl.Classify(err) == ctl.CodeUnavailable {
				c.log.WithError(err).WithFields(log.Fields{"volume": id, "member": m.part}).Warn("publishing a replicated volume without a member whose node does not answer")
				continue
			}
			return nil, toStatus(err, fmt.Sprintf("grants of %s of %s", m.part, id))
		}
		have := false
		for _, g := range grants {
			switch {
			case g.Identity == node && g.Access != accessRW:
				return nil, status.Errorf(codes.AlreadyExists, "volume %s is published to node %s %s, asked %s", id, g.Identity, g.Access, accessRW)
			case g.Identity == node:
				have = true
			default:
				return nil, status.Errorf(codes.FailedPrecondition, "volume %s is published to node %s: a replicated volume is published to one node", id, g.Identity)
			}
		}
		if !have {
			if err := f.n.grant(ctx, f.v.Name, node, accessRW); err != nil {
				if ctl.Classify(err) == ctl.CodeUnavailable {
					c.log.WithError(err).WithFields(log.Fields{"volume": id, "member": m.part}).Warn("publishing a replicated volume without a member whose node does not answer")
					continue
				}
				return nil, toStatus(err, fmt.Sprintf("granting %s of volume %s to node %s", m.part, id, node))
			}
		}
		granted = append(granted, m.part)
	}
	if len(granted) == 0 {
		return nil, status.Errorf(codes.Unavailable, "volume %s: no member's storage node answers", id)
	}
	spares := c.spareNodes(mv)
	if err := c.notePublished(ctx, mv, node, spares); err != nil {
		return nil, err
	}
	c.log.WithFields(log.Fields{"volume": id, "node": node, "members": strings.Join(granted, ",")}).Info("replicated volume published")
	pc := map[string]string{PCMirror: vname, PCAccess: accessRW}
	var legs []legContext
	for _, n := range mv.place.legs {
		legs = append(legs, c.legContext(n, vname))
	}
	b, _ := json.Marshal(legs)
	pc[PCLegs] = string(b)
	size := int64(-1)
	for part, f := range mv.found {
		if a := f.v.Labels[labelAdopt]; a != "" {
			pc[PCAdopt] = a
		}
		if part != memberWit && f.v.Size != nil && (size < 0 || *f.v.Size < size) {
			size = *f.v.Size
		}
	}
	if size > mirror.DataOff {
		// A volume restored or cloned larger than its source (its legs
		// made larger), or grown while not staged: the mirror grows to
		// it at its stage.
		pc[PCSize] = strconv.FormatInt(size-mirror.DataOff, 10)
	}
	if w := mv.place.witness; w != "" {
		b, _ := json.Marshal(c.legContext(w, vname))
		pc[PCWitness] = string(b)
	}
	if len(spares) > 0 {
		var sc []legContext
		for _, n := range spares {
			sc = append(sc, c.legContext(n, vname))
		}
		b, _ := json.Marshal(sc)
		pc[PCSpares] = string(b)
	}
	for _, k := range []string{PCTransport, PCMpathPolicy, PCFrontend} {
		if s := req.GetVolumeContext()[k]; s != "" {
			pc[k] = s
		}
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: pc}, nil
}

// legContext is the publish context's member on storage node name (one
// that is no longer configured: its name alone; the node maps the
// mirror without it).
func (c *controller) legContext(name, vname string) legContext {
	lc := legContext{StorageNode: name, Export: vname}
	if n := c.node(name); n != nil {
		lc.Paths, lc.Port = n.cfg.Paths, n.cfg.Port
	}
	return lc
}

// unpublishMirror revokes the node's grants (every node's where none is
// named) on every member's node that answers.
func (c *controller) unpublishMirror(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest, vname string) (*csi.ControllerUnpublishVolumeResponse, error) {
	id := req.GetVolumeId()
	mv, err := c.findMirror(ctx, vname)
	if status.Code(err) == codes.NotFound {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	unlock, err := c.locks.lockByVolumeID(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	var errs []error
	for _, m := range mv.place.members() {
		f, ok := mv.found[m.part]
		if !ok {
			continue
		}
		ids := []string{req.GetNodeId()}
		if req.GetNodeId() == "" {
			ids = f.v.AllowIdentities.Identities()
		}
		for _, node := range ids {
			if err := f.n.revoke(ctx, f.v.Name, node); err != nil && !isNotFound(err) {
				errs = append(errs, fmt.Errorf("%s on %s: %w", m.part, f.n, err))
			}
		}
	}
	// A retired member too: the worker keeps no access to it.
	for _, f := range mv.strays {
		ids := []string{req.GetNodeId()}
		if req.GetNodeId() == "" {
			ids = f.v.AllowIdentities.Identities()
		}
		for _, node := range ids {
			if err := f.n.revoke(ctx, f.v.Name, node); err != nil && !isNotFound(err) {
				errs = append(errs, fmt.Errorf("retired %s on %s: %w", f.v.Labels[labelMember], f.n, err))
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, toStatus(err, "unpublishing volume "+id)
	}
	if err := c.notePublished(ctx, mv, "", nil); err != nil {
		return nil, err
	}
	if len(mv.silent) > 0 {
		c.log.WithFields(log.Fields{"volume": id, "silent": strings.Join(mv.silent, ",")}).Warn("replicated volume unpublished but on storage nodes that do not answer: their grants stay until they answer and it is unpublished again")
	}
	c.log.WithFields(log.Fields{"volume": id, "node": req.GetNodeId()}).Info("replicated volume unpublished")
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

// notePublished records on every member found that the volume is
// published to node ("": to none) as of now, with the spares it was
// given (mirror_replace.go).
func (c *controller) notePublished(ctx context.Context, mv *mirrorVolume, node string, spares []string) error {
	at := time.Now().UTC().Format(time.RFC3339Nano)
	for part, f := range mv.found {
		l := maps.Clone(f.v.Labels)
		l[labelPublished], l[labelPublishedAt], l[labelSpares] = node, at, strings.Join(spares, ",")
		if err := f.n.setLabels(ctx, f.v.Name, l); err != nil && ctl.Classify(err) != ctl.CodeUnavailable {
			return toStatus(err, fmt.Sprintf("volume %s: recording its publish on %s", mv.id(), part))
		}
	}
	return nil
}

// reconcileGrants makes the grants of each replicated volume's members
// among the storage nodes' records agree with the member that says last
// to whom it is published: a member's node that did not answer at
// publish is granted (its leg can rejoin), one that did not at
// unpublish revoked. The members are read again with the volume's lock
// held (a publish may have changed them since the list). It returns how
// many members it changed.
func (c *controller) reconcileGrants(ctx context.Context, results []nodeResult[[]api.VolumeRecord]) int {
	byVol := map[string][]*storageNode{}
	for _, r := range results {
		for _, v := range r.v {
			if v.Labels[labelMember] != "" && v.Labels[labelName] != "" {
				byVol[v.Name] = append(byVol[v.Name], r.n)
			}
		}
	}
	changed := 0
	for vname, nodes := range byVol {
		unlock, err := c.locks.lockByVolumeID(mirrorID(vname))
		if err != nil {
			continue // a call of it under way: the next round
		}
		changed += c.mendGrants(ctx, vname, nodes)
		unlock()
	}
	return changed
}

// mendGrants is reconcileGrants of one volume, its lock held.
func (c *controller) mendGrants(ctx context.Context, vname string, nodes []*storageNode) int {
	var fs []found
	for _, n := range nodes {
		if v, err := n.volume(ctx, vname); err == nil && v.Labels[labelMember] != "" {
			fs = append(fs, found{n, *v})
		}
	}
	if len(fs) == 0 {
		return 0
	}
	last := fs[0]
	for _, f := range fs[1:] {
		if f.v.Labels[labelPublishedAt] > last.v.Labels[labelPublishedAt] {
			last = f
		}
	}
	if last.v.Labels[labelPublishedAt] == "" {
		return 0 // never published
	}
	want, changed := last.v.Labels[labelPublished], 0
	for _, f := range fs {
		ids := f.v.AllowIdentities.Identities()
		if f.v.Labels[labelPublishedAt] == last.v.Labels[labelPublishedAt] && slices.Equal(ids, nonEmpty(want)) {
			continue
		}
		fields := log.Fields{"volume": mirrorID(vname), "member": f.v.Labels[labelMember], "storage_node": f.n.cfg.Name, "published": want}
		if err := c.fixGrants(ctx, f, ids, want, last.v.Labels); err != nil {
			c.log.WithError(err).WithFields(fields).Warn("a replicated volume's member's grants disagree with its publish and were not mended; tried again next round")
			continue
		}
		changed++
		c.log.WithFields(fields).Info("a replicated volume's member's grants mended to its publish")
	}
	return changed
}

func nonEmpty(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}

// fixGrants gives member f the grant want (and no other) and the publish
// labels of last.
func (c *controller) fixGrants(ctx context.Context, f found, ids []string, want string, last map[string]string) error {
	for _, id := range ids {
		if id != want {
			if err := f.n.revoke(ctx, f.v.Name, id); err != nil && !isNotFound(err) {
				return err
			}
		}
	}
	if want != "" && !slices.Contains(ids, want) {
		if err := f.n.grant(ctx, f.v.Name, want, accessRW); err != nil {
			return err
		}
	}
	l := maps.Clone(f.v.Labels)
	l[labelPublished], l[labelPublishedAt], l[labelSpares] = last[labelPublished], last[labelPublishedAt], last[labelSpares]
	return f.n.setLabels(ctx, f.v.Name, l)
}
