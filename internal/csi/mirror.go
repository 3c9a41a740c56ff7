// Replicated volumes (a StorageClass's replicas 2 or 3): one volume of
// the pod's over legs on as many storage nodes, a mirror of the worker's
// rnbd-client (docs/replication.md).
//
// The controller makes each leg a volume of the same name on a storage
// node of its own — nodes that differ in the StorageClass's spreadBy
// label where it names one — each leg 8 MiB larger than the volume
// asked (the mirror's metadata), and for two legs a witness of 1 MiB on
// a third node where there is one (so that losing one leg's node leaves
// a quorum). Every member carries the placement (csi.members,
// "leg0=node-a,leg1=node-b,witness=node-c") and its own part in it
// (csi.member): any member that answers says where the others are. The
// volume's id names no node, since the nodes are not the volume's for
// good: "mirror:<name>".
//
// A replicated volume is made while every storage node answers the
// name's lookup: a node that does not could hold a member an earlier
// try made, which a new placement would leave behind (a volume of one
// node is made all the same, reclaim.go). A create that stopped part
// way is finished by its retry on the nodes its placement names.
//
// ControllerPublishVolume grants the worker on every member's node that
// answers and gives the node service every member (publish context
// mirror, legs, witness); NodeStageVolume maps the mirror with
// create_if_new, so that its first stage makes the mirror's metadata
// and every later one assembles it. A member whose node does not answer
// is left out of the grants: the mirror assembles without it where its
// quorum allows, and the reconciler grants it when its node answers
// again (the members that answered say to whom: csi.published), so that
// the leg can rejoin.

package csi

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/pool"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/mirror"
)

const (
	// mirrorPrefix begins a replicated volume's id: a storage node's
	// name cannot have a colon, so it is never a volume of one node's.
	mirrorPrefix = "mirror:"
	// labelMember is a member's part: leg0, leg1, leg2 or witness;
	// labelMembers the placement of every member.
	labelMember  = "csi.member"
	labelMembers = "csi.members"
	// labelPublished is the worker a replicated volume is published to
	// ("" none), labelPublishedAt when the controller said so: the
	// member that says it last is right, and the reconciler makes the
	// grants of every other agree (a member whose node did not answer
	// at publish or unpublish).
	labelPublished   = "csi.published"
	labelPublishedAt = "csi.published.at"
	// witnessSize is a witness's volume: its superblock's slots.
	witnessSize = 1 << 20
	memberWit   = "witness"
)

// Publish context keys of a replicated volume.
const (
	PCMirror  = "mirror"  // the mirror's name: its volumes' name on the storage nodes
	PCLegs    = "legs"    // JSON: [{"storageNode","export","paths","port"}] by leg index
	PCWitness = "witness" // JSON: one of them, or absent
	PCAdopt   = "adopt"   // the mirror a restored volume's members are copies of (api.Mapping.Adopt), or absent
	PCSize    = "size"    // bytes of data the mirror has at least: its smallest leg's less the metadata (api.Mapping.Size)
)

// VCReplicas is the volume context's key of a replicated volume's legs.
const VCReplicas = "replicas"

func mirrorID(vname string) string { return mirrorPrefix + vname }

// parseMirrorID reads a replicated volume's id.
func parseMirrorID(id string) (vname string, ok bool) {
	vname, ok = strings.CutPrefix(id, mirrorPrefix)
	if !ok || pool.CheckName(vname) != nil || strings.Trim(vname, ".") == "" {
		return "", false
	}
	return vname, true
}

func legMember(i int) string { return "leg" + strconv.Itoa(i) }

// placement is where a replicated volume's members are: the legs' storage
// nodes by index, and the witness's ("": none).
type placement struct {
	legs    []string
	witness string
}

func (p placement) String() string {
	var parts []string
	for i, n := range p.legs {
		parts = append(parts, legMember(i)+"="+n)
	}
	if p.witness != "" {
		parts = append(parts, memberWit+"="+p.witness)
	}
	return strings.Join(parts, ",")
}

// member is one member of a placement.
type member struct{ part, node string }

func (p placement) members() []member {
	var out []member
	for i, n := range p.legs {
		out = append(out, member{legMember(i), n})
	}
	if p.witness != "" {
		out = append(out, member{memberWit, p.witness})
	}
	return out
}

func parsePlacement(s string) (placement, error) {
	var p placement
	for part := range strings.SplitSeq(s, ",") {
		k, v, ok := strings.Cut(part, "=")
		switch {
		case !ok || v == "":
			return p, fmt.Errorf("placement %q: %q is not MEMBER=NODE", s, part)
		case k == memberWit && p.witness == "":
			p.witness = v
		case k == legMember(len(p.legs)) && p.witness == "":
			p.legs = append(p.legs, v)
		default:
			return p, fmt.Errorf("placement %q: %q out of place", s, k)
		}
	}
	if len(p.legs) < 2 || len(p.legs) > mirror.MaxLegs {
		return p, fmt.Errorf("placement %q: %d legs", s, len(p.legs))
	}
	return p, nil
}

// mirrorVolume is what the storage nodes that answer hold of a
// replicated volume.
type mirrorVolume struct {
	vname string
	place placement
	// found are its members found, by part; silent the nodes of its
	// placement that did not answer.
	found  map[string]found
	silent []string
	// strays are volumes of its name and a member's labels that its
	// placement does not name (retired by a replacement, mirror_replace.go);
	// retired the nodes its placement says hold such.
	strays  []found
	retired []string
}

// id is its CSI id.
func (mv *mirrorVolume) id() string { return mirrorID(mv.vname) }

// findMirror asks every storage node at once for the members of the
// replicated volume vname. None found where every node answered is
// NotFound; none found where some did not, Unavailable.
func (c *controller) findMirror(ctx context.Context, vname string) (*mirrorVolume, error) {
	results := each(ctx, c.nodes, func(ctx context.Context, n *storageNode) (*api.VolumeRecord, error) { return n.volume(ctx, vname) })
	mv := &mirrorVolume{vname: vname, found: map[string]found{}}
	var silent []string
	var newest *api.VolumeRecord
	for _, r := range results {
		switch {
		case isNotFound(r.err):
		case r.err != nil:
			silent = append(silent, r.n.cfg.Name)
		case r.v.Labels[labelMember] != "" && r.v.Labels[labelName] != "":
			if newest == nil || madeAt(*r.v).After(madeAt(*newest)) {
				newest = r.v
			}
		}
	}
	if newest == nil {
		if len(silent) > 0 {
			return nil, status.Errorf(codes.Unavailable, "volume %s: no member of it found, and %s did not answer", mirrorID(vname), strings.Join(silent, ", "))
		}
		return nil, status.Errorf(codes.NotFound, "no volume %s", mirrorID(vname))
	}
	p, err := parsePlacement(newest.Labels[labelMembers])
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: its %s label: %v", mirrorID(vname), labelMembers, err)
	}
	mv.place = p
	mv.retired = splitSet(newest.Labels[labelRetired])
	for _, r := range results {
		if r.err != nil || r.v.Labels[labelMember] == "" || r.v.Labels[labelName] == "" {
			continue
		}
		// A member that is not where the placement says is no member.
		if part := r.v.Labels[labelMember]; slices.Contains(p.members(), member{part, r.n.cfg.Name}) {
			mv.found[part] = found{r.n, *r.v}
		} else {
			mv.strays = append(mv.strays, found{r.n, *r.v})
		}
	}
	for _, m := range p.members() {
		if _, ok := mv.found[m.part]; !ok && (slices.Contains(silent, m.node) || c.node(m.node) == nil) {
			mv.silent = append(mv.silent, m.node)
		}
	}
	return mv, nil
}

// checkMirrorCreate refuses what a replicated volume cannot be yet.
func checkMirrorCreate(r createRequest) error {
	if src := r.GetVolumeContentSource(); src != nil {
		_, snap := parseMirrorID(src.GetSnapshot().GetSnapshotId())
		_, vol := parseMirrorID(src.GetVolume().GetVolumeId())
		if !snap && !vol {
			return status.Errorf(codes.InvalidArgument, "a replicated volume (replicas %d) from a volume or a snapshot of one storage node: "+
				"not implemented yet; a replicated volume is made from a replicated volume or its snapshot (mirror:…), or empty", r.p.replicas)
		}
	}
	for _, vc := range r.GetVolumeCapabilities() {
		if !singleNode(vc) {
			return status.Errorf(codes.InvalidArgument, "access mode %s for a replicated volume: its mirror has one writer, on one node at a time",
				vc.GetAccessMode().GetMode())
		}
	}
	return nil
}

// createMirror is CreateVolume of a replicated volume.
func (c *controller) createMirror(ctx context.Context, r createRequest) (*csi.CreateVolumeResponse, error) {
	if err := checkMirrorCreate(r); err != nil {
		return nil, err
	}
	fs, unchecked, err := c.lookup(ctx, r.vname, r.GetName())
	if err != nil {
		return nil, err
	}
	if len(unchecked) > 0 {
		return nil, status.Errorf(codes.Unavailable, "a replicated volume is made while every storage node answers: %s did not, and may hold a member "+
			"an earlier try made", strings.Join(unchecked, ", "))
	}
	if len(fs) > 0 {
		return c.existingMirror(ctx, r, fs)
	}
	var p placement
	labels := map[string]string{labelName: r.GetName(), labelParams: r.p.canonical(), labelMade: time.Now().UTC().Format(time.RFC3339Nano)}
	if svname, ok := parseMirrorID(r.GetVolumeContentSource().GetVolume().GetVolumeId()); ok {
		return c.cloneMirror(ctx, r, svname, labels)
	}
	if sname, ok := parseMirrorID(r.GetVolumeContentSource().GetSnapshot().GetSnapshotId()); ok {
		if p, err = c.restorePlacement(ctx, &r, sname, labels); err != nil {
			return nil, err
		}
	} else if p, err = c.place(ctx, r); err != nil {
		return nil, err
	}
	labels[labelMembers] = p.String()
	var made []found
	for _, m := range p.members() {
		n := c.node(m.node)
		rec, err := c.makeMember(ctx, r, n, m.part, labels)
		if err != nil {
			// Nothing of a volume the CO was never told of is kept.
			for _, f := range made {
				if derr := f.n.deleteVolume(context.Background(), f.v.Name); derr != nil {
					c.log.WithError(derr).WithFields(log.Fields{"volume": mirrorID(r.vname), "storage_node": f.n.cfg.Name}).
						Warn("a member of a replicated volume whose create failed was not deleted: its CreateVolume's retry takes it")
				}
			}
			if ctl.Classify(err) == ctl.CodeNoSpace {
				return nil, status.Errorf(codes.ResourceExhausted, "replicated volume %s: %s: %v", mirrorID(r.vname), n, err)
			}
			return nil, toStatus(err, fmt.Sprintf("making %s of volume %s on %s", m.part, mirrorID(r.vname), n))
		}
		made = append(made, found{n, rec})
	}
	c.log.WithFields(log.Fields{"volume": mirrorID(r.vname), "csi_name": r.GetName(), "size": r.size, "placement": p.String()}).Info("replicated volume created")
	return &csi.CreateVolumeResponse{Volume: c.mirrorCSIVolume(r.vname, p, r.size, r.p)}, nil
}

// makeMember makes (or finishes) member part of a replicated volume on n:
// empty, or restored from that member's snapshot (labelFromSnap).
func (c *controller) makeMember(ctx context.Context, r createRequest, n *storageNode, part string, labels map[string]string) (api.VolumeRecord, error) {
	size := r.size + mirror.DataOff
	if part == memberWit {
		size = witnessSize
	}
	l := maps.Clone(labels)
	l[labelMember] = part
	req := api.VolumeRequest{Name: r.vname, Pool: r.p.poolOn(n.cfg), Size: strconv.FormatInt(size, 10), Labels: l,
		Export: api.MapRequest{GrantsOnly: ptr(true), WriteThrough: r.p.writeThrough}}
	if s := labels[labelFromSnap]; s != "" {
		// In the snapshot's pool, of its size or the larger one asked.
		rec, err := n.snapshot(ctx, s)
		if err != nil {
			return api.VolumeRecord{}, fmt.Errorf("its snapshot %s: %w", s, err)
		}
		req.FromSnapshot, req.Size, req.Pool = s, memberSize(part, r.size, rec.Size), rec.Pool
	}
	return n.createVolume(ctx, req)
}

// existingMirror answers a retry of a replicated volume's create: the
// members found are what the request asks, and those its placement
// names that a try before did not make are made now.
func (c *controller) existingMirror(ctx context.Context, r createRequest, fs []found) (*csi.CreateVolumeResponse, error) {
	var labels map[string]string
	for _, f := range fs {
		switch {
		case f.v.Labels[labelMember] == "":
			return nil, status.Errorf(codes.AlreadyExists, "CSI name %q is volume %s on %s, a volume of one storage node: not replicated as asked",
				r.GetName(), f.v.Name, f.n)
		case f.v.Labels[labelParams] != r.p.canonical():
			return nil, status.Errorf(codes.AlreadyExists, "replicated volume %s (CSI name %q) exists with parameters %q (asked %q)",
				mirrorID(r.vname), r.GetName(), f.v.Labels[labelParams], r.p.canonical())
		case f.v.State == api.VolumeCreating || f.v.State == api.VolumeDeleting:
			return nil, status.Errorf(codes.Unavailable, "volume %s on %s is %s there: a change of it is under way; try again", f.v.Name, f.n, f.v.State)
		}
		if labels == nil || madeAt(f.v).After(madeAt(api.VolumeRecord{Labels: labels})) {
			labels = f.v.Labels
		}
	}
	p, err := parsePlacement(labels[labelMembers])
	if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: its %s label: %v", mirrorID(r.vname), labelMembers, err)
	}
	if labels[labelFromVol] != "" && len(fs) < len(p.members()) {
		// A clone that stopped part way: its members were made while
		// the source was held, the missing one cannot be now. Made
		// anew by the next try.
		for _, f := range fs {
			if err := f.n.deleteVolume(ctx, f.v.Name); err != nil {
				return nil, toStatus(err, fmt.Sprintf("deleting %s of the clone %s that stopped part way", f.v.Labels[labelMember], mirrorID(r.vname)))
			}
		}
		return nil, status.Errorf(codes.Unavailable, "clone %s had stopped part way: its members were deleted; try again", mirrorID(r.vname))
	}
	size := int64(-1)
	for _, m := range p.members() {
		i := slices.IndexFunc(fs, func(f found) bool { return f.n.cfg.Name == m.node && f.v.Labels[labelMember] == m.part })
		if i < 0 {
			n := c.node(m.node)
			if n == nil {
				return nil, status.Errorf(codes.FailedPrecondition, "replicated volume %s: its %s's storage node %s is not configured", mirrorID(r.vname), m.part, m.node)
			}
			base := maps.Clone(labels)
			delete(base, labelMember)
			rec, err := c.makeMember(ctx, r, n, m.part, base)
			if err != nil {
				return nil, toStatus(err, fmt.Sprintf("finishing %s of volume %s on %s", m.part, mirrorID(r.vname), n))
			}
			fs = append(fs, found{n, rec})
			i = len(fs) - 1
		} else if f := fs[i]; f.v.State != api.VolumeServed {
			rec, err := finish(ctx, f, r.p.writeThrough)
			if err != nil {
				return nil, toStatus(err, fmt.Sprintf("finishing %s of volume %s on %s", m.part, mirrorID(r.vname), f.n))
			}
			fs[i].v = rec
		}
		if f := fs[i]; m.part != memberWit && f.v.Size != nil {
			size = *f.v.Size - mirror.DataOff
		}
	}
	if !fits(size, r.GetCapacityRange()) {
		return nil, status.Errorf(codes.AlreadyExists, "replicated volume %s (CSI name %q) has %d bytes, outside the capacity range asked", mirrorID(r.vname), r.GetName(), size)
	}
	return &csi.CreateVolumeResponse{Volume: c.mirrorCSIVolume(r.vname, p, size, r.p)}, nil
}

// place chooses a replicated volume's storage nodes: the best that have
// room for a leg (candidates' order), each on another node and, with
// spreadBy, of another value of that label; for two legs a witness on a
// third node where one has room (of another spreadBy value where one
// has).
func (c *controller) place(ctx context.Context, r createRequest) (placement, error) {
	legSize := r.size + mirror.DataOff
	cands, err := c.candidates(ctx, r.p, r.GetAccessibilityRequirements(), nil, legSize, nil)
	if err != nil {
		return placement{}, err
	}
	var p placement
	values := map[string]bool{}
	var why []string
	for _, cd := range cands {
		if len(p.legs) == r.p.replicas {
			break
		}
		if k := r.p.spreadBy; k != "" {
			v, ok := cd.node.cfg.Labels[k]
			switch {
			case !ok:
				why = append(why, fmt.Sprintf("%s has no label %s", cd.node.cfg.Name, k))
				continue
			case values[v]:
				why = append(why, fmt.Sprintf("%s is in %s %s with a leg already", cd.node.cfg.Name, k, v))
				continue
			}
			values[v] = true
		}
		p.legs = append(p.legs, cd.node.cfg.Name)
	}
	if len(p.legs) < r.p.replicas {
		return p, status.Errorf(codes.ResourceExhausted, "replicas %d needs as many storage nodes with room for %d bytes (the volume and 8 MiB of the mirror's metadata)%s: "+
			"found %d (%s)%s", r.p.replicas, legSize, spreadWords(r.p.spreadBy), len(p.legs), strings.Join(p.legs, ", "), whyWords(why))
	}
	if r.p.replicas == 2 {
		ws, err := c.candidates(ctx, r.p, r.GetAccessibilityRequirements(), nil, witnessSize, nil)
		if err == nil {
			best := ""
			for _, w := range ws {
				name := w.node.cfg.Name
				if slices.Contains(p.legs, name) {
					continue
				}
				if best == "" {
					best = name
				}
				if k := r.p.spreadBy; k == "" || !values[w.node.cfg.Labels[k]] {
					best = name
					break
				}
			}
			p.witness = best
		}
		if p.witness == "" {
			c.log.WithFields(log.Fields{"csi_name": r.GetName(), "legs": strings.Join(p.legs, ",")}).
				Warn("a replicated volume of two legs without a witness (no third storage node with room): losing either leg's node stops it until that node is back")
		}
	}
	return p, nil
}

func spreadWords(k string) string {
	if k == "" {
		return ""
	}
	return ", each of another " + k
}

func whyWords(why []string) string {
	if len(why) == 0 {
		return ""
	}
	return "; " + strings.Join(why, "; ")
}

// mirrorCSIVolume is the CSI volume of a replicated volume: accessible
// where every member's node is (the labels they share).
func (c *controller) mirrorCSIVolume(vname string, p placement, size int64, vp volumeParams) *csi.Volume {
	vc := map[string]string{VCReplicas: strconv.Itoa(len(p.legs)), "writeThrough": strconv.FormatBool(vp.writeThrough)}
	for k, v := range map[string]string{VCFsType: vp.fsType, "transport": vp.transport, "mpathPolicy": vp.mpathPolicy, PCFrontend: vp.frontend} {
		if v != "" {
			vc[k] = v
		}
	}
	return &csi.Volume{VolumeId: mirrorID(vname), CapacityBytes: size, VolumeContext: vc, AccessibleTopology: c.sharedTopology(p)}
}

// sharedTopology is the topology every member's storage node has: the
// labels they share (none: accessible everywhere).
func (c *controller) sharedTopology(p placement) []*csi.Topology {
	var shared map[string]string
	for _, m := range p.members() {
		n := c.node(m.node)
		if n == nil {
			continue
		}
		if shared == nil {
			shared = maps.Clone(n.cfg.Labels)
			continue
		}
		maps.DeleteFunc(shared, func(k, v string) bool { return n.cfg.Labels[k] != v })
	}
	if len(shared) == 0 {
		return nil
	}
	return []*csi.Topology{{Segments: shared}}
}

// deleteMirror is DeleteVolume of a replicated volume: every member, or
// none while a node of its placement does not answer (its member would
// be left behind with nothing to find it by).
func (c *controller) deleteMirror(ctx context.Context, id, vname string) (*csi.DeleteVolumeResponse, error) {
	unlock, err := c.locks.lockByVolumeID(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	mv, err := c.findMirror(ctx, vname)
	if status.Code(err) == codes.NotFound {
		return &csi.DeleteVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	var silent []string
	for _, s := range mv.silent {
		if c.node(s) != nil {
			silent = append(silent, s)
		}
	}
	// A retired member's node too: its member would be left behind.
	for _, s := range mv.retired {
		if n := c.node(s); n != nil && !slices.Contains(silent, s) && !slices.ContainsFunc(mv.strays, func(f found) bool { return f.n == n }) {
			if _, err := n.volume(ctx, vname); err != nil && !isNotFound(err) {
				silent = append(silent, s)
			}
		}
	}
	if len(silent) > 0 {
		return nil, status.Errorf(codes.Unavailable, "volume %s has a member on %s, which does not answer: deleted once it does (or once it is "+
			"taken out of the configuration)", id, strings.Join(silent, ", "))
	}
	for _, m := range mv.place.members() {
		f, ok := mv.found[m.part]
		if !ok {
			continue
		}
		if f.v.State == api.VolumeCreating {
			return nil, status.Errorf(codes.Unavailable, "volume %s: its %s is being made on %s; try again", id, m.part, f.n)
		}
		if err := f.n.deleteVolume(ctx, f.v.Name); err != nil && !isNotFound(err) {
			return nil, toStatus(err, fmt.Sprintf("deleting %s of volume %s on %s", m.part, id, f.n))
		}
	}
	for _, f := range mv.strays {
		if err := f.n.deleteVolume(ctx, f.v.Name); err != nil && !isNotFound(err) {
			return nil, toStatus(err, fmt.Sprintf("deleting a retired %s of volume %s on %s", f.v.Labels[labelMember], id, f.n))
		}
	}
	c.log.WithFields(log.Fields{"volume": id, "placement": mv.place.String()}).Info("replicated volume deleted")
	return &csi.DeleteVolumeResponse{}, nil
}

// mirrorEntries are the replicated volumes of the storage nodes'
// records, one entry each, by id.
func (c *controller) mirrorEntries(results []nodeResult[[]api.VolumeRecord]) map[string]*csi.ListVolumesResponse_Entry {
	// The placement each volume's newest member says: a retired member
	// (mirror_replace.go) is not listed.
	newest := map[string]api.VolumeRecord{}
	for _, r := range results {
		for _, v := range r.v {
			if v.Labels[labelMember] != "" && v.Labels[labelName] != "" && madeAt(v).After(madeAt(newest[v.Name])) {
				newest[v.Name] = v
			}
		}
	}
	out := map[string]*csi.ListVolumesResponse_Entry{}
	for _, r := range results {
		for _, v := range r.v {
			part := v.Labels[labelMember]
			if part == "" || v.Labels[labelName] == "" {
				continue
			}
			if p, err := parsePlacement(newest[v.Name].Labels[labelMembers]); err == nil && !slices.Contains(p.members(), member{part, r.n.cfg.Name}) {
				continue
			}
			id := mirrorID(v.Name)
			e := out[id]
			if e == nil {
				e = &csi.ListVolumesResponse_Entry{Volume: &csi.Volume{VolumeId: id}, Status: &csi.ListVolumesResponse_VolumeStatus{}}
				if p, err := parsePlacement(v.Labels[labelMembers]); err == nil {
					e.Volume.AccessibleTopology = c.sharedTopology(p)
				}
				out[id] = e
			}
			if part != memberWit && v.Size != nil {
				// The smallest leg's: what the mirror holds (one
				// expansion may have grown some legs only).
				if c := *v.Size - mirror.DataOff; e.Volume.CapacityBytes == 0 || c < e.Volume.CapacityBytes {
					e.Volume.CapacityBytes = c
				}
			}
			for _, g := range v.AllowIdentities.Identities() {
				if !slices.Contains(e.Status.PublishedNodeIds, g) {
					e.Status.PublishedNodeIds = append(e.Status.PublishedNodeIds, g)
				}
			}
			sort.Strings(e.Status.PublishedNodeIds)
		}
	}
	return out
}
