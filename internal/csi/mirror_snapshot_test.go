package csi

import (
	"context"
	"encoding/binary"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/mirror"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/kit"
)

// legWriter writes a counter to every leg of a replicated volume in
// turn, as the worker's mirror writes a block: leg 0, and once it
// answered, leg 1; the next only once both answered. So at any moment
// leg 0 holds the counter leg 1 holds, or the one after it — and so
// must any set of snapshots that is one point in time.
type legWriter struct {
	devs []*rnbd.CltDev
	bufs []*rtrs.Buffer
	n    uint64 // writes of both legs done
	err  error
}

// dialLegs opens volume vname on each leg's node as identity host-1 (the
// worker it is published to), through the node's TLS port.
func (r *rig) dialLegs(vname string, legNodes []string) *legWriter {
	r.t.Helper()
	if out, err := exec.Command("bash", "../../scripts/test-ca.sh", r.pki, "client", "host-1").CombinedOutput(); err != nil {
		r.t.Fatalf("test-ca.sh: %v\n%s", err, out)
	}
	tlsc := conf.TLS{Cert: filepath.Join(r.pki, "host-1.crt"), Key: filepath.Join(r.pki, "host-1.key"), CA: filepath.Join(r.pki, "ca.crt")}
	fab, err := tlsc.Fabric(nil, "", tcp.Options{})
	if err != nil {
		r.t.Fatal(err)
	}
	w := &legWriter{}
	for i, node := range legNodes {
		var sn StorageNode
		for _, n := range r.nodes {
			if n.Name == node {
				sn = n
			}
		}
		cfg := rtrs.DefaultCltConfig()
		cfg.SessName, cfg.Fabric, cfg.Log = fmt.Sprintf("snapw%d", i), fab, log.Discard()
		cfg.Paths = []rtrs.PathAddr{{Dst: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(sn.Port))}}
		s, err := rnbd.DialSession(context.Background(), cfg, 0)
		if err != nil {
			r.t.Fatalf("session to %s: %v", node, err)
		}
		r.t.Cleanup(func() { s.Close() })
		d, err := s.Map(context.Background(), vname, rnbd.AccessRW)
		if err != nil {
			r.t.Fatalf("open %s on %s: %v", vname, node, err)
		}
		buf, err := s.Session().AllocBuffer(4096)
		if err != nil {
			r.t.Fatal(err)
		}
		w.devs, w.bufs = append(w.devs, d), append(w.bufs, buf)
	}
	return w
}

// run writes until stop is closed.
func (w *legWriter) run(stop <-chan struct{}) {
	for k := uint64(1); ; k++ {
		select {
		case <-stop:
			return
		default:
		}
		for i, d := range w.devs {
			binary.LittleEndian.PutUint64(w.bufs[i].Bytes(), k)
			if err := d.Do(context.Background(), rnbd.OpWrite, 0, mirror.DataOff, 4096, w.bufs[i], 0); err != nil {
				w.err = fmt.Errorf("write %d to leg %d: %w", k, i, err)
				return
			}
		}
		w.n = k
	}
}

// wantMemberSizes checks the members of replicated volume vname: each
// leg size bytes of data and the metadata, the witness its 1 MiB.
func (r *rig) wantMemberSizes(t *testing.T, vname string, parts map[string]string, size int64) {
	t.Helper()
	for part, node := range parts {
		want := size + mirror.DataOff
		if part == memberWit {
			want = witnessSize
		}
		if m := r.members(vname)[node]; m.Size == nil || *m.Size != want {
			t.Errorf("%s's %s on %s: %v bytes, want %d", vname, part, node, m.Size, want)
		}
	}
}

// snapCounter is the counter in member snapshot sname on node.
func (r *rig) snapCounter(node, sname string) uint64 {
	r.t.Helper()
	f, err := os.Open(filepath.Join(r.pools[node], ".rnbd-snap", sname+".img"))
	if err != nil {
		r.t.Fatal(err)
	}
	defer f.Close()
	var b [8]byte
	if _, err := f.ReadAt(b[:], mirror.DataOff); err != nil {
		r.t.Fatal(err)
	}
	return binary.LittleEndian.Uint64(b[:])
}

// TestControllerReplicatedSnapshot: a replicated volume's snapshot is one
// of every member, each on its node, taken while the writes of all of
// them were held: under a writer that writes leg 0 then leg 1, every
// snapshot's leg 0 holds leg 1's counter or the next, never less nor
// more; so does every clone taken among them. The same name again
// answers the same snapshot; list shows it once (by id, by its volume,
// in the whole list), not its members; delete takes every member; a
// volume from a snapshot is made of clones of its members on their
// nodes, published with the mirror to adopt, and one larger than its
// snapshot (or a clone larger than its source) has its legs made that
// large, its publish context the size its mirror grows to; what does
// not fit (other replicas, a limit below the source, a volume of one
// node) is refused; a clone
// that stopped part way is made anew; a member's node that does not
// answer makes no snapshot.
func TestControllerReplicatedSnapshot(t *testing.T) {
	r := newRigWith(t, rigOptions{nodes: 3, reflinks: true})
	ctx := context.Background()
	const size = 16 << 20
	v := r.mustCreate("pvc-s", size, map[string]string{"replicas": "2"}, nil)
	parts := byPart(r.members("pvc-s"))
	if _, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.GetVolumeId(), NodeId: "host-1", VolumeCapability: rwo}); err != nil {
		t.Fatal(err)
	}
	w := r.dialLegs("pvc-s", []string{parts["leg0"], parts["leg1"]})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); w.run(stop) }()
	var snaps []*csi.Snapshot
	clone := func(name string, params map[string]string, required int64, src string) (*csi.Volume, error) {
		out, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, Parameters: params,
			CapacityRange: &csi.CapacityRange{RequiredBytes: required}, VolumeCapabilities: []*csi.VolumeCapability{rwo},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
				Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: src}}}})
		return out.GetVolume(), err
	}
	var clones []string
	for i := range 20 {
		if i%5 == 4 {
			// A clone, under the writer too: one point in time.
			name := fmt.Sprintf("pvc-clone-%d", i)
			if _, err := clone(name, map[string]string{"replicas": "2"}, 0, v.GetVolumeId()); err != nil {
				close(stop)
				wg.Wait()
				t.Fatalf("clone %d: %v", i, err)
			}
			clones = append(clones, name)
		}
		s, err := r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: fmt.Sprintf("snap-%d", i), SourceVolumeId: v.GetVolumeId()})
		if err != nil {
			close(stop)
			wg.Wait()
			t.Fatalf("snapshot %d: %v", i, err)
		}
		snaps = append(snaps, s.GetSnapshot())
		time.Sleep(5 * time.Millisecond) // writes between snapshots
	}
	close(stop)
	wg.Wait()
	if w.err != nil {
		t.Fatalf("the writer, whose writes the holds only delay: %v", w.err)
	}
	for i, s := range snaps {
		sname := fmt.Sprintf("snap-%d", i)
		if s.GetSnapshotId() != "mirror:"+sname || s.GetSourceVolumeId() != v.GetVolumeId() || s.GetSizeBytes() != size || !s.GetReadyToUse() {
			t.Errorf("snapshot %d: %v", i, s)
		}
		c0, c1 := r.snapCounter(parts["leg0"], sname), r.snapCounter(parts["leg1"], sname)
		if c0 != c1 && c0 != c1+1 {
			t.Errorf("snapshot %s: leg 0 holds write %d, leg 1 write %d: not one point in time", sname, c0, c1)
		}
		t.Logf("snapshot %s: leg 0 at write %d, leg 1 at %d", sname, c0, c1)
	}
	volCounter := func(node, name string) uint64 {
		b, err := os.ReadFile(filepath.Join(r.pools[node], name+".img"))
		if err != nil {
			t.Fatal(err)
		}
		return binary.LittleEndian.Uint64(b[mirror.DataOff:])
	}
	for _, name := range clones {
		c0, c1 := volCounter(parts["leg0"], name), volCounter(parts["leg1"], name)
		if c0 != c1 && c0 != c1+1 {
			t.Errorf("clone %s: leg 0 holds write %d, leg 1 write %d: not one point in time", name, c0, c1)
		}
		m := r.members(name)
		if got := byPart(m); !maps.Equal(got, parts) || m[parts["leg0"]].Labels[labelAdopt] != "pvc-s" || m[parts["leg0"]].Labels[labelFromVol] != "pvc-s" {
			t.Errorf("clone %s: members %v, labels %v", name, got, m[parts["leg0"]].Labels)
		}
	}
	if last := r.snapCounter(parts["leg1"], "snap-19"); last < 10 || w.n < last {
		t.Errorf("the writer wrote %d times, the last snapshot holds write %d: too few writes to prove anything", w.n, last)
	}
	// Each member's snapshot on its node, with its part.
	for part, node := range parts {
		rec, err := api.NewServer(r.admin[node]).Snapshot(ctx, "snap-0")
		if err != nil || rec.Volume != "pvc-s" || rec.Labels[labelMember] != part || rec.Labels[labelName] != "snap-0" {
			t.Errorf("snap-0's %s on %s: %v %v", part, node, rec, err)
		}
	}

	// The same again: the same snapshot, not another.
	again, err := r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-0", SourceVolumeId: v.GetVolumeId()})
	if err != nil || again.GetSnapshot().GetCreationTime().AsTime() != snaps[0].GetCreationTime().AsTime() {
		t.Fatalf("snap-0 again: %v, %v", again, err)
	}
	// A single node's volume may not take the name.
	one := r.mustCreate("pvc-one", size, nil, nil)
	_, err = r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-0", SourceVolumeId: one.GetVolumeId()})
	wantCode(t, "a replicated volume's snapshot name for another volume", err, codes.AlreadyExists)

	list := func(req *csi.ListSnapshotsRequest) []string {
		t.Helper()
		out, err := r.cc.ListSnapshots(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, e := range out.GetEntries() {
			ids = append(ids, e.GetSnapshot().GetSnapshotId()+"@"+e.GetSnapshot().GetSourceVolumeId())
		}
		slices.Sort(ids)
		return ids
	}
	all := []string{}
	for i := range snaps {
		all = append(all, fmt.Sprintf("mirror:snap-%d@mirror:pvc-s", i))
	}
	slices.Sort(all)
	if got := list(&csi.ListSnapshotsRequest{}); !slices.Equal(got, all) {
		t.Errorf("list: %v, want %v", got, all)
	}
	if got := list(&csi.ListSnapshotsRequest{SourceVolumeId: v.GetVolumeId()}); !slices.Equal(got, all) {
		t.Errorf("list of its volume: %v, want %v", got, all)
	}
	if got := list(&csi.ListSnapshotsRequest{SnapshotId: "mirror:snap-2"}); strings.Join(got, ",") != "mirror:snap-2@mirror:pvc-s" {
		t.Errorf("list by id: %v", got)
	}

	// Delete: every member.
	if _, err := r.cc.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "mirror:snap-2"}); err != nil {
		t.Fatal(err)
	}
	for _, node := range parts {
		if _, err := api.NewServer(r.admin[node]).Snapshot(ctx, "snap-2"); !isNotFound(err) {
			t.Errorf("snap-2 on %s after its delete: %v", node, err)
		}
	}
	if got := list(&csi.ListSnapshotsRequest{SnapshotId: "mirror:snap-2"}); len(got) != 0 {
		t.Errorf("list of a deleted snapshot: %v", got)
	}
	if _, err := r.cc.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: "mirror:snap-2"}); err != nil {
		t.Fatalf("delete again: %v", err)
	}

	// A volume from it: each member a clone of its snapshot, on its
	// node; published with the mirror its members are copies of.
	restore := func(name string, params map[string]string, required int64, snap string) (*csi.Volume, error) {
		out, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, Parameters: params,
			CapacityRange: &csi.CapacityRange{RequiredBytes: required}, VolumeCapabilities: []*csi.VolumeCapability{rwo},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap}}}})
		return out.GetVolume(), err
	}
	two := map[string]string{"replicas": "2"}
	rv, err := restore("pvc-from-s", two, 0, "mirror:snap-3")
	if err != nil {
		t.Fatal(err)
	}
	if rv.GetVolumeId() != "mirror:pvc-from-s" || rv.GetCapacityBytes() != size {
		t.Fatalf("restored: %v", rv)
	}
	if got := byPart(r.members("pvc-from-s")); !maps.Equal(got, parts) {
		t.Fatalf("restored members %v, want the snapshot's nodes %v", got, parts)
	}
	for part, node := range parts {
		m := r.members("pvc-from-s")[node]
		if m.Labels[labelAdopt] != "pvc-s" || m.Labels[labelFromSnap] != "snap-3" || m.Labels[labelMember] != part {
			t.Errorf("restored %s on %s: labels %v", part, node, m.Labels)
		}
		if part == memberWit {
			continue
		}
		b, err := os.ReadFile(filepath.Join(r.pools[node], "pvc-from-s.img"))
		if err != nil {
			t.Fatal(err)
		}
		if got := binary.LittleEndian.Uint64(b[mirror.DataOff:]); got != r.snapCounter(node, "snap-3") {
			t.Errorf("restored %s holds write %d, its snapshot %d", part, got, r.snapCounter(node, "snap-3"))
		}
	}
	if again, err := restore("pvc-from-s", two, 0, "mirror:snap-3"); err != nil || again.GetVolumeId() != rv.GetVolumeId() {
		t.Fatalf("the restore again: %v, %v", again, err)
	}
	pub, err := r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: rv.GetVolumeId(), NodeId: "host-2", VolumeCapability: rwo})
	if err != nil || pub.GetPublishContext()[PCAdopt] != "pvc-s" || pub.GetPublishContext()[PCMirror] != "pvc-from-s" {
		t.Fatalf("publish of the restored volume: %v, %v", pub.GetPublishContext(), err)
	}
	_, err = restore("pvc-from-s3", map[string]string{"replicas": "3"}, 0, "mirror:snap-3")
	wantCode(t, "replicas 3 from a snapshot of two legs", err, codes.InvalidArgument)
	// Larger than its snapshot: its legs made that large and the
	// witness as its snapshot; the publish context gives the size its
	// mirror grows to at its stage.
	big, err := restore("pvc-from-s-big", two, 2*size, "mirror:snap-3")
	if err != nil || big.GetCapacityBytes() != 2*size {
		t.Fatalf("a restore at twice its snapshot's size: %v, %v", big, err)
	}
	r.wantMemberSizes(t, "pvc-from-s-big", parts, 2*size)
	if again, err := restore("pvc-from-s-big", two, 2*size, "mirror:snap-3"); err != nil || again.GetCapacityBytes() != 2*size {
		t.Fatalf("the larger restore again: %v, %v", again, err)
	}
	pub, err = r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: big.GetVolumeId(), NodeId: "host-2", VolumeCapability: rwo})
	if err != nil || pub.GetPublishContext()[PCSize] != fmt.Sprint(2*size) || pub.GetPublishContext()[PCAdopt] != "pvc-s" {
		t.Fatalf("publish of the larger restore: %v, %v", pub.GetPublishContext(), err)
	}
	_, err = restore("pvc-from-s-small", two, size/2, "mirror:snap-3")
	if err != nil {
		t.Fatalf("a restore asking less than its snapshot (it has the snapshot's size): %v", err)
	}
	_, err = r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-from-s-lim", Parameters: two,
		CapacityRange: &csi.CapacityRange{LimitBytes: size / 2}, VolumeCapabilities: []*csi.VolumeCapability{rwo},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "mirror:snap-3"}}}})
	wantCode(t, "a restore limited below its snapshot's size", err, codes.OutOfRange)
	_, err = restore("pvc-from-none", two, 0, "mirror:nosuch")
	wantCode(t, "a restore of no snapshot", err, codes.NotFound)
	_, err = restore("pvc-from-one", two, 0, one.GetVolumeId())
	wantCode(t, "a replicated volume from a snapshot of one node's", err, codes.InvalidArgument)
	if again, err := clone("pvc-clone-4", two, 0, v.GetVolumeId()); err != nil || again.GetVolumeId() != "mirror:pvc-clone-4" || again.GetCapacityBytes() != size {
		t.Fatalf("the clone again: %v, %v", again, err)
	}
	if cv, err := clone("pvc-clone-big", two, 3*size, v.GetVolumeId()); err != nil || cv.GetCapacityBytes() != 3*size {
		t.Fatalf("a clone at three times its source's size: %v, %v", cv, err)
	}
	r.wantMemberSizes(t, "pvc-clone-big", parts, 3*size)
	_, err = clone("pvc-clone-3legs", map[string]string{"replicas": "3"}, 0, v.GetVolumeId())
	wantCode(t, "a clone of two legs with replicas 3", err, codes.InvalidArgument)
	_, err = clone("pvc-clone-one", two, 0, one.GetVolumeId())
	wantCode(t, "a replicated clone of a volume of one node", err, codes.InvalidArgument)
	// A clone that stopped part way (a member lost): made anew by the
	// tries after.
	if _, err := api.NewServer(r.admin[parts["leg1"]]).DeleteVolume(ctx, "pvc-clone-9", false); err != nil {
		t.Fatal(err)
	}
	_, err = clone("pvc-clone-9", two, 0, v.GetVolumeId())
	wantCode(t, "a clone that stopped part way", err, codes.Unavailable)
	if _, err := clone("pvc-clone-9", two, 0, v.GetVolumeId()); err != nil || len(r.members("pvc-clone-9")) != 3 {
		t.Fatalf("the clone made anew: %v, members %v", err, byPart(r.members("pvc-clone-9")))
	}

	// A member's node down: no snapshot, and none left behind.
	r.procs[parts["leg1"]].stop()
	_, err = r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-down", SourceVolumeId: v.GetVolumeId()})
	wantCode(t, "a snapshot with a leg's node down", err, codes.Unavailable)
	for _, node := range []string{parts["leg0"], parts["witness"]} {
		if _, err := api.NewServer(r.admin[node]).Snapshot(ctx, "snap-down"); !isNotFound(err) {
			t.Errorf("snap-down on %s: %v", node, err)
		}
	}
}

// TestSnapshotsWithANodeDown: a storage node that holds nothing of a
// volume, stopped, stops no snapshot of it, of one node or replicated:
// it is left out, and the left-out header names it. A replicated
// snapshot's delete waits for it (it could hold a part: the id names no
// node) and goes once it answers. (A member's node, or a retired
// member's, that does not answer: TestReplicatedLegReplaced.)
func TestSnapshotsWithANodeDown(t *testing.T) {
	r := newRigWith(t, rigOptions{nodes: 5, reflinks: true, edit: func(c *Config) {
		c.Controller.StorageTimeout = conf.Duration{Duration: 2 * time.Second}
	}})
	ctx := context.Background()
	rep := r.mustCreate("pvc-r", 16<<20, map[string]string{"replicas": "2"}, nil)
	one := r.mustCreate("pvc-1", 16<<20, nil, nil)
	oneNode, _, _ := strings.Cut(one.GetVolumeId(), "/")
	used := append(slices.Collect(maps.Values(byPart(r.members("pvc-r")))), oneNode)
	var idle string
	for _, sn := range r.nodes {
		if !slices.Contains(used, sn.Name) {
			idle = sn.Name
			break
		}
	}
	if idle == "" {
		t.Fatalf("every node holds a volume (%v)", used)
	}
	r.procs[idle].stop()
	var ids []string
	for name, v := range map[string]*csi.Volume{"snap-of-1": one, "snap-of-r": rep} {
		var hdr metadata.MD
		snap, err := r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: v.GetVolumeId()}, grpc.Header(&hdr))
		if err != nil {
			t.Fatalf("a snapshot of %s with %s, which holds nothing of it, stopped: %v", v.GetVolumeId(), idle, err)
		}
		if got := strings.Join(hdr.Get(LeftOutHeader), ","); got != idle {
			t.Errorf("the snapshot of %s: left out %q, want %s", v.GetVolumeId(), got, idle)
		}
		ids = append(ids, snap.GetSnapshot().GetSnapshotId())
	}
	slices.Sort(ids) // "mirror:…" before "node-…"
	ids[0], ids[1] = ids[1], ids[0]
	if !strings.HasPrefix(ids[0], oneNode+"/") || !strings.HasPrefix(ids[1], "mirror:") {
		t.Fatalf("snapshot ids %v: want one on %s and a replicated one", ids, oneNode)
	}
	if _, err := r.cc.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: ids[0]}); err != nil {
		t.Errorf("deleting %s, whose id names its node: %v", ids[0], err)
	}
	_, err := r.cc.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: ids[1]})
	wantCode(t, "deleting a replicated snapshot while a node does not answer", err, codes.Unavailable)
	r.procs[idle].start()
	kit.WaitFor(t, 30*time.Second, idle+" answering again", func() bool {
		_, err := r.d.ctrl.node(idle).pools(ctx)
		return err == nil
	})
	if _, err := r.cc.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: ids[1]}); err != nil {
		t.Fatalf("deleting %s once every node answers: %v", ids[1], err)
	}
	if left, err := r.d.ctrl.mirrorSnapshotMembers(ctx, storageName("snap-of-r")); err != nil || len(left) != 0 {
		t.Errorf("after the delete, member snapshots %v (%v): want none", left, err)
	}
}
