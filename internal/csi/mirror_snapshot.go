// Snapshots of replicated volumes: one point in time across the members.
//
// A replicated volume's snapshot is a snapshot of every member (legs and
// witness), each on its member's storage node, all of the name the CSI
// name gives and each with its part (csi.member), the placement
// (csi.members) and the CSI name (csi.name) as labels; its id is
// "mirror:<name>". The members are snapshotted while the writes of every
// one of them are held (rnbd-server volume hold, at most holdFor): no
// write of the worker's mirror lands on any member from the moment all
// are held until all are snapshotted, so that the snapshots are one
// point in time of the whole mirror — what a crash of its client would
// have left, which the mirror's assembly makes consistent (its
// bitmap and generations are in the snapshots too). A hold whose time
// ran out before its release leaves no snapshot: the ones taken are
// deleted and the call fails (Unavailable), for the CO to try again.
//
// Every member's node must answer: a member left out could be the only
// leg in sync. A volume from such a snapshot is made of its members'
// snapshots on their nodes (the same placement), each member a clone of
// its own snapshot; the worker's mirror adopts them (api.Mapping.Adopt):
// the voters carry the snapshotted mirror's identity, and its first
// assembly, as after a crash, gives them the new one's. A clone of a
// replicated volume is made the same way without the snapshots: every
// member a clone of the source's, made while the source's are held.

package csi

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/mirror"
)

// Labels of a member restored from a replicated volume's snapshot: the
// snapshot (each member's of that name on its node), and the mirror
// whose voters they are copies of (api.Mapping.Adopt).
const (
	labelFromSnap = "csi.from-snapshot"
	labelFromVol  = "csi.from-volume" // a clone's source
	labelAdopt    = "csi.adopt"
)

// holdFor bounds each member's hold: well inside the mirror's leg
// timeout (mirror.DefaultLegTimeout), after which the worker would take
// a leg whose writes wait out.
const holdFor = 2 * time.Second

// memberSnap is a member's snapshot found on its node.
type memberSnap struct {
	n *storageNode
	s api.SnapshotRecord
}

func (c *controller) createMirrorSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest, vname string) (*csi.CreateSnapshotResponse, error) {
	mv, err := c.findMirror(ctx, vname)
	if err != nil {
		return nil, err
	}
	if len(mv.silent) > 0 {
		return nil, status.Errorf(codes.Unavailable, "volume %s: a snapshot needs every member, and %s did not answer",
			mv.id(), strings.Join(mv.silent, ", "))
	}
	members := mv.place.members()
	for _, m := range members {
		if _, ok := mv.found[m.part]; !ok {
			return nil, status.Errorf(codes.Unavailable, "volume %s: its %s on %s is missing (a replacement under way?): no snapshot until it is there",
				mv.id(), m.part, m.node)
		}
	}
	unlock, err := c.locks.lockBySnapshotName(req.GetName())
	if err != nil {
		return nil, err
	}
	defer unlock()
	sname := storageName(req.GetName())
	// Only a node that holds or held a member can hold a part of an
	// earlier try: those must answer. Another that does not is left out
	// (the name's uniqueness across volumes is checked on the nodes
	// that answer, as a volume's name is).
	have, err := c.mirrorSnapshotMembersOn(ctx, sname, "CreateSnapshot", mv.nodes())
	if err != nil {
		return nil, err
	}
	for _, h := range have {
		if h.s.Volume != vname || h.s.Labels[labelMember] == "" {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %s exists on %s, of volume %s", req.GetName(), h.n, h.s.Volume)
		}
	}
	// Whole, as its own placement says (the volume's may have changed
	// since, a leg replaced): the snapshot asked again.
	if len(have) > 0 {
		if p, err := parsePlacement(have[0].s.Labels[labelMembers]); err == nil && completeSnapshot(have, p) {
			return &csi.CreateSnapshotResponse{Snapshot: mirrorSnapshot(sname, vname, have)}, nil
		}
	}
	// Some members of an earlier try, taken at another moment than
	// the others would be: not mixed with new ones.
	if err := c.deleteMemberSnaps(ctx, have); err != nil {
		return nil, err
	}
	labels := map[string]string{labelName: req.GetName(), labelMembers: mv.place.String()}
	taken, err := c.heldSnapshots(ctx, mv, sname, labels)
	if err != nil {
		return nil, err
	}
	return &csi.CreateSnapshotResponse{Snapshot: mirrorSnapshot(sname, vname, taken)}, nil
}

// heldSnapshots holds every member's writes, snapshots each, and
// releases them; if a hold ran out before its release, or anything
// failed, the snapshots taken are deleted.
func (c *controller) heldSnapshots(ctx context.Context, mv *mirrorVolume, sname string, labels map[string]string) ([]memberSnap, error) {
	taken := make([]memberSnap, len(mv.place.members()))
	err := c.whileHeld(ctx, mv, "snapshot "+sname, func(i int, m member, n *storageNode) error {
		l := maps.Clone(labels)
		l[labelMember] = m.part
		out, err := callOn(ctx, n, "a snapshot "+sname, func(ctx context.Context) (api.CreatedSnapshot, error) {
			return n.api.CreateSnapshot(ctx, api.SnapshotRequest{Name: sname, Volume: mv.vname, Labels: l})
		})
		if err == nil {
			taken[i] = memberSnap{n, out.Record}
		}
		return err
	}, func() {
		made := slices.DeleteFunc(slices.Clone(taken), func(t memberSnap) bool { return t.n == nil })
		if err := c.deleteMemberSnaps(ctx, made); err != nil {
			c.log.WithError(err).WithField("snapshot", sname).Warn("a replicated volume's member snapshots of a failed try are left; the next try or DeleteSnapshot deletes them")
		}
	})
	if err != nil {
		return nil, err
	}
	return taken, nil
}

// whileHeld holds the writes of every member of mv, runs do for each once
// all are held, and releases them. If a hold could not be taken, do
// failed, or a hold ran out before its release (writes ran since: what
// do made is not of one point in time), undo runs and the error says
// why; Unavailable where a retry may succeed.
func (c *controller) whileHeld(ctx context.Context, mv *mirrorVolume, what string, do func(i int, m member, n *storageNode) error, undo func()) error {
	members := mv.place.members()
	tokens := make([]uint64, len(members))
	held := make([]bool, len(members))
	release := func() error {
		// Released even when the caller gave up meanwhile: a hold left
		// to run out delays the worker's writes for nothing.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		errs := parallel(len(members), func(i int) error {
			if !held[i] {
				return nil
			}
			n := mv.found[members[i].part].n
			ok, err := callOn(ctx, n, "a release of volume "+mv.vname, func(ctx context.Context) (bool, error) {
				return n.api.ReleaseVolume(ctx, mv.vname, tokens[i])
			})
			if err == nil && !ok {
				err = fmt.Errorf("its hold ran out (%v) before the release", holdFor)
			}
			return err
		})
		return firstErr(errs, members)
	}
	errs := parallel(len(members), func(i int) error {
		n := mv.found[members[i].part].n
		h, err := callOn(ctx, n, "a hold of volume "+mv.vname, func(ctx context.Context) (api.Hold, error) {
			return n.api.HoldVolume(ctx, mv.vname, holdFor)
		})
		tokens[i], held[i] = h.Token, err == nil
		return err
	})
	if err := firstErr(errs, members); err != nil {
		release()
		return status.Errorf(codes.Unavailable, "volume %s: holding its writes for %s: %v", mv.id(), what, err)
	}
	doErr := firstErr(parallel(len(members), func(i int) error {
		return do(i, members[i], mv.found[members[i].part].n)
	}), members)
	relErr := release()
	if doErr == nil && relErr == nil {
		return nil
	}
	undo()
	if doErr != nil {
		return toStatus(doErr, fmt.Sprintf("%s of volume %s", what, mv.id()))
	}
	return status.Errorf(codes.Unavailable, "%s of volume %s: the members were not all held until it was made (%v); what was made is deleted, try again", what, mv.id(), relErr)
}

// parallel runs f for 0..n-1 at once and returns their errors.
func parallel(n int, f func(i int) error) []error {
	errs := make([]error, n)
	done := make(chan struct{}, n)
	for i := range n {
		go func() {
			errs[i] = f(i)
			done <- struct{}{}
		}()
	}
	for range n {
		<-done
	}
	return errs
}

// firstErr names the first member whose call failed.
func firstErr(errs []error, members []member) error {
	for i, err := range errs {
		if err != nil {
			return fmt.Errorf("%s on %s: %w", members[i].part, members[i].node, err)
		}
	}
	return nil
}

// mirrorSnapshotMembers are the snapshots named sname on every storage
// node; a node that does not answer could hold one: Unavailable.
func (c *controller) mirrorSnapshotMembers(ctx context.Context, sname string) ([]memberSnap, error) {
	return c.mirrorSnapshotMembersOn(ctx, sname, "", nil)
}

// mirrorSnapshotMembersOn is mirrorSnapshotMembers where only the nodes
// in must can hold a part of the snapshot asked for (nil: any node): a
// node not in must that does not answer can hold only another volume's
// snapshot of that name, which its silence does not hide for long (it
// is found once the node answers), so method answers without it, as a
// list does.
func (c *controller) mirrorSnapshotMembersOn(ctx context.Context, sname, method string, must []string) ([]memberSnap, error) {
	var out []memberSnap
	var silent []string
	var skipped []nodeResult[*api.SnapshotRecord]
	for _, r := range each(ctx, c.nodes, func(ctx context.Context, n *storageNode) (*api.SnapshotRecord, error) { return n.snapshot(ctx, sname) }) {
		switch {
		case isNotFound(r.err):
		case r.err != nil && must != nil && !slices.Contains(must, r.n.cfg.Name):
			skipped = append(skipped, r)
		case r.err != nil:
			silent = append(silent, r.n.cfg.Name)
		default:
			out = append(out, memberSnap{r.n, *r.v})
		}
	}
	if silent != nil {
		return nil, status.Errorf(codes.Unavailable, "snapshot %s: %s did not answer, and may hold a part of it", sname, strings.Join(silent, ", "))
	}
	leaveOut(ctx, c, method, skipped)
	return out, nil
}

// nodes are the storage nodes that hold, or held, a member of mv: its
// placement's, its retired members', and any other holding a volume of
// its name with a member's labels.
func (mv *mirrorVolume) nodes() []string {
	var out []string
	for _, m := range mv.place.members() {
		out = append(out, m.node)
	}
	out = append(out, mv.retired...)
	for _, s := range mv.strays {
		out = append(out, s.n.cfg.Name)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// completeSnapshot says whether have is a snapshot of every member of p,
// each on its node and taken with p.
func completeSnapshot(have []memberSnap, p placement) bool {
	for _, m := range p.members() {
		if !slices.ContainsFunc(have, func(h memberSnap) bool {
			return h.n.cfg.Name == m.node && h.s.Labels[labelMember] == m.part && h.s.Labels[labelMembers] == p.String()
		}) {
			return false
		}
	}
	return len(have) == len(p.members())
}

func (c *controller) deleteMemberSnaps(ctx context.Context, ms []memberSnap) error {
	errs := parallel(len(ms), func(i int) error { return ms[i].n.deleteSnapshot(ctx, ms[i].s.Name) })
	for i, err := range errs {
		if err != nil {
			return toStatus(err, fmt.Sprintf("deleting snapshot %s on %s", ms[i].s.Name, ms[i].n))
		}
	}
	return nil
}

// mirrorSnapshot is the CSI snapshot of members ms of a snapshot of
// replicated volume vname: its size the smallest leg's data.
func mirrorSnapshot(sname, vname string, ms []memberSnap) *csi.Snapshot {
	out := &csi.Snapshot{SnapshotId: mirrorID(sname), SourceVolumeId: mirrorID(vname), ReadyToUse: true}
	for _, m := range ms {
		if m.s.Labels[labelMember] == memberWit {
			continue
		}
		if sz := m.s.Size - mirror.DataOff; out.SizeBytes == 0 || sz < out.SizeBytes {
			out.SizeBytes = sz
		}
		if t, err := time.Parse(time.RFC3339Nano, m.s.Created); err == nil && (out.CreationTime == nil || t.Before(out.CreationTime.AsTime())) {
			out.CreationTime = timestamppb.New(t)
		}
	}
	return out
}

// deleteMirrorSnapshot deletes every member of snapshot "mirror:<sname>";
// a node that does not answer may hold one: Unavailable, for a retry.
func (c *controller) deleteMirrorSnapshot(ctx context.Context, sname string) error {
	have, err := c.mirrorSnapshotMembers(ctx, sname)
	if err != nil {
		return err
	}
	var ms []memberSnap
	for _, h := range have {
		if h.s.Labels[labelMember] != "" {
			ms = append(ms, h) // a single node's snapshot of that name is not this one's
		}
	}
	return c.deleteMemberSnaps(ctx, ms)
}

// mirrorSnapshotEntries groups the member snapshots among what the nodes
// listed into the replicated volumes' snapshots, by id; a snapshot
// without all of its members is not ready to use.
func mirrorSnapshotEntries(results []nodeResult[[]api.SnapshotRecord]) map[string]*csi.Snapshot {
	byName := map[string][]memberSnap{}
	for _, r := range results {
		for _, s := range r.v {
			if s.Labels[labelMember] != "" && s.Labels[labelName] != "" {
				byName[s.Name] = append(byName[s.Name], memberSnap{r.n, s})
			}
		}
	}
	out := map[string]*csi.Snapshot{}
	for name, ms := range byName {
		snap := mirrorSnapshot(name, ms[0].s.Volume, ms)
		p, err := parsePlacement(ms[0].s.Labels[labelMembers])
		snap.ReadyToUse = err == nil && completeSnapshot(ms, p)
		out[snap.SnapshotId] = snap
	}
	return out
}

// restorePlacement is the placement of a replicated volume made from
// snapshot "mirror:<sname>": its members' nodes, each member a clone of
// the snapshot there. It sets r's size to the snapshot's, or to the
// larger one asked (its legs are made that large; the mirror grows to
// it at its first stage, PCSize), and adds the labels every member
// carries.
func (c *controller) restorePlacement(ctx context.Context, r *createRequest, sname string, labels map[string]string) (placement, error) {
	id := mirrorID(sname)
	have, err := c.mirrorSnapshotMembers(ctx, sname)
	if err != nil {
		return placement{}, err
	}
	have = slices.DeleteFunc(have, func(h memberSnap) bool { return h.s.Labels[labelMember] == "" })
	if len(have) == 0 {
		return placement{}, status.Errorf(codes.NotFound, "content source %s: no such snapshot", id)
	}
	p, err := parsePlacement(have[0].s.Labels[labelMembers])
	if err != nil || !completeSnapshot(have, p) {
		return placement{}, status.Errorf(codes.FailedPrecondition, "content source %s is not whole (%d members of %q): it cannot be restored", id, len(have), have[0].s.Labels[labelMembers])
	}
	if len(p.legs) != r.p.replicas {
		return placement{}, status.Errorf(codes.InvalidArgument, "content source %s has %d legs, the StorageClass asks replicas %d: restore with replicas %d",
			id, len(p.legs), r.p.replicas, len(p.legs))
	}
	for _, m := range p.members() {
		if c.node(m.node) == nil {
			return placement{}, status.Errorf(codes.FailedPrecondition, "content source %s: its %s's storage node %s is not configured", id, m.part, m.node)
		}
	}
	snap := mirrorSnapshot(sname, have[0].s.Volume, have)
	size, err := sizeFrom(snap.GetSizeBytes(), r.size, r.GetCapacityRange())
	if err != nil {
		return placement{}, status.Errorf(codes.OutOfRange, "snapshot %s has %d bytes: %v", id, snap.GetSizeBytes(), err)
	}
	r.size = size
	labels[labelFromSnap], labels[labelAdopt] = sname, have[0].s.Volume
	return p, nil
}

// sizeFrom is the size of a replicated volume made from a source of
// src bytes of data: the source's where the range asks none more (the
// CO asked none, or less), else sized, the range's size rounded (the
// legs made that large, the mirror grown to it at its first stage).
func sizeFrom(src, sized int64, cr *csi.CapacityRange) (int64, error) {
	size := src
	if cr.GetRequiredBytes() > src {
		size = sized
	}
	if !fits(size, cr) {
		return 0, fmt.Errorf("a volume of %d bytes made of it is outside the capacity range asked (%d to %d)", size, cr.GetRequiredBytes(), cr.GetLimitBytes())
	}
	return size, nil
}

// memberSize is the size to make a member of a replicated volume of
// size bytes as a clone of a source member of src bytes: a leg the
// data and the metadata, the witness its source's ("": the source's).
func memberSize(part string, size, src int64) string {
	if part == memberWit || size+mirror.DataOff <= src {
		return ""
	}
	return strconv.FormatInt(size+mirror.DataOff, 10)
}

// cloneMirror makes replicated volume r a clone of replicated volume
// svname: each member a clone of the source's on its node (the same
// placement), made while the writes of every member of the source are
// held — one point in time, as a snapshot's — and adopted at its first
// stage. A member not made, or a hold that ran out first, leaves
// nothing (Unavailable: the CO tries again).
func (c *controller) cloneMirror(ctx context.Context, r createRequest, svname string, labels map[string]string) (*csi.CreateVolumeResponse, error) {
	id := mirrorID(svname)
	mv, err := c.findMirror(ctx, svname)
	if err != nil {
		return nil, err
	}
	if len(mv.silent) > 0 {
		return nil, status.Errorf(codes.Unavailable, "volume %s: a clone needs every member, and %s did not answer", id, strings.Join(mv.silent, ", "))
	}
	size := int64(-1)
	for _, m := range mv.place.members() {
		f, ok := mv.found[m.part]
		if !ok {
			return nil, status.Errorf(codes.Unavailable, "volume %s: its %s on %s is missing (a replacement under way?): no clone until it is there", id, m.part, m.node)
		}
		if m.part != memberWit && f.v.Size != nil && (size < 0 || *f.v.Size-mirror.DataOff < size) {
			size = *f.v.Size - mirror.DataOff
		}
	}
	if len(mv.place.legs) != r.p.replicas {
		return nil, status.Errorf(codes.InvalidArgument, "content source %s has %d legs, the StorageClass asks replicas %d: clone with replicas %d",
			id, len(mv.place.legs), r.p.replicas, len(mv.place.legs))
	}
	if size, err = sizeFrom(size, r.size, r.GetCapacityRange()); err != nil {
		return nil, status.Errorf(codes.OutOfRange, "volume %s: %v", id, err)
	}
	labels[labelFromVol], labels[labelAdopt], labels[labelMembers] = svname, svname, mv.place.String()
	made := make([]*found, len(mv.place.members()))
	err = c.whileHeld(ctx, mv, "a clone "+mirrorID(r.vname), func(i int, m member, n *storageNode) error {
		l := maps.Clone(labels)
		l[labelMember] = m.part
		src := mv.found[m.part].v
		rec, err := n.createVolume(ctx, api.VolumeRequest{Name: r.vname, Pool: src.Pool, FromVolume: svname, Labels: l, Size: memberSize(m.part, size, deref(src.Size)),
			Export: api.MapRequest{GrantsOnly: ptr(true), WriteThrough: r.p.writeThrough}})
		if err == nil {
			made[i] = &found{n, rec}
		}
		return err
	}, func() {
		for _, f := range made {
			if f == nil {
				continue
			}
			if err := f.n.deleteVolume(context.Background(), f.v.Name); err != nil {
				c.log.WithError(err).WithFields(log.Fields{"volume": mirrorID(r.vname), "storage_node": f.n.cfg.Name}).
					Warn("a member of a replicated clone whose create failed was not deleted: its CreateVolume's retry takes it")
			}
		}
	})
	if err != nil {
		return nil, err
	}
	c.log.WithFields(log.Fields{"volume": mirrorID(r.vname), "csi_name": r.GetName(), "clone_of": id, "placement": mv.place.String()}).Info("replicated volume cloned")
	return &csi.CreateVolumeResponse{Volume: c.mirrorCSIVolume(r.vname, mv.place, size, r.p)}, nil
}
