package csi

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/serverd"
	"github.com/rnbd/rnbd/test/kit"
)

const zoneKey = "topology.kubernetes.io/zone"

func zone(z string) *csi.Topology { return &csi.Topology{Segments: map[string]string{zoneKey: z}} }

// reap waits for a daemon that exited by itself (a crash point).
func (p *daemonProc) reap() {
	p.cmd.Wait()
	p.out.Close()
	p.cmd = nil
}

// TestStorageNodeDown: with one storage node stopped (nothing listens),
// then frozen (SIGSTOP: it accepts, answers nothing), the other keeps
// provisioning: CreateVolume in its zone and in no zone, DeleteVolume
// of a volume made before, ListVolumes and GetCapacity answer within
// the per-node deadline, saying in their header which node was left
// out, counted in rnbd_csi_storage_node_left_out_total; Probe stays
// ready. A volume made while the node was away is deleted once it
// answers (Unavailable until then: reclaim.go). The timings are
// printed.
func TestStorageNodeDown(t *testing.T) {
	// The deadline covers a call's wait for its turn too: 60 creates at
	// once on node-a, 16 at a time, took over 1 s under -race on a 2-core
	// machine building Kubernetes beside (.ci/run), and one that ran out
	// of it marked node-a down.
	const deadline = 3 * time.Second
	r := newRigWith(t, rigOptions{labels: []map[string]string{{zoneKey: "a"}, {zoneKey: "b"}}, edit: func(c *Config) {
		c.Controller.StorageTimeout = conf.Duration{Duration: deadline}
	}})
	ctx := context.Background()
	var madeAway []string
	for _, how := range []string{"stopped", "frozen"} {
		b := r.procs["node-b"]
		if how == "frozen" {
			b.start()
			kit.WaitFor(t, 30*time.Second, "node-b back", func() bool { return leftOutOf(t, r, ctx) == "" })
		}
		before := r.mustCreate("pvc-before-"+how, 64<<20, nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("a")}})
		if how == "stopped" {
			b.stop()
		} else {
			b.freeze()
		}
		// Each call answers within two rounds of the deadline (a lookup
		// of node-b, then a placement that does not ask it again in the
		// zone, or does in none): never the caller's deadline.
		bound := 3*deadline + 2*time.Second
		timed := func(what string, f func() error) {
			t.Helper()
			began := time.Now()
			err := f()
			took := time.Since(began)
			t.Logf("node-b %s: %s took %v (%v)", how, what, took.Round(time.Millisecond), err)
			if err != nil {
				t.Errorf("node-b %s: %s: %v", how, what, err)
			}
			if took > bound {
				t.Errorf("node-b %s: %s took %v, more than %v", how, what, took, bound)
			}
		}
		var zoned, anyv *csi.Volume
		timed("CreateVolume in zone a", func() (err error) {
			zoned, err = r.create("pvc-a-"+how, 64<<20, nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("a")}})
			return err
		})
		timed("CreateVolume in any zone", func() (err error) {
			anyv, err = r.create("pvc-any-"+how, 64<<20, nil, nil)
			return err
		})
		for _, v := range []*csi.Volume{zoned, anyv} {
			if !strings.HasPrefix(v.GetVolumeId(), "node-a/") {
				t.Errorf("node-b %s: a volume placed at %s", how, v.GetVolumeId())
			}
		}
		if how == "frozen" {
			// As the sidecars call: many at once. A node that does not
			// answer holds no queue: one call probes it, the others
			// leave it out at once, and each still answers within the
			// bound.
			timed("60 CreateVolume at once in zone a", func() error {
				errs := make(chan error, 60)
				for i := range 60 {
					go func() {
						began := time.Now()
						v, err := r.create(fmt.Sprintf("pvc-many-%d", i), 1<<20, nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("a")}})
						if err == nil && time.Since(began) > bound {
							err = fmt.Errorf("%s took %v", v.GetVolumeId(), time.Since(began))
						}
						errs <- err
					}()
				}
				var all []error
				for range 60 {
					all = append(all, <-errs)
				}
				return errors.Join(all...)
			})
		}
		timed("ListVolumes", func() error {
			var hdr metadata.MD
			lv, err := r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{}, grpc.Header(&hdr))
			if err == nil && (len(lv.GetEntries()) < 3 || strings.Join(hdr.Get(LeftOutHeader), ",") != "node-b") {
				err = fmt.Errorf("%d volumes, left out %q: want the volumes of node-a, node-b left out", len(lv.GetEntries()), hdr.Get(LeftOutHeader))
			}
			return err
		})
		timed("GetCapacity", func() error {
			var hdr metadata.MD
			gc, err := r.cc.GetCapacity(ctx, &csi.GetCapacityRequest{}, grpc.Header(&hdr))
			if err == nil && (gc.GetAvailableCapacity() <= 0 || strings.Join(hdr.Get(LeftOutHeader), ",") != "node-b") {
				err = fmt.Errorf("capacity %d, left out %q: want node-a's, node-b left out", gc.GetAvailableCapacity(), hdr.Get(LeftOutHeader))
			}
			return err
		})
		timed("Probe", func() error {
			_, err := r.id.Probe(ctx, &csi.ProbeRequest{})
			return err
		})
		timed("DeleteVolume of a volume of node-a made before", func() error {
			_, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: before.GetVolumeId()})
			return err
		})
		// A call that needs node-b is Unavailable, which the CO
		// retries: a volume in its zone, and the delete of one made
		// while it was away.
		_, err := r.create("pvc-b-"+how, 64<<20, nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("b")}})
		wantCode(t, "node-b "+how+": CreateVolume in zone b", err, codes.Unavailable)
		for _, v := range []*csi.Volume{zoned, anyv} {
			_, err = r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()})
			wantCode(t, "node-b "+how+": DeleteVolume of a volume made while it was away", err, codes.Unavailable)
			madeAway = append(madeAway, v.GetVolumeId())
		}
	}
	if n := testutil.ToFloat64(r.d.rpcs.leftOut.WithLabelValues("node-b", "ListVolumes")); n < 2 {
		t.Errorf("rnbd_csi_storage_node_left_out_total{node-b,ListVolumes} = %v, want 2", n)
	}
	if n := testutil.ToFloat64(r.d.rpcs.nodeUp.WithLabelValues("node-b")); n != 0 {
		t.Errorf("rnbd_csi_storage_node_up{node-b} = %v, want 0", n)
	}
	r.procs["node-b"].thaw()
	for _, id := range madeAway {
		if _, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("DeleteVolume %s once node-b answers: %v", id, err)
		}
	}
}

// leftOutOf is the rnbd-left-out header of a ListVolumes.
func leftOutOf(t *testing.T, r *rig, ctx context.Context) string {
	var hdr metadata.MD
	if _, err := r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{}, grpc.Header(&hdr)); err != nil {
		return "error"
	}
	return strings.Join(hdr.Get(LeftOutHeader), ",")
}

// TestDuplicateReclaimed is the design of docs/kubernetes.md's "A
// storage node that does not answer", run: a storage node dies in the
// middle of a create (after its pool made the volume, before it
// answered); the CO's retry makes the name on the other node; the first
// comes back with its copy (its restart finishes the create), and the
// reconciler reclaims that copy, the older, keeping the one the CO
// holds. Then the same with the CO deleting its volume while the node
// is still away: the delete waits (Unavailable) until the node answers,
// and takes both copies. A copy in use is never reclaimed: it is kept
// and counted.
func TestDuplicateReclaimed(t *testing.T) {
	crash := serverd.CrashEnv + "=volume-create-made"
	r := newRigWith(t, rigOptions{labels: []map[string]string{{zoneKey: "a"}, {zoneKey: "b"}}, env: map[string][]string{"node-a": {crash}},
		edit: func(c *Config) {
			c.Controller.StorageTimeout = conf.Duration{Duration: 2 * time.Second}
			c.Controller.ReconcileInterval = conf.Duration{Duration: 300 * time.Millisecond}
		}})
	ctx := context.Background()
	a := r.procs["node-a"]
	both := &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("a"), zone("b")}, Preferred: []*csi.Topology{zone("a"), zone("b")}}
	copies := func(node, name string) bool {
		_, err := api.NewServer(r.admin[node]).Volume(ctx, name)
		return err == nil
	}

	for _, deleteWhileAway := range []bool{false, true} {
		name := fmt.Sprintf("pvc-dup-%v", deleteWhileAway)
		// The first try: node-a makes it, and dies before it answers.
		_, err := r.create(name, 64<<20, nil, both)
		if status.Code(err) != codes.Unavailable && status.Code(err) != codes.Internal {
			t.Fatalf("CreateVolume on a node that dies in it: %v", err)
		}
		a.reap()
		// The CO's retry: node-a does not answer; made on node-b,
		// remembering node-a could not say.
		v, err := r.create(name, 64<<20, nil, both)
		if err != nil || !strings.HasPrefix(v.GetVolumeId(), "node-b/") {
			t.Fatalf("the retry with node-a away: %v %v", v, err)
		}
		rec, err := api.NewServer(r.admin["node-b"]).Volume(ctx, name)
		if err != nil || rec.Labels[labelUnchecked] != "node-a" {
			t.Fatalf("the copy on node-b: %+v %v, want labelled %s=node-a", rec, err, labelUnchecked)
		}
		if deleteWhileAway {
			_, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()})
			wantCode(t, "DeleteVolume of a copy made while node-a was away, node-a still away", err, codes.Unavailable)
		}
		// node-a comes back (its crash point off): its restart finishes
		// the create it died in.
		a.env = nil
		a.start()
		kit.WaitFor(t, 30*time.Second, "node-a's admin listener", func() bool { _, err := api.NewServer(r.admin["node-a"]).Pools(ctx); return err == nil })
		if deleteWhileAway {
			if _, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
				t.Fatalf("DeleteVolume once node-a answers: %v", err)
			}
			if copies("node-a", name) || copies("node-b", name) {
				t.Fatalf("after the delete: a copy on node-a %v, on node-b %v; want none", copies("node-a", name), copies("node-b", name))
			}
			t.Logf("%s: the delete waited for node-a, then took its copy too", name)
		} else {
			kit.WaitFor(t, 30*time.Second, "the older copy on node-a reclaimed", func() bool { return !copies("node-a", name) })
			if !copies("node-b", name) {
				t.Fatal("the copy the CO holds, on node-b, was reclaimed")
			}
			t.Logf("%s: node-a came back with its copy; the reconciler reclaimed it, node-b's kept", name)
		}
		// Crash node-a in the next create again. The controller may
		// have found it down while it restarted (its reconciler runs
		// every 300 ms): the next create must find it up, or it is
		// placed on node-b.
		a.stop()
		a.env = []string{crash}
		a.start()
		kit.WaitFor(t, 30*time.Second, "node-a's admin listener", func() bool { _, err := api.NewServer(r.admin["node-a"]).Pools(ctx); return err == nil })
		kit.WaitFor(t, 30*time.Second, "the controller to find node-a up", func() bool {
			return testutil.ToFloat64(r.d.rpcs.nodeUp.WithLabelValues("node-a")) == 1
		})
	}
	if n := testutil.ToFloat64(r.d.rpcs.duplicates.WithLabelValues("node-a", "reclaimed")); n != 2 {
		t.Errorf("rnbd_csi_duplicate_volumes_total{node-a,reclaimed} = %v, want 2", n)
	}

	// A copy in use: an older copy of a name, granted to a worker, is
	// kept and counted; the newer stays too.
	a.stop()
	a.env = nil
	a.start()
	kit.WaitFor(t, 30*time.Second, "node-a's admin listener", func() bool { _, err := api.NewServer(r.admin["node-a"]).Pools(ctx); return err == nil })
	held := r.mustCreate("pvc-held", 64<<20, nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("b")}})
	_, hname, _ := parseID(held.GetVolumeId())
	rec, err := api.NewServer(r.admin["node-b"]).Volume(ctx, hname)
	if err != nil {
		t.Fatal(err)
	}
	older := map[string]string{labelName: rec.Labels[labelName], labelParams: rec.Labels[labelParams], labelMade: "2020-01-01T00:00:00Z"}
	na := api.NewServer(r.admin["node-a"])
	if _, err := na.CreateVolume(ctx, api.VolumeRequest{Name: hname, Pool: "files", Size: "64MiB", Labels: older,
		Export: api.MapRequest{GrantsOnly: ptr(true)}}); err != nil {
		t.Fatal(err)
	}
	if err := na.GrantVolume(ctx, hname, api.GrantRequest{Identity: "host-1"}); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 30*time.Second, "the older copy in use counted as kept", func() bool {
		return testutil.ToFloat64(r.d.rpcs.duplicates.WithLabelValues("node-a", "kept")) >= 1
	})
	if !copies("node-a", hname) || !copies("node-b", hname) {
		t.Errorf("a copy in use: node-a's there %v, node-b's %v; want both kept", copies("node-a", hname), copies("node-b", hname))
	}
}

// TestReclaimConditional: the reclaim of an older copy is decided on
// what was read, and done only if the copy has not changed since: a
// copy a CreateVolume took as its answer meanwhile (its csi.made set
// anew) is not deleted.
func TestReclaimConditional(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	na := api.NewServer(r.admin["node-a"])
	labels := map[string]string{labelName: "pvc-x", labelParams: volumeParams{}.canonical(), labelMade: "2020-01-01T00:00:00Z"}
	if _, err := na.CreateVolume(ctx, api.VolumeRequest{Name: "pvc-x", Pool: "files", Size: "1MiB", Labels: labels,
		Export: api.MapRequest{GrantsOnly: ptr(true)}}); err != nil {
		t.Fatal(err)
	}
	stale, err := na.Volume(ctx, "pvc-x")
	if err != nil {
		t.Fatal(err)
	}
	// A retry of CreateVolume takes it as its answer: made the newest.
	if _, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-x", VolumeCapabilities: []*csi.VolumeCapability{rwo},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}}); err != nil {
		t.Fatal(err)
	}
	if err := r.d.ctrl.reclaim(ctx, found{r.d.ctrl.node("node-a"), *stale}, "node-b/pvc-x"); err == nil {
		t.Fatal("the reclaim of a copy read before a retry took it: done")
	}
	if v, err := na.Volume(ctx, "pvc-x"); err != nil || v.Labels[labelMade] == stale.Labels[labelMade] {
		t.Fatalf("the copy a retry took: %+v %v; want it there, made anew", v, err)
	}
}
