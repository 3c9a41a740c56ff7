package csi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testca"
	"github.com/rnbd/rnbd/test/testfs"
)

// TestFleetReplicatedOnKernel is the fleet scenario of a replicated
// volume (replicas 2, a witness), driven through the CSI services over
// gRPC as the sidecars and the kubelet would, on four real storage
// nodes and a worker's rnbd-client, a raw block volume on /dev/ublkbN
// (TestNodeReplicatedOnKernel has ext4 on one):
//   - a leg's storage node frozen (SIGSTOP) under IO: the leg taken out,
//     the IO going on; thawed, the leg rejoins and is resynced from the
//     bitmap — the bytes copied printed against the volume's size;
//   - the other leg's node killed for good under IO: the IO goes on, the
//     controller makes the leg anew on the spare it gave the worker at
//     publish (after mirror_replace_after), the worker's rnbd-client
//     takes it (after mirror_spare_after) and rebuilds it in full;
//   - every block read back as last written, a fio verify, the volume
//     published again over its new placement;
//   - a snapshot restored into a volume twice as large: the source's
//     bytes, zeros after them;
//   - then deleted: nothing left on the nodes that answer.
func TestFleetReplicatedOnKernel(t *testing.T) {
	needKernel(t)
	if _, err := exec.LookPath("fio"); err != nil {
		t.Fatal("fio is missing: the VM guest has it (test/vm/run.sh copies it)")
	}
	f := &fleet{t: t, r: &kernelRig{dir: t.TempDir(), bin: filepath.Dir(serverBin)}, began: time.Now()}
	if c, err := os.OpenFile("/dev/console", os.O_WRONLY, 0); err == nil && os.Getenv("RNBD_CSI_CONSOLE") == "1" {
		t.Cleanup(func() { c.Close() })
		f.console = c
	}
	f.dir = filepath.Join(f.r.dir, "kubelet")
	pki := filepath.Join(f.r.dir, "pki")
	if err := os.Mkdir(pki, 0o700); err != nil {
		t.Fatal(err)
	}
	ca := testca.New(t, "rnbd replicated fleet CA")
	caFile := ca.WriteCA(t, pki, "ca")

	// Four storage nodes on the loopback, each its own port: legs in
	// zones a and b (spreadBy), the witness in c, the spare in b.
	zones := []string{"a", "b", "c", "b"}
	for i, name := range []string{"rn-a", "rn-b", "rn-c", "rn-d"} {
		s := &fleetStorage{name: name, addr: "127.0.0.1", dir: filepath.Join(f.r.dir, name), pool: testfs.ReflinkDir(t),
			port: 1301 + i, aport: 1311 + i}
		if err := os.Mkdir(s.dir, 0o700); err != nil {
			t.Fatal(err)
		}
		cert, key := testca.WriteCert(t, ca.Issue(t, name, "127.0.0.1"), pki, name)
		s.conf, s.sock = filepath.Join(s.dir, "server.toml"), filepath.Join(s.dir, "s.sock")
		if err := os.WriteFile(s.conf, storageNodeConfig(s.addr, s.port, s.aport, s.dir, cert, key, caFile, s.pool,
			`handshake_timeout = "10s"`), 0o600); err != nil {
			t.Fatal(err)
		}
		s.ctl = ctl.Dial(s.sock)
		s.cfg = StorageNode{Name: name, Admin: fmt.Sprintf("https://127.0.0.1:%d", s.aport), Paths: []string{"ip:127.0.0.1"},
			Port: s.port, Pool: "files", Labels: map[string]string{zoneKey: zones[i]}}
		f.startStorage(s)
		f.storage = append(f.storage, s)
	}
	// The worker's rnbd-client: a leg that holds requests 2 s is taken
	// out; a leg out 2 s takes a spare that opens.
	w := &fleetWorker{name: "worker-r"}
	cert, key := testca.WriteCert(t, ca.Issue(t, w.name), pki, w.name)
	wd := filepath.Join(f.r.dir, w.name)
	if err := os.Mkdir(wd, 0o700); err != nil {
		t.Fatal(err)
	}
	w.sock = filepath.Join(wd, "c.sock")
	f.r.run(t, w.name+"-rnbd-client", filepath.Join(f.r.bin, "rnbd-client"), "daemon",
		"--config", "/dev/null", "--control-socket", w.sock, "--state-file", filepath.Join(wd, "c.json"), "--socket-dir", wd,
		"--dev-links-dir", "", "--tls-cert", cert, "--tls-key", key, "--tls-ca", caFile,
		"--mirror-leg-timeout", "2s", "--mirror-spare-after", "2s")
	w.client = ctl.Dial(w.sock)
	kit.WaitFor(t, 30*time.Second, w.name+"'s rnbd-client", func() bool {
		return w.client.Do(context.Background(), "GET", "/v1/devices", nil, nil) == nil
	})
	f.workers = []*fleetWorker{w}

	cfg := DefaultConfig()
	for _, s := range f.storage {
		cfg.StorageNodes = append(cfg.StorageNodes, s.cfg)
	}
	ccert, ckey := testca.WriteCert(t, ca.Issue(t, "csi-controller"), pki, "csi-controller")
	cfg.TLS.Cert, cfg.TLS.Key, cfg.TLS.CA = ccert, ckey, caFile
	cfg.Workers = WorkersConfig{Source: WorkersList, Names: []string{w.name}}
	cfg.Controller.StorageTimeout = conf.Duration{Duration: fleetStorageTimeout}
	cfg.Controller.ReconcileInterval = conf.Duration{Duration: 2 * time.Second}
	// Longer than the freeze below, which the leg's resync mends.
	cfg.Controller.MirrorReplaceAfter = conf.Duration{Duration: 30 * time.Second}
	conn := f.serve(cfg, ModeController, "controller")
	f.ctrl = csi.NewControllerClient(conn)
	nc := DefaultConfig()
	nc.Node.NodeID, nc.Node.ClientSocket = w.name, w.sock
	w.node = csi.NewNodeClient(f.serve(nc, ModeNode, w.name))
	f.unstageAtEnd()

	const size = 48 << 20
	// Raw block: a file system's own background writes (ext4's
	// inode tables) would keep the bitmap from cleaning (below).
	v := &fleetVol{name: "fleet-mirror", frontend: "ublk", size: size, block: true,
		vc: &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}
	var place map[string]string // part: storage node
	f.step("create and publish the replicated volume", 2*time.Minute, func(ctx context.Context) error {
		rsp, err := f.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: v.name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
			VolumeCapabilities: []*csi.VolumeCapability{v.vc},
			Parameters:         map[string]string{"frontend": v.frontend, "replicas": "2", "spreadBy": zoneKey}})
		if err != nil {
			return err
		}
		v.id, v.volCtx = rsp.Volume.VolumeId, rsp.Volume.VolumeContext
		f.vols = append(f.vols, v)
		if place, err = f.placement(ctx, v.name); err != nil {
			return err
		}
		return f.publish(ctx, v, w)
	})
	f.say("placement %v", place)
	// The leg in zone a is frozen, the one in zone b (where the spare
	// is) killed.
	fi, di := 0, 1
	if f.storageNode(place["leg1"]).cfg.Labels[zoneKey] == "a" {
		fi, di = 1, 0
	}
	frozen, dead := f.storageNode(place[legMember(fi)]), f.storageNode(place[legMember(di)])
	// The writer's 64 blocks of 64 KiB at the device's start: the
	// regions the freeze's resync copies (a new mirror's bitmap is
	// clean; docs/replication.md, "The bitmap").
	bw := newBlockWriter(v.target)
	go bw.run()
	t.Cleanup(bw.quitNoWait)

	// A leg's node frozen under IO: taken out, the IO goes on; thawed:
	// back, resynced from the bitmap with what it missed.
	var resync int64
	f.step("freeze "+frozen.name+" under IO, thaw it", 3*time.Minute, func(ctx context.Context) error {
		if err := bw.waitFor(ctx, 16); err != nil {
			return err
		}
		if err := frozen.cmd.Process.Signal(unix.SIGSTOP); err != nil {
			return err
		}
		if err := f.waitLegs(ctx, w, v, func(ls []api.CltLegRecord) bool { return ls[fi].State == "stale" }); err != nil {
			frozen.cmd.Process.Signal(unix.SIGCONT)
			return fmt.Errorf("the leg on the frozen %s: %w", frozen.name, err)
		}
		at := bw.count.Load()
		if err := bw.waitFor(ctx, at+32); err != nil {
			frozen.cmd.Process.Signal(unix.SIGCONT)
			return fmt.Errorf("IO with a leg's node frozen: %w", err)
		}
		if err := frozen.cmd.Process.Signal(unix.SIGCONT); err != nil {
			return err
		}
		return f.waitLegs(ctx, w, v, func(ls []api.CltLegRecord) bool {
			if ls[fi].State == "resyncing" && ls[fi].ResyncTotal > 0 {
				resync = ls[fi].ResyncTotal
			}
			return ls[0].State == "in sync" && ls[1].State == "in sync"
		})
	})
	logs := os.Getenv("RNBD_CSI_LOGS")
	if logs == "" {
		logs = f.r.dir
	}
	clientLog := filepath.Join(logs, w.name+"-rnbd-client.log")
	rs := rejoins(t, clientLog)
	if len(rs) != 1 || rs[0].full || rs[0].bytes <= 0 || rs[0].bytes >= size {
		t.Fatalf("resyncs after the freeze %+v (record showed %d): want one, from the bitmap, less than the volume's %d bytes", rs, resync, size)
	}
	f.times = append(f.times, fmt.Sprintf("resync after the freeze: %d of the volume's %d bytes copied", rs[0].bytes, size))

	// The other leg's node killed for good under IO: the IO goes on;
	// the controller makes the leg on the spare, the worker takes it
	// and rebuilds it.
	f.step("kill -9 "+dead.name+" for good under IO; its leg made anew and rebuilt", 4*time.Minute, func(ctx context.Context) error {
		if err := dead.cmd.Process.Kill(); err != nil {
			return err
		}
		dead.cmd.Wait()
		dead.down = true
		at := bw.count.Load()
		if err := bw.waitFor(ctx, at+32); err != nil {
			return fmt.Errorf("IO with a leg's node dead: %w", err)
		}
		return f.waitLegs(ctx, w, v, func(ls []api.CltLegRecord) bool {
			return ls[0].State == "in sync" && ls[1].State == "in sync" && !strings.Contains(ls[di].SessName, dead.name)
		})
	})
	if rs := rejoins(t, clientLog); len(rs) != 2 || !rs[1].full || rs[1].bytes != size {
		t.Fatalf("resyncs after the replacement %+v: want a rebuild in full of %d bytes", rs, size)
	}
	f.times = append(f.times, fmt.Sprintf("rebuild of the new leg: %d bytes", size))
	now, err := f.placement(context.Background(), v.name)
	if err != nil {
		t.Fatal(err)
	}
	if to := f.storageNode(now[legMember(di)]); to == nil || to == dead || to.cfg.Labels[zoneKey] != dead.cfg.Labels[zoneKey] ||
		now[legMember(fi)] != frozen.name {
		t.Fatalf("placement after the replacement %v (was %v): want %s on the spare in %s's zone", now, place, legMember(di), dead.name)
	}
	f.step("every block as last written, fio verify", 3*time.Minute, func(ctx context.Context) error {
		bw.stop()
		if err := bw.err(); err != nil {
			return err
		}
		if err := bw.verify(); err != nil {
			return err
		}
		return f.fio(ctx, v, "after-replace")
	})
	// Published again over its new placement (the pod's next start):
	// the files there, the volume healthy.
	f.step("published again over the new placement", 3*time.Minute, func(ctx context.Context) error {
		if err := f.unpublish(ctx, v); err != nil {
			return err
		}
		if err := f.publish(ctx, v, w); err != nil {
			return err
		}
		if err := f.fio(ctx, v, "after-replace"); err != nil {
			return err
		}
		return f.waitLegs(ctx, w, v, func(ls []api.CltLegRecord) bool { return ls[0].State == "in sync" && ls[1].State == "in sync" })
	})
	// The dead node's replacement: a new one under its name and
	// address, its pool empty — as the retired member's node, back, it
	// lets volumes be made again (a create needs every node's answer)
	// and the delete below finish.
	f.startStorage(dead)
	// A snapshot (one point in time of both legs and the witness, the
	// writes held) restored into a replicated volume twice as large:
	// made on the snapshot's nodes, its mirror grown at its stage before
	// its device is made; the source's bytes there, zeros after them.
	f.step("snapshot, restored twice as large", 3*time.Minute, func(ctx context.Context) error {
		// The node started again is answered once the controller has
		// seen it back: Unavailable until then, which the CO retries.
		snap, err := untilAnswered(ctx, func() (*csi.CreateSnapshotResponse, error) {
			return f.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: v.id, Name: "fleet-mirror-snap"})
		})
		if err != nil {
			return fmt.Errorf("CreateSnapshot: %w", err)
		}
		sid := snap.GetSnapshot().GetSnapshotId()
		f.t.Cleanup(func() { f.ctrl.DeleteSnapshot(context.Background(), &csi.DeleteSnapshotRequest{SnapshotId: sid}) })
		rv := &fleetVol{name: "fleet-mirror-restored", frontend: v.frontend, size: 2 * size, block: true, vc: v.vc}
		rsp, err := untilAnswered(ctx, func() (*csi.CreateVolumeResponse, error) {
			return f.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: rv.name, CapacityRange: &csi.CapacityRange{RequiredBytes: rv.size},
				VolumeCapabilities: []*csi.VolumeCapability{rv.vc}, Parameters: map[string]string{"frontend": rv.frontend, "replicas": "2", "spreadBy": zoneKey},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
					Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: sid}}}})
		})
		if err != nil {
			return fmt.Errorf("CreateVolume from %s at %d bytes: %w", sid, rv.size, err)
		}
		if rsp.Volume.CapacityBytes != rv.size {
			return fmt.Errorf("restored at %d bytes, asked %d", rsp.Volume.CapacityBytes, rv.size)
		}
		rv.id, rv.volCtx = rsp.Volume.VolumeId, rsp.Volume.VolumeContext
		f.vols = append(f.vols, rv) // unstaged at the end if this step fails
		if err := f.publish(ctx, rv, w); err != nil {
			return err
		}
		if n, err := blockdev.DeviceSize(rv.target); err != nil || n != rv.size {
			return fmt.Errorf("the restored volume's device %s has %d bytes (%v), want %d", rv.target, n, err, rv.size)
		}
		src, err := os.ReadFile(v.target)
		if err != nil {
			return err
		}
		got, err := os.ReadFile(rv.target)
		if err != nil {
			return err
		}
		if !bytes.Equal(got[:size], src) {
			return errors.New("the restored volume does not hold its source's bytes")
		}
		if !bytes.Equal(got[size:], make([]byte, rv.size-size)) {
			return errors.New("the restored volume's bytes past its snapshot's size are not zeros")
		}
		if err := f.fio(ctx, rv, "restored"); err != nil {
			return err
		}
		if err := f.unpublish(ctx, rv); err != nil {
			return err
		}
		if _, err := retryOn(ctx, func() (*csi.DeleteVolumeResponse, error) {
			return f.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: rv.id})
		}, codes.Aborted); err != nil {
			return err
		}
		f.vols = slices.DeleteFunc(f.vols, func(x *fleetVol) bool { return x == rv })
		_, err = retryOn(ctx, func() (*csi.DeleteSnapshotResponse, error) {
			return f.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: sid})
		}, codes.Aborted)
		return err
	})
	f.step("unpublish and delete", 2*time.Minute, func(ctx context.Context) error {
		if err := f.unpublish(ctx, v); err != nil {
			return err
		}
		if _, err := retryOn(ctx, func() (*csi.DeleteVolumeResponse, error) {
			return f.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.id})
		}, codes.Aborted); err != nil {
			return err
		}
		f.vols = nil
		for _, s := range f.storage {
			recs, err := api.NewServer(s.ctl).Volumes(ctx)
			if err != nil {
				return err
			}
			if len(recs) != 0 {
				return fmt.Errorf("%s still has %d volumes", s.name, len(recs))
			}
		}
		return nil
	})
	fmt.Printf("TPUT csi-fleet replicated volume (%d MiB, 2 legs and a witness on 4 storage nodes): %.1fs in all; %s\n",
		size>>20, time.Since(f.began).Seconds(), strings.Join(f.times, ", "))
}

// untilAnswered calls call until it answers anything but Unavailable
// or Aborted, as a CO retries, or ctx ends.
func untilAnswered[T any](ctx context.Context, call func() (T, error)) (T, error) {
	return retryOn(ctx, call, codes.Unavailable, codes.Aborted)
}

// placement is a replicated volume's members by part, as the storage
// nodes that answer hold them (the placement the newest member says).
func (f *fleet) placement(ctx context.Context, vname string) (map[string]string, error) {
	var newest api.VolumeRecord
	for _, s := range f.storage {
		if s.down {
			continue
		}
		v, err := api.NewServer(s.ctl).Volume(ctx, vname)
		if err != nil {
			continue
		}
		if madeAt(*v).After(madeAt(newest)) {
			newest = *v
		}
	}
	p, err := parsePlacement(newest.Labels[labelMembers])
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, m := range p.members() {
		out[m.part] = m.node
	}
	return out, nil
}

// waitLegs waits until the legs of v's mirror on w satisfy ok.
func (f *fleet) waitLegs(ctx context.Context, w *fleetWorker, v *fleetVol, ok func([]api.CltLegRecord) bool) error {
	var last []api.CltLegRecord
	for {
		var recs []api.CltDeviceRecord
		if err := w.client.Do(ctx, "GET", "/v1/devices", nil, &recs); err == nil {
			for _, r := range recs {
				if r.Mirror == v.name && len(r.Legs) >= 2 {
					last = r.Legs
					if ok(r.Legs) {
						return nil
					}
				}
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("legs %+v: %w", last, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// rejoinedRE is rnbd-client's log line of a leg that rejoins: what its
// resync copies, and whether in full.
var rejoinedRE = regexp.MustCompile(`leg rejoined; resyncing" bytes=(\d+) full=(true|false)`)

// rejoins are the resyncs rnbd-client's log file says it started, in
// order: bytes to copy, and whether in full.
func rejoins(t *testing.T, logFile string) (out []struct {
	bytes int64
	full  bool
}) {
	t.Helper()
	b, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range rejoinedRE.FindAllSubmatch(b, -1) {
		n, _ := strconv.ParseInt(string(m[1]), 10, 64)
		out = append(out, struct {
			bytes int64
			full  bool
		}{n, string(m[2]) == "true"})
	}
	return out
}
