// The fleet scenario's storage outage (issue 40; docs/kubernetes.md, "A
// storage node that does not answer"), under a real kernel with volumes
// staged and IO on both storage nodes: node-b stopped (nothing listens),
// then started again and frozen (SIGSTOP: it takes connections and
// answers nothing), while node-a keeps provisioning, staging and
// deleting, each controller call within a bound made of the per-node
// deadline; then node-b's return as designed: the deletes that waited
// for it go through, and a name made twice (node-b dying in its create,
// the retry made on node-a) is reclaimed on node-b while the copy the CO
// holds stays and is used.

package csi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/serverd"
)

const (
	// fleetStorageTimeout is the scenario's [controller] storage_timeout:
	// the default. 2 s was tried first: under TCG on a busy host the
	// healthy node-a missed it too, with the guest formatting four
	// volumes at once (a call that needs a new TLS connection).
	fleetStorageTimeout = DefaultStorageTimeout
	// fleetReconcile is its reconcile_interval: the copy of a name made
	// twice is looked for that often.
	fleetReconcile = 10 * time.Second
	// awayBound bounds one controller call while node-b does not
	// answer: two rounds of the deadline (a lookup that asks node-b,
	// then a placement or a count that asks it again) and room for
	// qemu's TCG. Without the deadline a call waited for its caller's
	// own (75 s in issue 40).
	awayBound = 2*fleetStorageTimeout + 10*time.Second
	// outageSize is the size of the volumes made during the outage:
	// node-a's pool (512 MiB) is nearly full by then; each phase deletes
	// a volume of 32 MiB before it makes two.
	outageSize = 16 << 20
)

// outage is the state of the outage phase: the storage nodes, a volume
// of each with a writer in it, the volumes made while node-b did not
// answer, and the slowest controller call meanwhile.
type outage struct {
	f        *fleet
	a, b     *fleetStorage
	va, vb   *fleetVol
	wa, wb   *blockWriter
	madeAway []*fleetVol
	slowest  time.Duration
	slowName string
	summary  []string
	blocks   string // the writers' blocks during the last away
}

// storageOutage runs the phase: writers on a volume of each storage
// node; node-b stopped, what node-a serves meanwhile (away); node-b
// started again (its IO resumes), frozen, the same again; thawed (its
// IO resumes, both writers' blocks read back as last written); the
// deletes that waited for it; the copy made twice (duplicate).
func (f *fleet) storageOutage() {
	o := &outage{f: f, a: f.storage[0], b: f.storage[1]}
	a, b := o.a, o.b
	o.va = f.pick(func(v *fleetVol) bool { return v.storage == a.name })
	o.vb = f.pick(func(v *fleetVol) bool { return v.storage == b.name })
	o.wa, o.wb = newBlockWriter(filepath.Join(o.va.target, "under-outage")), newBlockWriter(filepath.Join(o.vb.target, "under-outage"))
	go o.wa.run()
	go o.wb.run()
	// Whatever fails from here, node-b answers again and the writers
	// close their files before the volumes' cleanup unmounts them (this
	// runs before it): a writer waiting on node-b would keep its mount
	// busy, and then wait for ever. A writer that does not end in a
	// minute is left (a write stuck in the kernel).
	f.t.Cleanup(func() {
		if b.frozen {
			b.cmd.Process.Signal(unix.SIGCONT)
			b.frozen = false
		}
		if b.down {
			b.env = nil
			f.startStorage(b)
		}
		for _, w := range []*blockWriter{o.wa, o.wb} {
			w.quitNoWait()
			select {
			case <-w.done:
			case <-time.After(time.Minute):
			}
		}
	})
	f.step("IO on "+o.va.id+" and "+o.vb.id, time.Minute, func(ctx context.Context) error {
		if err := o.wa.waitFor(ctx, 16); err != nil {
			return fmt.Errorf("%s: %w", o.va.id, err)
		}
		if err := o.wb.waitFor(ctx, 16); err != nil {
			return fmt.Errorf("%s: %w", o.vb.id, err)
		}
		return nil
	})

	// Stopped: SIGTERM, its process ended, nothing listens.
	var held int64
	b.down = true
	awayFrom := time.Now()
	f.step("stop "+b.name, time.Minute, func(ctx context.Context) error {
		if err := b.cmd.Process.Signal(unix.SIGTERM); err != nil {
			return err
		}
		// Drained: what it had received answered, then exit 0.
		if exit, err := waitExit(ctx, b.cmd); err != nil || exit != nil {
			return fmt.Errorf("%s stopped (SIGTERM): %v, exit %v; want exit 0", b.name, err, exit)
		}
		held = o.wb.count.Load()
		return nil
	})
	o.away("stopped", held, "nbd", f.workers[0])
	// Started again, its crash point armed for the copy made twice
	// (duplicate): nothing else makes a volume on it until then.
	b.env = []string{serverd.CrashEnv + "=volume-create-made"}
	began := time.Now()
	f.startStorage(b)
	f.times = append(f.times, fmt.Sprintf("%s started again %.1fs", b.name, time.Since(began).Seconds()))
	o.summary = append(o.summary, fmt.Sprintf("stopped %.1fs (%s)", time.Since(awayFrom).Seconds(), o.blocks))
	o.resumes("started again")

	// Frozen: SIGSTOP, its sockets open, nothing answered.
	b.frozen = true
	awayFrom = time.Now()
	f.step("freeze "+b.name, time.Minute, func(ctx context.Context) error {
		if err := b.cmd.Process.Signal(unix.SIGSTOP); err != nil {
			return err
		}
		for !stoppedBySignal(b.cmd.Process.Pid) {
			select {
			case <-ctx.Done():
				return fmt.Errorf("%s not stopped by SIGSTOP: %w", b.name, ctx.Err())
			case <-time.After(20 * time.Millisecond):
			}
		}
		held = o.wb.count.Load()
		return nil
	})
	o.away("frozen", held, "ublk", f.workers[1])
	if err := b.cmd.Process.Signal(unix.SIGCONT); err != nil {
		f.t.Fatal(err)
	}
	b.frozen = false
	o.summary = append(o.summary, fmt.Sprintf("frozen %.1fs (%s)", time.Since(awayFrom).Seconds(), o.blocks))
	o.resumes("thawed")
	f.step("verify the blocks written through the outage", 2*time.Minute, func(ctx context.Context) error {
		for _, w := range []*blockWriter{o.wa, o.wb} {
			w.stop()
			if err := w.err(); err != nil {
				return err
			}
			if err := w.verify(); err != nil {
				return err
			}
		}
		return nil
	})
	o.summary = append(o.summary, fmt.Sprintf("blocks written in all on %s %d, on %s %d, read back as last written", a.name, o.wa.count.Load(),
		b.name, o.wb.count.Load()))

	// The deletes of the volumes made while it was away were
	// Unavailable; now it answers (it has none of their names), they
	// go through.
	f.step("the deletes that waited for "+b.name, 2*time.Minute, func(ctx context.Context) error {
		for _, v := range o.madeAway {
			if _, err := f.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.id}); err != nil {
				return fmt.Errorf("DeleteVolume %s once %s answers: %w", v.id, b.name, err)
			}
			f.forget(v)
		}
		if up := testutil.ToFloat64(f.driver.rpcs.nodeUp.WithLabelValues(b.name)); up != 1 {
			return fmt.Errorf("rnbd_csi_storage_node_up{%s} = %v once it answers, want 1", b.name, up)
		}
		return nil
	})
	o.summary = append(o.summary, fmt.Sprintf("slowest controller call while away %s %.1fs (bound %v)", o.slowName, o.slowest.Seconds(), awayBound))

	o.duplicate()
	line := fmt.Sprintf("TPUT csi-fleet outage of %s (storage_timeout %v): %s", b.name, fleetStorageTimeout, strings.Join(o.summary, "; "))
	fmt.Println(line)
	f.t.Log(line)
	f.say("%s", line)
}

// away is what the fleet does while node-b does not answer (how: stopped
// or frozen; held: the blocks its writer had written then): a volume of
// node-a made before the outage unstaged and deleted; CreateVolume in
// node-a's zone and in none, both made on node-a and labelled
// csi.unchecked=node-b; the first published on w, staged (mkfs and
// mount on frontend), fio-verified, unstaged and unpublished; the delete
// of one made during it Unavailable (until node-b answers); ListVolumes and
// GetCapacity answered with node-b left out, saying so in their header
// and the metric; Probe ready. Each controller call within awayBound.
// Meanwhile the writer on node-a's volume goes on and the one on
// node-b's waits.
func (o *outage) away(how string, held int64, frontend string, w *fleetWorker) {
	f, a, b := o.f, o.a, o.b
	p := b.name + " " + how + ": "
	fromA := o.wa.count.Load()
	before := f.pick(func(v *fleetVol) bool { return v.storage == a.name && v != o.va })
	f.step(p+"unstage "+before.id+" made before", 2*time.Minute, func(ctx context.Context) error { return f.unpublish(ctx, before) })
	o.call(p+"DeleteVolume "+before.id, func(ctx context.Context) error {
		if _, err := f.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: before.id}); err != nil {
			return fmt.Errorf("DeleteVolume %s, made before %s was %s: %w", before.id, b.name, how, err)
		}
		f.forget(before)
		return nil
	})
	fsCap := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	zoned := &fleetVol{name: "fleet-" + how + "-zone-a", frontend: frontend, size: outageSize, vc: fsCap,
		topo: &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("a")}}}
	anyZone := &fleetVol{name: "fleet-" + how + "-any-zone", frontend: frontend, size: outageSize, vc: fsCap}
	for _, v := range []*fleetVol{zoned, anyZone} {
		what := "in zone a"
		if v.topo == nil {
			what = "in any zone"
		}
		o.call(p+"CreateVolume "+what, func(ctx context.Context) error {
			if err := f.create(ctx, v, nil); err != nil {
				return err
			}
			if err := o.madeUnchecked(ctx, v); err != nil {
				return err
			}
			o.madeAway = append(o.madeAway, v)
			return nil
		})
	}
	f.step(p+"publish and stage "+zoned.id+" on "+w.name+" and fio-verify it and unstage it", 3*time.Minute, func(ctx context.Context) error {
		if err := f.publish(ctx, zoned, w); err != nil {
			return err
		}
		if err := f.fio(ctx, zoned, "while-"+how); err != nil {
			return err
		}
		return f.unpublish(ctx, zoned)
	})
	// The delete of a volume made while node-b did not answer waits
	// for it: it could hold a copy of the name.
	o.call(p+"DeleteVolume "+anyZone.id+" Unavailable", func(ctx context.Context) error {
		_, err := f.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: anyZone.id})
		if status.Code(err) != codes.Unavailable {
			return fmt.Errorf("DeleteVolume %s, made while %s did not answer: %v; want Unavailable until it answers", anyZone.id, b.name, err)
		}
		return nil
	})
	o.call(p+"ListVolumes", func(ctx context.Context) error {
		was := o.leftOut("ListVolumes")
		var hdr metadata.MD
		lv, err := f.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{}, grpc.Header(&hdr))
		if err != nil {
			return fmt.Errorf("ListVolumes: %w", err)
		}
		if err := o.saysLeftOut(hdr, "ListVolumes", was); err != nil {
			return err
		}
		listed := map[string]bool{}
		for _, e := range lv.GetEntries() {
			id := e.GetVolume().GetVolumeId()
			if !strings.HasPrefix(id, a.name+"/") {
				return fmt.Errorf("ListVolumes lists %s, with %s left out", id, b.name)
			}
			listed[id] = true
		}
		for _, v := range f.vols {
			if v.storage == a.name && !listed[v.id] {
				return fmt.Errorf("ListVolumes without %s leaves out %s of %s", b.name, v.id, a.name)
			}
		}
		if up := testutil.ToFloat64(f.driver.rpcs.nodeUp.WithLabelValues(b.name)); up != 0 {
			return fmt.Errorf("rnbd_csi_storage_node_up{%s} = %v while it does not answer, want 0", b.name, up)
		}
		return nil
	})
	// Node-a's in all, none in node-b's zone (nothing can be placed
	// there now).
	for _, seg := range []*csi.Topology{nil, zone("b")} {
		name := "GetCapacity"
		if seg != nil {
			name += " of zone b"
		}
		o.call(p+name, func(ctx context.Context) error {
			was := o.leftOut("GetCapacity")
			var hdr metadata.MD
			gc, err := f.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{AccessibleTopology: seg}, grpc.Header(&hdr))
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			if got := gc.GetAvailableCapacity(); seg == nil && got <= 0 || seg != nil && got != 0 {
				return fmt.Errorf("%s with %s left out: %d bytes", name, b.name, got)
			}
			return o.saysLeftOut(hdr, "GetCapacity", was)
		})
	}
	o.call(p+"Probe", func(ctx context.Context) error {
		rsp, err := f.ident.Probe(ctx, &csi.ProbeRequest{})
		if err != nil || !rsp.GetReady().GetValue() {
			return fmt.Errorf("the controller's Probe with %s %s: %v %v; want ready", b.name, how, rsp, err)
		}
		return nil
	})
	f.step(p+"IO on "+a.name+" goes on and on "+b.name+" waits", time.Minute, func(ctx context.Context) error {
		if err := o.wa.waitFor(ctx, fromA+16); err != nil {
			return fmt.Errorf("the writer on %s: %w", o.va.id, err)
		}
		if err := o.wb.err(); err != nil {
			return fmt.Errorf("the writer on %s, waiting for %s: %w", o.vb.id, b.name, err)
		}
		if n := o.wb.count.Load(); n > held+1 {
			return fmt.Errorf("%d blocks written on %s while %s was %s", n-held, o.vb.id, b.name, how)
		}
		return nil
	})
	o.blocks = fmt.Sprintf("%d blocks written on %s meanwhile, %d on %s", o.wa.count.Load()-fromA, a.name, o.wb.count.Load()-held, b.name)
}

// call is a controller call's step, bounded by awayBound (its context's
// deadline, so a call that overruns fails DeadlineExceeded); the slowest
// is kept for the summary.
func (o *outage) call(name string, fn func(ctx context.Context) error) {
	began := time.Now()
	o.f.step(name, awayBound, fn)
	if took := time.Since(began); took > o.slowest {
		o.slowest, o.slowName = took, name[strings.Index(name, ": ")+2:]
	}
}

// leftOut is rnbd_csi_storage_node_left_out_total of node-b and method.
func (o *outage) leftOut(method string) float64 {
	return testutil.ToFloat64(o.f.driver.rpcs.leftOut.WithLabelValues(o.b.name, method))
}

// saysLeftOut: a call of method answered with node-b left out says so in
// its header, and counts it once more than was.
func (o *outage) saysLeftOut(hdr metadata.MD, method string, was float64) error {
	if got := strings.Join(hdr.Get(LeftOutHeader), ","); got != o.b.name {
		return fmt.Errorf("%s: header %s %q, want %q", method, LeftOutHeader, got, o.b.name)
	}
	if n := o.leftOut(method); n != was+1 {
		return fmt.Errorf("rnbd_csi_storage_node_left_out_total{%s,%s} = %v, was %v: want one more", o.b.name, method, n, was)
	}
	return nil
}

// madeUnchecked: v, made while node-b did not answer, is on node-a,
// labelled as made without node-b's word on its name (reclaim.go).
func (o *outage) madeUnchecked(ctx context.Context, v *fleetVol) error {
	if v.storage != o.a.name {
		return fmt.Errorf("%s made on %s while %s did not answer; want %s", v.name, v.storage, o.b.name, o.a.name)
	}
	_, export, _ := strings.Cut(v.id, "/")
	rec, err := api.NewServer(o.a.ctl).Volume(ctx, export)
	if err != nil {
		return err
	}
	if got := rec.Labels[labelUnchecked]; got != o.b.name {
		return fmt.Errorf("%s's label %s is %q, want %q", v.id, labelUnchecked, got, o.b.name)
	}
	return nil
}

// resumes: node-b back (how), the IO on its volume that waited goes on.
func (o *outage) resumes(how string) {
	began := time.Now()
	o.f.step(o.b.name+" "+how+": IO on "+o.vb.id+" resumes", 2*time.Minute, func(ctx context.Context) error {
		if err := o.wb.waitFor(ctx, o.wb.count.Load()+16); err != nil {
			return fmt.Errorf("the writer on %s after %s %s: %w", o.vb.id, o.b.name, how, err)
		}
		return nil
	})
	o.summary = append(o.summary, fmt.Sprintf("%s's writer 16 blocks on %.1fs after it was %s", o.b.name, time.Since(began).Seconds(), how))
}

// duplicate is the name made twice: CreateVolume preferring node-b's
// zone, node-b dying in it once its pool made the volume (its crash point,
// armed since it came back from the stop); the CO's retry, made on
// node-a; node-b back with its copy, which the reconciler reclaims, the
// older: node-a's, the one the CO holds, stays, and is staged and used
// (deleteAll deletes it).
func (o *outage) duplicate() {
	f, a, b := o.f, o.a, o.b
	v := &fleetVol{name: "fleet-twice", frontend: "nbd", size: outageSize,
		vc: &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}},
		topo: &csi.TopologyRequirement{Requisite: []*csi.Topology{zone("a"), zone("b")}, Preferred: []*csi.Topology{zone("b")}}}
	vname := storageName(v.name)
	copyOnB := filepath.Join(b.pool, vname+".img")
	b.down = true
	var copySize int64
	f.step("CreateVolume "+v.name+" on "+b.name+" which dies in it", time.Minute, func(ctx context.Context) error {
		_, err := f.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: v.name, CapacityRange: &csi.CapacityRange{RequiredBytes: v.size},
			VolumeCapabilities: []*csi.VolumeCapability{v.vc}, Parameters: map[string]string{"frontend": v.frontend},
			AccessibilityRequirements: v.topo})
		if c := status.Code(err); c != codes.Unavailable && c != codes.Internal {
			return fmt.Errorf("CreateVolume %s placed on %s, which dies in it: %v; want Unavailable or Internal", v.name, b.name, err)
		}
		if _, err := waitExit(ctx, b.cmd); err != nil {
			return fmt.Errorf("%s at its crash point: %w", b.name, err)
		}
		fi, err := os.Stat(copyOnB)
		if err != nil {
			return fmt.Errorf("%s died in the create without its copy made: %w", b.name, err)
		}
		copySize = fi.Size()
		return nil
	})
	o.call(b.name+" down: the retry of CreateVolume "+v.name, func(ctx context.Context) error {
		if err := f.create(ctx, v, nil); err != nil {
			return err
		}
		return o.madeUnchecked(ctx, v)
	})
	was := testutil.ToFloat64(f.driver.rpcs.duplicates.WithLabelValues(b.name, "reclaimed"))
	b.env = nil
	began := time.Now()
	f.startStorage(b)
	f.times = append(f.times, fmt.Sprintf("%s started again %.1fs", b.name, time.Since(began).Seconds()))
	var after time.Duration
	f.step(b.name+"'s copy of "+v.name+" reclaimed", 2*time.Minute, func(ctx context.Context) error {
		// The volume goes on node-b a moment before the reconciler,
		// its delete answered, counts it: both are waited for.
		for {
			_, err := api.NewServer(b.ctl).Volume(ctx, vname)
			n := testutil.ToFloat64(f.driver.rpcs.duplicates.WithLabelValues(b.name, "reclaimed"))
			if isNotFound(err) && after == 0 {
				after = time.Since(began)
			}
			if isNotFound(err) && n == was+1 {
				break
			}
			if n > was+1 {
				return fmt.Errorf("rnbd_csi_duplicate_volumes_total{%s,reclaimed} = %v, was %v: want one more (the reconciler's)", b.name, n, was)
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("%s's copy of %s not reclaimed (%v; rnbd_csi_duplicate_volumes_total{%s,reclaimed} = %v, was %v): %w",
					b.name, v.name, err, b.name, n, was, ctx.Err())
			case <-time.After(100 * time.Millisecond):
			}
		}
		if _, err := os.Stat(copyOnB); !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%s: %v; want it removed with the volume", copyOnB, err)
		}
		return o.madeUnchecked(ctx, v) // node-a's stays
	})
	f.step("stage "+v.id+" on "+f.workers[0].name+" and fio-verify it", 3*time.Minute, func(ctx context.Context) error {
		if err := f.publish(ctx, v, f.workers[0]); err != nil {
			return err
		}
		return f.fio(ctx, v, "the-copy-kept")
	})
	o.summary = append(o.summary, fmt.Sprintf("%s made twice: %s died in its create with its copy made (%d bytes in its pool), the retry made %s "+
		"labelled %s=%s; %s started again, its copy reclaimed by the reconciler %.1fs after; %s's kept, staged on %s, fio-verified",
		v.name, b.name, copySize, v.id, labelUnchecked, b.name, b.name, after.Seconds(), a.name, f.workers[0].name))
}

// forget drops v from the scenario's volumes (deleted by a step).
func (f *fleet) forget(v *fleetVol) {
	f.vols = slices.DeleteFunc(f.vols, func(x *fleetVol) bool { return x == v })
}

// waitExit waits for cmd's process to end, while ctx allows (a process
// that does not end is left to the test's cleanup), and returns how it
// ended (cmd.Wait's error: nil for exit 0).
func waitExit(ctx context.Context, cmd *exec.Cmd) (exit error, err error) {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case exit = <-done:
		return exit, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("pid %d did not end: %w", cmd.Process.Pid, ctx.Err())
	}
}
