package csi

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/serverd"
	"github.com/rnbd/rnbd/pkg/mirror"
	"github.com/rnbd/rnbd/test/kit"
)

// members are the volumes of name on the rig's storage nodes that run,
// by node.
func (r *rig) members(name string) map[string]api.VolumeRecord {
	r.t.Helper()
	out := map[string]api.VolumeRecord{}
	for node, c := range r.admin {
		if r.procs[node].cmd == nil {
			continue
		}
		v, err := api.NewServer(c).Volume(context.Background(), name)
		if isNotFound(err) {
			continue
		}
		if err != nil {
			r.t.Fatalf("volume %s on %s: %v", name, node, err)
		}
		out[node] = *v
	}
	return out
}

// byPart are members by their csi.member.
func byPart(ms map[string]api.VolumeRecord) map[string]string {
	out := map[string]string{}
	for node, v := range ms {
		out[v.Labels[labelMember]] = node
	}
	return out
}

// TestControllerReplicated: a replicated volume's legs go to storage
// nodes of distinct spreadBy values, its witness to another node; a
// retry answers the same volume and finishes a create that stopped part
// way; publish grants the worker on every member's node and gives the
// node every member; list shows it once; what is not built yet for it
// says so; unpublish revokes everywhere; delete waits for a member's
// node that does not answer, then removes every member. The reconciler
// never takes members for copies of one name.
func TestControllerReplicated(t *testing.T) {
	const zone = "topology.kubernetes.io/zone"
	z := func(v string) map[string]string { return map[string]string{zone: v} }
	r := newRigWith(t, rigOptions{nodes: 4, labels: []map[string]string{z("a"), z("a"), z("b"), z("b")}})
	ctx := context.Background()
	zoneOf := map[string]string{"node-a": "a", "node-b": "a", "node-c": "b", "node-d": "b"}
	params := map[string]string{"replicas": "2", "spreadBy": zone}
	const size = 64 << 20

	v := r.mustCreate("pvc-r2", size, params, nil)
	if v.GetVolumeId() != "mirror:pvc-r2" || v.GetCapacityBytes() != size || v.GetVolumeContext()[VCReplicas] != "2" {
		t.Fatalf("replicated volume %v", v)
	}
	ms := r.members("pvc-r2")
	parts := byPart(ms)
	if len(ms) != 3 || parts["leg0"] == "" || parts["leg1"] == "" || parts["witness"] == "" {
		t.Fatalf("members %v: want two legs and a witness, each on a node of its own", parts)
	}
	if zoneOf[parts["leg0"]] == zoneOf[parts["leg1"]] {
		t.Fatalf("legs on %s and %s: one zone", parts["leg0"], parts["leg1"])
	}
	place := "leg0=" + parts["leg0"] + ",leg1=" + parts["leg1"] + ",witness=" + parts["witness"]
	for node, m := range ms {
		want := int64(size + mirror.DataOff)
		if m.Labels[labelMember] == "witness" {
			want = witnessSize
		}
		if m.Size == nil || *m.Size != want || m.Labels[labelMembers] != place || m.Labels[labelName] != "pvc-r2" {
			t.Errorf("member on %s: size %v labels %v, want %d bytes and placement %s", node, m.Size, m.Labels, want, place)
		}
	}
	if len(v.GetAccessibleTopology()) != 0 {
		t.Errorf("legs in two zones, accessible from %v: want anywhere", v.GetAccessibleTopology())
	}

	// A retry: the same; another size or replicas 1: AlreadyExists.
	if again := r.mustCreate("pvc-r2", size, params, nil); again.GetVolumeId() != v.GetVolumeId() || len(r.members("pvc-r2")) != 3 {
		t.Fatalf("retry: %v, members %v", again, byPart(r.members("pvc-r2")))
	}
	_, err := r.create("pvc-r2", 2*size, params, nil)
	wantCode(t, "the name with another size", err, codes.AlreadyExists)
	_, err = r.create("pvc-r2", size, nil, nil)
	wantCode(t, "the name as a volume of one node", err, codes.AlreadyExists)
	// A create that stopped part way (leg 1 never made): the retry
	// makes it where the placement says.
	if _, err := api.NewServer(r.admin[parts["leg1"]]).DeleteVolume(ctx, "pvc-r2", false); err != nil {
		t.Fatal(err)
	}
	r.mustCreate("pvc-r2", size, params, nil)
	if got := byPart(r.members("pvc-r2")); got["leg1"] != parts["leg1"] || len(got) != 3 {
		t.Fatalf("after a retry of a create that stopped part way: %v, want %v", got, parts)
	}

	// What a replicated volume is not yet, or never: said.
	_, err = r.create("pvc-r2-paths", size, map[string]string{"replicas": "2", "paths": "ip:127.0.0.1"}, nil)
	wantCode(t, "replicas with paths", err, codes.InvalidArgument)
	_, err = r.create("pvc-r2-spread", size, map[string]string{"spreadBy": zone}, nil)
	wantCode(t, "spreadBy without replicas", err, codes.InvalidArgument)
	_, err = r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-r2-rwx", Parameters: params, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)}})
	wantCode(t, "a replicated volume for several writers", err, codes.InvalidArgument)
	_, err = r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-clone-of-r2", CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{rwo}, VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
			Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: v.GetVolumeId()}}}})
	wantCode(t, "a clone of a replicated volume", err, codes.InvalidArgument)
	// Expand: every leg grown by what is asked, the witness not; the
	// node's expansion required (the mirror grows there), raw block
	// too; the same size again is success, a smaller one OutOfRange.
	expand := func(id string, n int64) (*csi.ControllerExpandVolumeResponse, error) {
		return r.cc.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: n},
			VolumeCapability: blockCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)})
	}
	for range 2 {
		ex, err := expand(v.GetVolumeId(), 2*size)
		if err != nil || ex.GetCapacityBytes() != 2*size || !ex.GetNodeExpansionRequired() {
			t.Fatalf("expand: %v, %v", ex, err)
		}
	}
	for node, m := range r.members("pvc-r2") {
		want := int64(2*size + mirror.DataOff)
		if m.Labels[labelMember] == "witness" {
			want = witnessSize
		}
		if m.Size == nil || *m.Size != want {
			t.Errorf("member %s on %s expanded: %v bytes, want %d", m.Labels[labelMember], node, m.Size, want)
		}
	}
	_, err = expand(v.GetVolumeId(), size)
	wantCode(t, "shrinking a replicated volume", err, codes.OutOfRange)
	_, err = r.create("pvc-r3-zones", size, map[string]string{"replicas": "3", "spreadBy": zone}, nil)
	wantCode(t, "three legs over two zones", err, codes.ResourceExhausted)

	// Publish: the worker granted on every member, every member told.
	pub, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-1",
		VolumeCapability: rwo, VolumeContext: v.GetVolumeContext()})
	if err != nil {
		t.Fatal(err)
	}
	pc := pub.GetPublishContext()
	var legs []legContext
	var wit legContext
	if err := json.Unmarshal([]byte(pc[PCLegs]), &legs); err != nil || json.Unmarshal([]byte(pc[PCWitness]), &wit) != nil || pc[PCMirror] != "pvc-r2" ||
		len(legs) != 2 || legs[0].StorageNode != parts["leg0"] || legs[1].StorageNode != parts["leg1"] || wit.StorageNode != parts["witness"] ||
		legs[0].Export != "pvc-r2" || len(legs[0].Paths) == 0 || legs[0].Port == 0 {
		t.Fatalf("publish context %v (%v)", pc, err)
	}
	for part, node := range parts {
		if g := r.grants(node + "/pvc-r2"); g["host-1"] != "rw" || len(g) != 1 {
			t.Errorf("grants of %s on %s: %v, want host-1 rw", part, node, g)
		}
	}
	_, err = r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-2", VolumeCapability: rwo})
	wantCode(t, "a second node", err, codes.FailedPrecondition)
	_, err = r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-1", VolumeCapability: rwo, Readonly: true})
	wantCode(t, "read-only", err, codes.InvalidArgument)

	// Listed once, with its worker and the size its smallest leg
	// holds (the leg on the node listed last grown alone, as by an
	// expansion that stopped part way); its members are not volumes of
	// their own.
	if _, err := api.NewServer(r.admin[max(parts["leg0"], parts["leg1"])]).ResizeVolume(ctx, "pvc-r2", strconv.Itoa(3*size+mirror.DataOff)); err != nil {
		t.Fatal(err)
	}
	list, err := r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range list.GetEntries() {
		if strings.HasSuffix(e.GetVolume().GetVolumeId(), "/pvc-r2") {
			t.Errorf("a member listed as a volume: %v", e)
		}
		if e.GetVolume().GetVolumeId() == v.GetVolumeId() {
			n++
			if e.GetVolume().GetCapacityBytes() != 2*size || strings.Join(e.GetStatus().GetPublishedNodeIds(), ",") != "host-1" {
				t.Errorf("list entry %v", e)
			}
		}
	}
	if n != 1 {
		t.Errorf("listed %d times", n)
	}
	if got := r.d.ctrl.reconcile(ctx); got != 0 || len(r.members("pvc-r2")) != 3 {
		t.Fatalf("the reconciler reclaimed %d, members left %v", got, byPart(r.members("pvc-r2")))
	}

	// Unpublish: revoked on every member.
	if _, err := r.cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-1"}); err != nil {
		t.Fatal(err)
	}
	for _, node := range parts {
		if g := r.grants(node + "/pvc-r2"); len(g) != 0 {
			t.Errorf("grants on %s after unpublish: %v", node, g)
		}
	}

	// Published while a member's node does not answer: the others are
	// granted, and that one by the reconciler once it answers (its leg
	// can rejoin); unpublished while it does not: revoked there once it
	// answers.
	wnode := parts["witness"]
	down := func() { r.procs[wnode].stop() }
	upNode := func(node string) {
		r.procs[node].start()
		kit.WaitFor(t, 30*time.Second, node+" answering again", func() bool {
			_, err := r.d.ctrl.node(node).pools(ctx)
			return err == nil
		})
	}
	up := func() { upNode(wnode) }
	down()
	if _, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-2", VolumeCapability: rwo}); err != nil {
		t.Fatalf("publishing with the witness's node down: %v", err)
	}
	// The reconciler runs when a node answers again.
	up()
	kit.WaitFor(t, 30*time.Second, "the witness granted once its node is back", func() bool {
		g := r.grants(wnode + "/pvc-r2")
		return g["host-2"] == "rw" && len(g) == 1
	})
	down()
	if _, err := r.cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-2"}); err != nil {
		t.Fatalf("unpublishing with the witness's node down: %v", err)
	}
	up()
	kit.WaitFor(t, 30*time.Second, "the witness revoked once its node is back", func() bool { return len(r.grants(wnode+"/pvc-r2")) == 0 })
	for _, node := range parts {
		if g := r.grants(node + "/pvc-r2"); len(g) != 0 {
			t.Errorf("grants on %s after an unpublish while it was down: %v", node, g)
		}
	}
	if got := r.d.ctrl.reconcile(ctx); got != 0 {
		t.Errorf("the reconciler mended %d members of a volume whose members agree", got)
	}

	// Three legs without spreadBy: three nodes, no witness.
	v3 := r.mustCreate("pvc-r3", size, map[string]string{"replicas": "3"}, nil)
	if p := byPart(r.members("pvc-r3")); len(p) != 3 || p["leg2"] == "" || p["witness"] != "" {
		t.Errorf("three legs: %v", p)
	}

	// A member's node down: no replicated volume is made (it could
	// hold an earlier try's member), and none of this one is deleted
	// until it answers.
	down()
	_, err = r.create("pvc-r2-new", size, params, nil)
	wantCode(t, "a create while a node does not answer", err, codes.Unavailable)
	if ex, err := expand(v.GetVolumeId(), 3*size); err != nil || ex.GetCapacityBytes() != 3*size {
		t.Fatalf("expand with the witness's node down: %v, %v", ex, err)
	}
	if leg := byPart(r.members("pvc-r3"))["leg0"]; leg != wnode {
		r.procs[leg].stop()
		_, err = expand(v3.GetVolumeId(), 2*size)
		wantCode(t, "an expand while a leg's node does not answer", err, codes.Unavailable)
		upNode(leg)
	}
	// The reconciler may hold the volume a moment (Aborted, which a CO
	// retries): retried as a CO does, the delete waits for the node.
	kit.WaitFor(t, 30*time.Second, "DeleteVolume "+v.GetVolumeId()+" not Aborted", func() bool {
		_, err = r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()})
		return status.Code(err) != codes.Aborted
	})
	wantCode(t, "a delete while a member's node does not answer", err, codes.Unavailable)
	if len(r.members("pvc-r2")) != 2 {
		t.Fatalf("members deleted while one's node was down: %v", byPart(r.members("pvc-r2")))
	}
	up()
	for _, id := range []string{v.GetVolumeId(), v3.GetVolumeId()} {
		for i := range 2 {
			// The reconciler, woken by the nodes that came back, may
			// hold the volume a moment: Aborted, which a CO retries.
			var err error
			kit.WaitFor(t, 30*time.Second, "DeleteVolume "+id, func() bool {
				_, err = r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
				return status.Code(err) != codes.Aborted
			})
			if err != nil {
				t.Fatalf("DeleteVolume %s (%s time): %v", id, strconv.Itoa(i+1), err)
			}
		}
	}
	if ms := r.members("pvc-r2"); len(ms) != 0 {
		t.Fatalf("members left after delete: %v", byPart(ms))
	}
	if ms := r.members("pvc-r3"); len(ms) != 0 {
		t.Fatalf("members left after delete: %v", byPart(ms))
	}
	_, err = r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-1", VolumeCapability: rwo})
	wantCode(t, "publishing a deleted replicated volume", err, codes.NotFound)
}

// TestReplicatedCreateCrash: a storage node that dies in a replicated
// volume's create (SIGKILL after its member is made, before it
// answers): the create fails and removes what it made elsewhere; its
// retry is Unavailable while that node does not answer (it could hold a
// member: it does); once the node is back (its restart finishes the
// member), the retry makes the others where that member's placement
// says, and every member has the same placement.
func TestReplicatedCreateCrash(t *testing.T) {
	r := newRigWith(t, rigOptions{nodes: 3, env: map[string][]string{"node-c": {serverd.CrashEnv + "=volume-create-made"}},
		edit: func(c *Config) { c.Controller.StorageTimeout = conf.Duration{Duration: 2 * time.Second} }})
	ctx := context.Background()
	params := map[string]string{"replicas": "3"}
	_, err := r.create("pvc-crash", 32<<20, params, nil)
	if err == nil {
		t.Fatal("CreateVolume with a node that dies in it: success")
	}
	c := r.procs["node-c"]
	c.reap()
	if ms := r.members("pvc-crash"); len(ms) != 0 {
		t.Fatalf("members left on the nodes that answered after a failed create: %v", byPart(ms))
	}
	_, err = r.create("pvc-crash", 32<<20, params, nil)
	wantCode(t, "the retry while node-c does not answer", err, codes.Unavailable)
	c.env = nil
	c.start()
	kit.WaitFor(t, 30*time.Second, "node-c answering again", func() bool {
		_, err := r.d.ctrl.node("node-c").pools(ctx)
		return err == nil
	})
	made, err := api.NewServer(r.admin["node-c"]).Volume(ctx, "pvc-crash")
	if err != nil || made.Labels[labelMembers] == "" {
		t.Fatalf("node-c's member after its restart: %+v %v", made, err)
	}
	v := r.mustCreate("pvc-crash", 32<<20, params, nil)
	ms := r.members("pvc-crash")
	if len(ms) != 3 {
		t.Fatalf("members after the retry: %v", byPart(ms))
	}
	for node, m := range ms {
		if m.Labels[labelMembers] != made.Labels[labelMembers] || m.State != api.VolumeServed {
			t.Errorf("member on %s: placement %q, state %s; want %q, served", node, m.Labels[labelMembers], m.State, made.Labels[labelMembers])
		}
	}
	if _, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
}

// TestReplicatedLegReplaced: a published replicated volume whose leg's
// storage node is gone for mirror_replace_after gets the leg anew on a
// spare the worker was given at publish, in the dead leg's zone (the
// other leg's is spreadBy's), granted to the worker; every member says
// the new placement, the old member is retired. A delete waits for the
// retired member's node, then removes it with the others.
func TestReplicatedLegReplaced(t *testing.T) {
	const zone = "topology.kubernetes.io/zone"
	z := func(v string) map[string]string { return map[string]string{zone: v} }
	r := newRigWith(t, rigOptions{nodes: 5, labels: []map[string]string{z("a"), z("a"), z("b"), z("b"), z("c")},
		edit: func(c *Config) {
			c.Controller.StorageTimeout = conf.Duration{Duration: 2 * time.Second}
			c.Controller.MirrorReplaceAfter = conf.Duration{Duration: time.Second}
		}})
	ctx := context.Background()
	zoneOf := map[string]string{"node-a": "a", "node-b": "a", "node-c": "b", "node-d": "b", "node-e": "c"}
	const size = 32 << 20
	v := r.mustCreate("pvc-rep", size, map[string]string{"replicas": "2", "spreadBy": zone}, nil)
	parts := byPart(r.members("pvc-rep"))
	pub, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-1", VolumeCapability: rwo})
	if err != nil {
		t.Fatal(err)
	}
	var spares []legContext
	if err := json.Unmarshal([]byte(pub.GetPublishContext()[PCSpares]), &spares); err != nil || len(spares) != 2 {
		t.Fatalf("publish context spares %q (%v): want the two nodes with no member", pub.GetPublishContext()[PCSpares], err)
	}
	var spareNames []string
	for _, s := range spares {
		spareNames = append(spareNames, s.StorageNode)
		if slices.Contains(slices.Collect(maps.Values(parts)), s.StorageNode) || s.Export != "pvc-rep" || len(s.Paths) == 0 {
			t.Fatalf("spare %+v: a member's node, or without its export or paths (members %v)", s, parts)
		}
	}
	// Replaced only once gone for mirror_replace_after: a reconcile now
	// (every node answers) replaces nothing.
	if got := r.d.ctrl.reconcile(ctx); got != 0 {
		t.Fatalf("the reconciler changed %d with every node up", got)
	}

	// leg1's node: the first spare (in leg0's zone) is not for it.
	dead := parts["leg1"]
	r.procs[dead].stop()
	// No snapshot while a member's node does not answer: its leg could
	// be the only one in sync (docs/replication.md, "Snapshots and
	// restores"); the CO retries.
	snapReq := &csi.CreateSnapshotRequest{Name: "snap-degraded", SourceVolumeId: v.GetVolumeId()}
	_, err = r.cc.CreateSnapshot(ctx, snapReq)
	wantCode(t, "a snapshot while leg1's node does not answer", err, codes.Unavailable)
	var ms map[string]api.VolumeRecord
	kit.WaitFor(t, time.Minute, "leg1 made anew", func() bool {
		r.d.ctrl.reconcile(ctx)
		ms = r.members("pvc-rep")
		return byPart(ms)["leg1"] != "" && byPart(ms)["leg1"] != dead
	})
	now := byPart(ms)
	to := now["leg1"]
	if !slices.Contains(spareNames, to) || zoneOf[to] != zoneOf[dead] || now["leg0"] != parts["leg0"] || now["witness"] != parts["witness"] {
		t.Fatalf("leg1 of %v made on %s (was %s, zone %s), spares %v: want a spare in zone %s, the others where they were", parts, to, dead, zoneOf[dead], spareNames, zoneOf[dead])
	}
	place := "leg0=" + parts["leg0"] + ",leg1=" + to + ",witness=" + parts["witness"]
	for node, m := range ms {
		if m.Labels[labelMembers] != place || m.Labels[labelRetired] != dead {
			t.Errorf("member on %s: placement %q retired %q, want %q and %s", node, m.Labels[labelMembers], m.Labels[labelRetired], place, dead)
		}
	}
	if m := ms[to]; m.Size == nil || *m.Size != size+mirror.DataOff {
		t.Errorf("the new leg's size %v, want %d", m.Size, size+mirror.DataOff)
	}
	if g := r.grants(to + "/pvc-rep"); g["host-1"] != "rw" || len(g) != 1 {
		t.Errorf("the new leg's grants %v: want the worker's, rw", g)
	}
	if got := r.d.ctrl.reconcile(ctx); got != 0 {
		t.Errorf("a second reconcile changed %d: the leg is made once", got)
	}
	// Made anew, the old node still down: still none, for that node may
	// hold a part of an earlier try of the snapshot (a retired member's
	// node must answer, as for a delete).
	_, err = r.cc.CreateSnapshot(ctx, snapReq)
	wantCode(t, "a snapshot while the retired member's node does not answer", err, codes.Unavailable)
	if err == nil || !strings.Contains(err.Error(), dead) {
		t.Errorf("the refusal %v does not name %s", err, dead)
	}
	// Published again (the kubelet's retry, or the pod's next node): the
	// new placement, the retired node no spare.
	pub, err = r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-1", VolumeCapability: rwo})
	if err != nil {
		t.Fatal(err)
	}
	var legs []legContext
	json.Unmarshal([]byte(pub.GetPublishContext()[PCLegs]), &legs)
	if len(legs) != 2 || legs[1].StorageNode != to || strings.Contains(pub.GetPublishContext()[PCSpares], dead) {
		t.Fatalf("publish context after the replacement: %v", pub.GetPublishContext())
	}

	// Deleted: not while the retired member's node does not answer,
	// then every member, the retired one too.
	_, err = r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()})
	wantCode(t, "a delete while the retired member's node does not answer", err, codes.Unavailable)
	r.procs[dead].start()
	kit.WaitFor(t, 30*time.Second, dead+" answering again", func() bool {
		_, err := r.d.ctrl.node(dead).pools(ctx)
		return err == nil
	})
	if m, err := api.NewServer(r.admin[dead]).Volume(ctx, "pvc-rep"); err != nil || m.Labels[labelMember] != "leg1" {
		t.Fatalf("the retired member on %s once back: %+v %v", dead, m, err)
	}
	// Listed once, over its placement; unpublished: revoked on every
	// member, the retired one too.
	list, err := r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 1 || list.GetEntries()[0].GetVolume().GetCapacityBytes() != size {
		t.Fatalf("ListVolumes %v %v: want the volume once, %d bytes", list, err, size)
	}
	// (Aborted while the reconciler, woken by the node's return, has
	// the volume: the CO retries.)
	kit.WaitFor(t, 30*time.Second, "the unpublish", func() bool {
		_, err := r.cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-1"})
		if err != nil && status.Code(err) != codes.Aborted {
			t.Fatal(err)
		}
		return err == nil
	})
	for _, node := range []string{parts["leg0"], to, parts["witness"], dead} {
		if g := r.grants(node + "/pvc-rep"); len(g) != 0 {
			t.Errorf("grants on %s after unpublish: %v", node, g)
		}
	}
	if list, err = r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{}); err != nil || len(list.GetEntries()[0].GetStatus().GetPublishedNodeIds()) != 0 {
		t.Fatalf("ListVolumes after unpublish %v %v", list, err)
	}
	kit.WaitFor(t, 30*time.Second, "the delete", func() bool {
		_, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()})
		if err != nil && status.Code(err) != codes.Aborted {
			t.Fatal(err)
		}
		return err == nil
	})
	if ms := r.members("pvc-rep"); len(ms) != 0 {
		t.Fatalf("members left after delete: %v", byPart(ms))
	}
}
