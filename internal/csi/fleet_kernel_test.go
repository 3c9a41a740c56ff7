package csi

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/api"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testca"
	"github.com/rnbd/rnbd/test/testfs"
)

// The fleet scenario's sizes: the VM is qemu TCG, slow, so volumes and
// the IO in them are small.
const (
	fleetVolumes = 20
	fleetSize    = 32 << 20
	fleetGrown   = 64 << 20
)

// fleetStorage is a storage node of the fleet: rnbd-server with a dir
// pool on XFS (reflinks: snapshots), its fabric on an address of its own
// that both workers' namespaces reach, its admin listener over mutual
// TLS on the loopback.
type fleetStorage struct {
	name, addr  string
	dir, pool   string
	conf, sock  string
	port, aport int
	cmd         *exec.Cmd
	out         *os.File // its log, the one of its last start
	env         []string // added to its environment at its next start
	// down: its process ended (stopped, or died at a crash point) and
	// is not started again yet; frozen: stopped by SIGSTOP.
	down, frozen bool
	ctl          *ctl.Client // its control socket
	cfg          StorageNode
	volumeCount  int
}

// fleetWorker is a worker node: a network namespace with its own
// rnbd-client (its certificate's name its node id) and the node service
// of rnbd-csi for it.
type fleetWorker struct {
	name, ns string
	sock     string
	client   *ctl.Client
	node     csi.NodeClient
}

// fleetVol is a volume of the scenario and where it is published.
type fleetVol struct {
	name, id string
	storage  string
	frontend string
	block    bool
	size     int64
	vc       *csi.VolumeCapability
	topo     *csi.TopologyRequirement // CreateVolume's, nil for none
	volCtx   map[string]string
	w        *fleetWorker // published to, nil if not
	staging  string
	target   string
}

type fleet struct {
	t       *testing.T
	console io.Writer // the VM guest's console (RNBD_CSI_CONSOLE=1), or nil
	r       *kernelRig
	ip      string
	dir     string // the staging and target paths are under it
	storage []*fleetStorage
	workers []*fleetWorker
	ctrl    csi.ControllerClient
	ident   csi.IdentityClient // the controller's
	driver  *Driver            // the controller, for its metrics
	vols    []*fleetVol
	times   []string
	began   time.Time
}

// step runs fn bounded by d; a failure or an overrun fails the test
// naming the step. fn must not call t.Fatal (it runs on its own
// goroutine, so that a call stuck in the kernel cannot hang the test).
func (f *fleet) step(name string, d time.Duration, fn func(ctx context.Context) error) {
	f.t.Helper()
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			f.say("step %q failed after %.1fs: %v", name, time.Since(began).Seconds(), err)
			f.t.Fatalf("step %q failed after %.1fs: %v", name, time.Since(began).Seconds(), err)
		}
	case <-time.After(d + 15*time.Second):
		f.say("step %q not done within %v", name, d)
		f.t.Fatalf("step %q not done within %v", name, d)
	}
	s := fmt.Sprintf("%s %.1fs", name, time.Since(began).Seconds())
	f.times = append(f.times, s)
	f.t.Logf("step %s", s)
	f.say("step %s", s)
}

// say writes a line to the VM guest's console: a test stuck in the
// kernel (a device whose IO never ends) never gets to print its own
// output.
func (f *fleet) say(format string, args ...any) {
	if f.console != nil {
		fmt.Fprintf(f.console, "DETAIL csi-fleet: "+format+"\n", args...)
	}
}

// ipCmd runs iproute2's ip.
func (f *fleet) ipCmd(args ...string) error {
	if out, err := exec.Command(f.ip, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// TestFleetOnKernel is the fleet scenario of issue 34, driven through
// the CSI services over gRPC as the Kubernetes sidecars and the kubelet
// would: two storage nodes, two workers (network namespaces, each with
// its own rnbd-client and certificate), 20 volumes placed, published,
// staged and written with fio's verify; one moved from worker A to B
// with its data; a storage node killed (SIGKILL) under IO and started
// again, the IO resuming with its data intact; a mounted volume grown
// online; a snapshot restored into a new volume; one storage node
// stopped, then frozen, while the other keeps provisioning, staging and
// deleting, and its return (fleet_outage_kernel_test.go); all of it
// deleted, and then nothing left anywhere: no export, grant, volume or snapshot on
// the storage nodes, no file in their pools, no mapping, no mount, no
// nbd or ublk device.
func TestFleetOnKernel(t *testing.T) {
	needKernel(t)
	for _, tool := range []string{"fio", "mkfs.ext4", "resize2fs", "blkid"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is missing: the VM guest has it (test/vm/run.sh copies it)", tool)
		}
	}
	f := &fleet{t: t, r: &kernelRig{dir: t.TempDir(), bin: filepath.Dir(serverBin)}, began: time.Now()}
	if c, err := os.OpenFile("/dev/console", os.O_WRONLY, 0); err == nil && os.Getenv("RNBD_CSI_CONSOLE") == "1" {
		t.Cleanup(func() { c.Close() })
		f.console = c
	}
	f.dir = filepath.Join(f.r.dir, "kubelet")
	f.ip = os.Getenv("RNBD_CSI_IP")
	if f.ip == "" {
		f.ip = "ip"
	}
	if err := f.ipCmd("netns", "list"); err != nil {
		t.Fatalf("iproute2's ip with netns is needed (RNBD_CSI_IP names it): %v", err)
	}
	devsBefore := kernelDevices(t)

	f.setup()
	f.createVolumes()
	f.publishAll()
	f.fioAll()
	f.move()
	f.killStorageNode()
	f.expand()
	f.snapshotRestore()
	f.shared()
	f.storageOutage()
	f.deleteAll()
	f.nothingLeft(devsBefore)

	fmt.Printf("TPUT csi-fleet %d volumes, 2 restored, 1 shared and 5 made during node-b's outage, placed on 2 storage nodes (%d and %d), "+
		"2 workers: %.1fs in all; %s\n", fleetVolumes, f.storage[0].volumeCount, f.storage[1].volumeCount, time.Since(f.began).Seconds(),
		strings.Join(f.times, ", "))
}

// setup makes the PKI, the network (a dummy link with the storage
// nodes' fabric addresses; a namespace per worker, a veth pair into it),
// starts the storage nodes, the workers' rnbd-clients in their
// namespaces, the controller and the node services.
func (f *fleet) setup() {
	t := f.t
	pki := filepath.Join(f.r.dir, "pki")
	if err := os.Mkdir(pki, 0o700); err != nil {
		t.Fatal(err)
	}
	ca := testca.New(t, "rnbd fleet CA")
	caFile := ca.WriteCA(t, pki, "ca")

	// The network: worker i in a namespace of its own at 10.99.i.2,
	// behind a veth pair whose root end is 10.99.i.1, its default route
	// back through it. Storage node i listens on 10.99.i.1, which both
	// namespaces reach (it is the root namespace's). Made here, removed
	// when the test ends.
	for i, name := range []string{"worker-a", "worker-b"} {
		w := &fleetWorker{name: name, ns: "rnbd-fleet-" + name[len(name)-1:]}
		host, peer := fmt.Sprintf("rfl%d", i+1), fmt.Sprintf("rfl%dp", i+1)
		f.ipCmd("netns", "del", w.ns)
		if err := f.ipCmd("netns", "add", w.ns); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			// The veth pair goes with the namespace.
			if err := f.ipCmd("netns", "del", w.ns); err != nil {
				t.Error(err)
			}
		})
		sub := fmt.Sprintf("10.99.%d", i+1)
		for _, c := range [][]string{
			{"link", "add", host, "type", "veth", "peer", "name", peer},
			{"link", "set", peer, "netns", w.ns},
			{"addr", "add", sub + ".1/24", "dev", host},
			{"link", "set", host, "up"},
			{"-n", w.ns, "link", "set", "lo", "up"},
			{"-n", w.ns, "addr", "add", sub + ".2/24", "dev", peer},
			{"-n", w.ns, "link", "set", peer, "up"},
			{"-n", w.ns, "route", "add", "default", "via", sub + ".1"},
		} {
			if err := f.ipCmd(c...); err != nil {
				t.Fatal(err)
			}
		}
		f.workers = append(f.workers, w)
	}

	// The storage nodes.
	for i, name := range []string{"node-a", "node-b"} {
		s := &fleetStorage{name: name, addr: fmt.Sprintf("10.99.%d.1", i+1), dir: filepath.Join(f.r.dir, name),
			pool: testfs.ReflinkDir(t), port: 1261 + i, aport: 1271 + i}
		if err := os.Mkdir(s.dir, 0o700); err != nil {
			t.Fatal(err)
		}
		cert, key := testca.WriteCert(t, ca.Issue(t, name, "127.0.0.1", s.addr), pki, name)
		s.conf, s.sock = filepath.Join(s.dir, "server.toml"), filepath.Join(s.dir, "s.sock")
		// The admin listener's handshake deadline (2 s) is for a real
		// CPU: under TCG, with the guest busy formatting volumes, the
		// controller's own handshakes took longer (issue 40's outage
		// phase, first run).
		if err := os.WriteFile(s.conf, storageNodeConfig(s.addr, s.port, s.aport, s.dir, cert, key, caFile, s.pool,
			`handshake_timeout = "10s"`), 0o600); err != nil {
			t.Fatal(err)
		}
		s.ctl = ctl.Dial(s.sock)
		// Each in a zone of its own (a, b): the outage's creates ask
		// for node-a's, or for none, or prefer node-b's.
		s.cfg = StorageNode{Name: name, Admin: fmt.Sprintf("https://127.0.0.1:%d", s.aport), Paths: []string{"ip:" + s.addr},
			Port: s.port, Pool: "files", Labels: map[string]string{zoneKey: name[len(name)-1:]}}
		f.startStorage(s)
		f.storage = append(f.storage, s)
	}

	// The workers' rnbd-clients, each in its namespace with its
	// certificate; IO waits for a path up to three minutes (the storage
	// node killed and started again; node-b stopped, then frozen,
	// through the outage's steps, a minute or two each under TCG),
	// paths are retried each second.
	for _, w := range f.workers {
		cert, key := testca.WriteCert(t, ca.Issue(t, w.name), pki, w.name)
		wd := filepath.Join(f.r.dir, w.name)
		if err := os.Mkdir(wd, 0o700); err != nil {
			t.Fatal(err)
		}
		w.sock = filepath.Join(wd, "c.sock")
		f.r.run(t, w.name+"-rnbd-client", f.ip, "netns", "exec", w.ns, filepath.Join(f.r.bin, "rnbd-client"), "daemon",
			"--config", "/dev/null", "--control-socket", w.sock, "--state-file", filepath.Join(wd, "c.json"), "--socket-dir", wd,
			"--dev-links-dir", "", "--tls-cert", cert, "--tls-key", key, "--tls-ca", caFile, "--size-poll", "1s",
			"--hb-interval", "2s", "--hb-missed-max", "3", "--no-path-timeout", "3m", "--reconnect-delay", "500ms")
		w.client = ctl.Dial(w.sock)
		kit.WaitFor(t, 30*time.Second, w.name+"'s rnbd-client", func() bool {
			return w.client.Do(context.Background(), "GET", "/v1/devices", nil, nil) == nil
		})
	}

	// The controller, and a node service per worker, each on its own
	// socket, reached through gRPC as the sidecars reach them.
	cfg := DefaultConfig()
	for _, s := range f.storage {
		cfg.StorageNodes = append(cfg.StorageNodes, s.cfg)
	}
	ccert, ckey := testca.WriteCert(t, ca.Issue(t, "csi-controller"), pki, "csi-controller")
	cfg.TLS.Cert, cfg.TLS.Key, cfg.TLS.CA = ccert, ckey, caFile
	cfg.Workers = WorkersConfig{Source: WorkersList, Names: []string{"worker-a", "worker-b"}}
	// A storage node that does not answer costs a call fleetStorageTimeout
	// (the outage's bounds are made of it); copies of a name are looked
	// for every fleetReconcile.
	cfg.Controller.StorageTimeout = conf.Duration{Duration: fleetStorageTimeout}
	cfg.Controller.ReconcileInterval = conf.Duration{Duration: fleetReconcile}
	conn := f.serve(cfg, ModeController, "controller")
	f.ctrl, f.ident = csi.NewControllerClient(conn), csi.NewIdentityClient(conn)
	for _, w := range f.workers {
		nc := DefaultConfig()
		nc.Node.NodeID, nc.Node.ClientSocket = w.name, w.sock
		w.node = csi.NewNodeClient(f.serve(nc, ModeNode, w.name))
	}
	f.unstageAtEnd()
}

// unstageAtEnd makes sure that, whatever fails from here, nothing stays
// mounted or mapped once the daemons stop (a mount of a dead device
// hangs the test): a cleanup that runs before the daemons' own.
func (f *fleet) unstageAtEnd() {
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		for _, v := range f.vols {
			if v.w != nil {
				v.w.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target})
				v.w.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging})
			}
		}
	})
}

// startStorage starts (or starts again) a storage node and waits for
// its control socket. Its log goes on in one file, RNBD_CSI_LOGS/NAME.log
// (shown when the test fails); one cleanup, made at the first start,
// stops the process it has then: it runs after the volumes' (a storage
// node stopped before the workers unmount its volumes hangs them).
func (f *fleet) startStorage(s *fleetStorage) {
	t := f.t
	t.Helper()
	logs := os.Getenv("RNBD_CSI_LOGS")
	if logs == "" {
		logs = f.r.dir
	}
	logFile := filepath.Join(logs, s.name+".log")
	out, err := os.OpenFile(logFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(f.r.bin, "rnbd-server"), "daemon", "--config", s.conf)
	cmd.Env = append(os.Environ(), s.env...)
	cmd.SysProcAttr = diesWithTest()
	var w io.Writer = out
	if f.console != nil {
		w = io.MultiWriter(out, prefixed{f.console, s.name})
	}
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	first := s.cmd == nil
	if s.out != nil {
		s.out.Close()
	}
	s.cmd, s.out, s.down = cmd, out, false
	if first {
		t.Cleanup(func() {
			// A frozen one takes its SIGTERM once thawed.
			s.cmd.Process.Signal(unix.SIGCONT)
			s.cmd.Process.Signal(unix.SIGTERM)
			s.cmd.Wait()
			s.out.Close()
			if t.Failed() {
				b, _ := os.ReadFile(logFile)
				t.Logf("%s:\n%s", s.name, b)
			}
		})
	}
	kit.WaitFor(t, 60*time.Second, s.name+"'s control socket", func() bool {
		return s.ctl.Do(context.Background(), "GET", "/v1/pools", nil, nil) == nil
	})
}

// serve runs a driver of cfg in mode on a unix socket and returns a
// gRPC connection to it.
func (f *fleet) serve(cfg Config, mode Mode, name string) *grpc.ClientConn {
	t := f.t
	t.Helper()
	d, err := NewDriver(cfg, mode, log.Discard())
	if err != nil {
		t.Fatal(err)
	}
	if d.ctrl != nil {
		f.driver = d
		for _, n := range d.ctrl.nodes {
			kit.WaitFor(t, 30*time.Second, n.String()+"'s admin listener", func() bool {
				_, err := n.pools(context.Background())
				return err == nil
			})
		}
	}
	return serveDriver(t, d)
}

// createVolumes creates the volumes: two raw block ones, the rest ext4;
// half through /dev/nbdN, half through ublk (the nbd module's 16
// devices are not enough for all of them and the ones of the restore).
func (f *fleet) createVolumes() {
	f.step("create", 3*time.Minute, func(ctx context.Context) error {
		for i := range fleetVolumes {
			v := &fleetVol{name: fmt.Sprintf("fleet-%02d", i), frontend: "nbd", block: i < 2, size: fleetSize}
			if i%2 == 1 {
				v.frontend = "ublk"
			}
			mode := &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}
			v.vc = &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}}, AccessMode: mode}
			if v.block {
				v.vc = &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}, AccessMode: mode}
			}
			if err := f.create(ctx, v, nil); err != nil {
				return err
			}
		}
		for _, s := range f.storage {
			if s.volumeCount == 0 {
				return fmt.Errorf("no volume placed on %s: placement by free capacity should spread them (%d on %s)", s.name,
					fleetVolumes-s.volumeCount, f.other(s).name)
			}
		}
		return nil
	})
}

func (f *fleet) other(s *fleetStorage) *fleetStorage {
	if f.storage[0] == s {
		return f.storage[1]
	}
	return f.storage[0]
}

// create is CreateVolume of v (from a snapshot if src is set).
func (f *fleet) create(ctx context.Context, v *fleetVol, src *csi.VolumeContentSource) error {
	var cr *csi.CapacityRange // none: the source's size
	if v.size != 0 {
		cr = &csi.CapacityRange{RequiredBytes: v.size}
	}
	rsp, err := f.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: v.name, CapacityRange: cr,
		VolumeCapabilities: []*csi.VolumeCapability{v.vc}, Parameters: map[string]string{"frontend": v.frontend}, VolumeContentSource: src,
		AccessibilityRequirements: v.topo})
	if err != nil {
		return fmt.Errorf("CreateVolume %s: %w", v.name, err)
	}
	v.id, v.volCtx, v.size = rsp.Volume.VolumeId, rsp.Volume.VolumeContext, rsp.Volume.CapacityBytes
	v.storage, _, _ = strings.Cut(v.id, "/")
	for _, s := range f.storage {
		if s.name == v.storage {
			s.volumeCount++
		}
	}
	f.vols = append(f.vols, v)
	return nil
}

func (f *fleet) storageNode(name string) *fleetStorage {
	for _, s := range f.storage {
		if s.name == name {
			return s
		}
	}
	return nil
}

// publish is what the attacher and the kubelet do for a pod of w using
// v: ControllerPublishVolume, NodeStageVolume, NodePublishVolume.
func (f *fleet) publish(ctx context.Context, v *fleetVol, w *fleetWorker) error {
	pr, err := retryOn(ctx, func() (*csi.ControllerPublishVolumeResponse, error) {
		return f.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.id, NodeId: w.name,
			VolumeCapability: v.vc, VolumeContext: v.volCtx})
	}, codes.Aborted)
	if err != nil {
		return fmt.Errorf("ControllerPublishVolume %s to %s: %w", v.id, w.name, err)
	}
	v.w = w
	v.staging = filepath.Join(f.dir, w.name, "staging", v.name)
	v.target = filepath.Join(f.dir, w.name, "pods", v.name)
	if _, err := w.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
		VolumeCapability: v.vc, PublishContext: pr.PublishContext, VolumeContext: v.volCtx}); err != nil {
		return fmt.Errorf("NodeStageVolume %s on %s: %w", v.id, w.name, err)
	}
	if _, err := w.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging,
		TargetPath: v.target, VolumeCapability: v.vc, PublishContext: pr.PublishContext, VolumeContext: v.volCtx}); err != nil {
		return fmt.Errorf("NodePublishVolume %s on %s: %w", v.id, w.name, err)
	}
	return nil
}

// retryOn calls call again while it answers one of the codes, as the
// CO's sidecars do (Aborted: an operation on the volume in progress,
// such as the reconciler's round every reconcile_interval), until ctx
// ends.
func retryOn[T any](ctx context.Context, call func() (T, error), retry ...codes.Code) (T, error) {
	for {
		v, err := call()
		if err == nil || !slices.Contains(retry, status.Code(err)) {
			return v, err
		}
		select {
		case <-ctx.Done():
			return v, err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// unpublish undoes publish: NodeUnpublishVolume, NodeUnstageVolume,
// ControllerUnpublishVolume.
func (f *fleet) unpublish(ctx context.Context, v *fleetVol) error {
	w := v.w
	if _, err := w.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: v.target}); err != nil {
		return fmt.Errorf("NodeUnpublishVolume %s on %s: %w", v.id, w.name, err)
	}
	if _, err := w.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: v.staging}); err != nil {
		return fmt.Errorf("NodeUnstageVolume %s on %s: %w", v.id, w.name, err)
	}
	v.w = nil
	if _, err := retryOn(ctx, func() (*csi.ControllerUnpublishVolumeResponse, error) {
		return f.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.id, NodeId: w.name})
	}, codes.Aborted); err != nil {
		return fmt.Errorf("ControllerUnpublishVolume %s from %s: %w", v.id, w.name, err)
	}
	return nil
}

// publishAll publishes the volumes, split across the two workers, some
// at once as pods start.
func (f *fleet) publishAll() {
	f.step("publish", 5*time.Minute, func(ctx context.Context) error {
		return f.each(ctx, 4, f.vols, func(ctx context.Context, i int, v *fleetVol) error {
			return f.publish(ctx, v, f.workers[(i/2)%2])
		})
	})
}

// each runs fn on every volume, at most n at once; the first error.
func (f *fleet) each(ctx context.Context, n int, vols []*fleetVol, fn func(ctx context.Context, i int, v *fleetVol) error) error {
	sem := make(chan struct{}, n)
	var wg sync.WaitGroup
	errs := make([]error, len(vols))
	for i, v := range vols {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			errs[i] = fn(ctx, i, v)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// fio writes with verify in v: a file in a file system volume, the
// device of a raw block one.
func (f *fleet) fio(ctx context.Context, v *fleetVol, name string) error {
	file := v.target
	if !v.block {
		file = filepath.Join(v.target, name)
	}
	out, err := exec.CommandContext(ctx, "fio", "--name="+name, "--filename="+file, "--size=2M", "--bs=16k", "--rw=randwrite",
		"--direct=1", "--ioengine=psync", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--output-format=terse").CombinedOutput()
	if err != nil {
		return fmt.Errorf("fio verify in %s (%s on %s): %v\n%s", v.id, v.frontend, v.w.name, err, out)
	}
	return nil
}

func (f *fleet) fioAll() {
	// 20 volumes, 4 at a time: 75 s on a quiet host, more than 6 min
	// on one whose TCG runs at half that speed (2026-12-03).
	f.step("fio-verify", 10*time.Minute, func(ctx context.Context) error {
		return f.each(ctx, 4, f.vols, func(ctx context.Context, _ int, v *fleetVol) error { return f.fio(ctx, v, "fio-verify") })
	})
}

// pick is the first published file system volume that ok accepts.
func (f *fleet) pick(ok func(v *fleetVol) bool) *fleetVol {
	for _, v := range f.vols {
		if !v.block && v.w != nil && ok(v) {
			return v
		}
	}
	f.t.Fatal("no volume for the step")
	return nil
}

// writeFile writes n random bytes to path, synced, and returns their
// checksum.
func writeFile(path string, n int) ([sha256.Size]byte, error) {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	fd, err := os.Create(path)
	if err == nil {
		_, err = fd.Write(b)
		if err == nil {
			err = fd.Sync()
		}
		if err == nil {
			err = unix.Syncfs(int(fd.Fd()))
		}
		if cerr := fd.Close(); err == nil {
			err = cerr
		}
	}
	return sha256.Sum256(b), err
}

func sumFile(path string) ([sha256.Size]byte, error) {
	b, err := os.ReadFile(path)
	return sha256.Sum256(b), err
}

// move moves a volume of worker A to worker B, as when its pod is
// scheduled elsewhere; a file written on A is read on B.
func (f *fleet) move() {
	a, b := f.workers[0], f.workers[1]
	v := f.pick(func(v *fleetVol) bool { return v.w == a })
	f.step("move "+v.id, 3*time.Minute, func(ctx context.Context) error {
		want, err := writeFile(filepath.Join(v.target, "moved"), 1<<20)
		if err != nil {
			return err
		}
		if err := f.unpublish(ctx, v); err != nil {
			return err
		}
		if m := clientMappings(ctx, a); len(m) != fleetVolumes/2-1 {
			return fmt.Errorf("%s has %d mappings after the move, want %d", a.name, len(m), fleetVolumes/2-1)
		}
		if err := f.publish(ctx, v, b); err != nil {
			return err
		}
		got, err := sumFile(filepath.Join(v.target, "moved"))
		if err != nil || got != want {
			return fmt.Errorf("the file written on %s reads on %s as sha256 %x (%v), written %x", a.name, b.name, got, err, want)
		}
		return nil
	})
}

// clientMappings are a worker's rnbd-client devices (nil if it does not
// answer).
func clientMappings(ctx context.Context, w *fleetWorker) []output.Record {
	var recs []output.Record
	if err := w.client.Do(ctx, "GET", "/v1/devices", nil, &recs); err != nil {
		return nil
	}
	return recs
}

// killStorageNode kills (SIGKILL) the storage node of a mounted volume
// while a writer writes in it with O_DIRECT, and starts it again with
// its configuration and state file: the writes stall, then go on (the
// client reconnects), and every block reads back as last written.
func (f *fleet) killStorageNode() {
	s := f.storage[1]
	v := f.pick(func(v *fleetVol) bool { return v.storage == s.name })
	w := newBlockWriter(filepath.Join(v.target, "under-kill"))
	go w.run()
	// Not waited for: a write stuck in the kernel would hang the test
	// before it says anything.
	f.t.Cleanup(w.quitNoWait)
	var killedAt, reconnected int64
	sess := (&NodeServer{opts: NodeOptions{NodeID: v.w.name}}).sessName(s.name)
	f.step("kill -9 "+s.name+" under IO on "+v.id, time.Minute, func(ctx context.Context) error {
		if err := w.waitFor(ctx, 16); err != nil {
			return fmt.Errorf("before the kill: %w", err)
		}
		var err error
		if reconnected, err = reconnects(ctx, v.w, sess); err != nil {
			return err
		}
		if err := s.cmd.Process.Kill(); err != nil {
			return err
		}
		s.cmd.Wait()
		killedAt = w.count.Load()
		// Started again only once the client has seen its path go: the
		// IO waits for it meanwhile.
		for {
			if st, err := pathStates(ctx, v.w, sess); err == nil && !slices.Contains(st, "CONNECTED") {
				return nil
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("session %s of %s still has a path connected to the killed %s", sess, v.w.name, s.name)
			case <-time.After(50 * time.Millisecond):
			}
		}
	})
	// Started again, its log going on in the same file.
	began := time.Now()
	f.startStorage(s)
	f.times = append(f.times, fmt.Sprintf("restart %.1fs", time.Since(began).Seconds()))
	f.step("IO resumes on "+v.id, 3*time.Minute, func(ctx context.Context) error {
		if err := w.waitFor(ctx, killedAt+32); err != nil {
			return fmt.Errorf("after the restart (%d blocks written at the kill): %w", killedAt, err)
		}
		w.stop()
		if err := w.err(); err != nil {
			return err
		}
		// The client lost its path and made it again.
		if n, err := reconnects(ctx, v.w, sess); err != nil || n <= reconnected {
			return fmt.Errorf("session %s of %s: %d reconnects (%v), %d before the kill", sess, v.w.name, n, err, reconnected)
		}
		return w.verify()
	})
	// And the volume takes a whole fio verify after it.
	f.step("fio-verify after the restart", 2*time.Minute, func(ctx context.Context) error { return f.fio(ctx, v, "after-kill") })
}

// pathStates are the rtrs_state of the paths of session sess of w's
// rnbd-client.
func pathStates(ctx context.Context, w *fleetWorker, sess string) ([]string, error) {
	var paths []struct {
		State string `json:"rtrs_state"`
	}
	if err := w.client.Do(ctx, "GET", "/v1/paths?session="+sess, nil, &paths); err != nil {
		return nil, err
	}
	var st []string
	for _, p := range paths {
		st = append(st, p.State)
	}
	return st, nil
}

// reconnects are the successful reconnects of the paths of session sess
// of w's rnbd-client.
func reconnects(ctx context.Context, w *fleetWorker, sess string) (int64, error) {
	var paths []struct {
		Reconnects struct {
			Successful int64 `json:"successful"`
		} `json:"reconnects"`
	}
	if err := w.client.Do(ctx, "GET", "/v1/paths?session="+sess, nil, &paths); err != nil {
		return 0, fmt.Errorf("paths of %s on %s: %w", sess, w.name, err)
	}
	if len(paths) == 0 {
		return 0, fmt.Errorf("session %s on %s has no path", sess, w.name)
	}
	var n int64
	for _, p := range paths {
		n += p.Reconnects.Successful
	}
	return n, nil
}

// blockWriter writes 64 KiB blocks with O_DIRECT round the first slots
// of a file, each write a new generation, until stopped; verify reads
// every slot back against its last generation.
type blockWriter struct {
	path  string
	count atomic.Int64
	done  chan struct{}
	quit  chan struct{}
	once  sync.Once
	mu    sync.Mutex
	// +checklocks:mu
	failure error
	last    map[int]int64 // slot: generation last written
}

const (
	bwBlock = 64 << 10
	bwSlots = 64
)

func newBlockWriter(path string) *blockWriter {
	return &blockWriter{path: path, done: make(chan struct{}), quit: make(chan struct{}), last: map[int]int64{}}
}

// fill is generation g's content of a slot.
func bwFill(b []byte, g int64) {
	r := rand.New(rand.NewPCG(uint64(g), 0x726e6264))
	for i := 0; i < len(b); i += 8 {
		v := r.Uint64()
		for k := range 8 {
			b[i+k] = byte(v >> (8 * k))
		}
	}
}

func (w *blockWriter) run() {
	defer close(w.done)
	fail := func(err error) {
		w.mu.Lock()
		w.failure = err
		w.mu.Unlock()
	}
	// O_CLOEXEC: the storage node started again meanwhile would hold
	// the file, and its mount busy, for ever.
	fd, err := unix.Open(w.path, unix.O_RDWR|unix.O_CREAT|unix.O_DIRECT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		fail(err)
		return
	}
	defer unix.Close(fd)
	buf, err := unix.Mmap(-1, 0, bwBlock, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		fail(err)
		return
	}
	defer unix.Munmap(buf)
	for g := int64(0); ; g++ {
		select {
		case <-w.quit:
			fail(unix.Fsync(fd))
			return
		default:
		}
		slot := int(g % bwSlots)
		bwFill(buf, g)
		if _, err := unix.Pwrite(fd, buf, int64(slot)*bwBlock); err != nil {
			fail(fmt.Errorf("write %d (slot %d): %w", g, slot, err))
			return
		}
		w.mu.Lock()
		w.last[slot] = g
		w.mu.Unlock()
		w.count.Add(1)
	}
}

func (w *blockWriter) quitNoWait() { w.once.Do(func() { close(w.quit) }) }

func (w *blockWriter) stop() {
	w.once.Do(func() { close(w.quit) })
	<-w.done
}

func (w *blockWriter) err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.failure
}

// waitFor waits until n blocks are written (or the writer fails).
func (w *blockWriter) waitFor(ctx context.Context, n int64) error {
	for w.count.Load() < n {
		select {
		case <-w.done:
			if err := w.err(); err != nil {
				return err
			}
			return errors.New("the writer stopped")
		case <-ctx.Done():
			return fmt.Errorf("%d blocks written, waiting for %d: %w", w.count.Load(), n, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

// verify reads every slot back with O_DIRECT.
func (w *blockWriter) verify() error {
	fd, err := unix.Open(w.path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	buf, err := unix.Mmap(-1, 0, bwBlock, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return err
	}
	defer unix.Munmap(buf)
	want := make([]byte, bwBlock)
	for slot, g := range w.last {
		if _, err := unix.Pread(fd, buf, int64(slot)*bwBlock); err != nil {
			return fmt.Errorf("reading slot %d: %w", slot, err)
		}
		bwFill(want, g)
		if !bytes.Equal(buf, want) {
			return fmt.Errorf("slot %d does not hold generation %d, its last write", slot, g)
		}
	}
	return nil
}

// expand grows a mounted volume (on /dev/nbdN: ublk grows only from
// Linux 6.16) as the resizer and the kubelet do, and the file system
// grows.
func (f *fleet) expand() {
	v := f.pick(func(v *fleetVol) bool { return v.frontend == "nbd" })
	f.step("expand "+v.id, 2*time.Minute, func(ctx context.Context) error {
		var before unix.Statfs_t
		if err := unix.Statfs(v.target, &before); err != nil {
			return err
		}
		cr := &csi.CapacityRange{RequiredBytes: fleetGrown}
		rsp, err := f.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v.id, CapacityRange: cr, VolumeCapability: v.vc})
		if err != nil {
			return fmt.Errorf("ControllerExpandVolume: %w", err)
		}
		if rsp.CapacityBytes != fleetGrown || !rsp.NodeExpansionRequired {
			return fmt.Errorf("ControllerExpandVolume: %v, want %d bytes and node expansion", rsp, fleetGrown)
		}
		v.size = fleetGrown
		if _, err := v.w.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.id, VolumePath: v.target,
			StagingTargetPath: v.staging, CapacityRange: cr, VolumeCapability: v.vc}); err != nil {
			return fmt.Errorf("NodeExpandVolume: %w", err)
		}
		var after unix.Statfs_t
		if err := unix.Statfs(v.target, &after); err != nil {
			return err
		}
		if got, was := int64(after.Blocks)*after.Bsize, int64(before.Blocks)*before.Bsize; got <= was+fleetSize/2 {
			return fmt.Errorf("the file system has %d bytes after the expansion, %d before", got, was)
		}
		return nil
	})
}

// shared publishes a raw block volume of access mode
// MULTI_NODE_MULTI_WRITER on both workers at once (granted and mapped
// with RNBD's migration access, two writers at most): what one writes
// (O_DIRECT) the other reads, both ways; then the second is unpublished
// and the volume left to deleteAll.
func (f *fleet) shared() {
	f.step("shared by both workers", 2*time.Minute, func(ctx context.Context) error {
		vc := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER}}
		a := &fleetVol{name: "fleet-shared", frontend: "ublk", block: true, size: 16 << 20, vc: vc}
		if err := f.create(ctx, a, nil); err != nil {
			return err
		}
		b := *a
		if err := f.publish(ctx, a, f.workers[0]); err != nil {
			return err
		}
		if err := f.publish(ctx, &b, f.workers[1]); err != nil {
			return err
		}
		for i, p := range [][2]string{{a.target, b.target}, {b.target, a.target}} {
			if err := writeReadDirect(p[0], p[1], int64(i)<<20, int64(i)+1); err != nil {
				return err
			}
		}
		return f.unpublish(ctx, &b)
	})
}

// writeReadDirect writes a block of generation g at off through the
// device at from and reads it back through the one at to, both
// O_DIRECT (no page cache of either between them).
func writeReadDirect(from, to string, off, g int64) error {
	buf, err := unix.Mmap(-1, 0, 2*bwBlock, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return err
	}
	defer unix.Munmap(buf)
	w, r := buf[:bwBlock], buf[bwBlock:]
	bwFill(w, g)
	for _, io := range []struct {
		path string
		do   func(fd int) (int, error)
	}{
		{from, func(fd int) (int, error) { return unix.Pwrite(fd, w, off) }},
		{to, func(fd int) (int, error) { return unix.Pread(fd, r, off) }},
	} {
		fd, err := unix.Open(io.path, unix.O_RDWR|unix.O_DIRECT|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		n, err := io.do(fd)
		unix.Close(fd)
		if err != nil || n != bwBlock {
			return fmt.Errorf("%s at %d: %d bytes, %v", io.path, off, n, err)
		}
	}
	if !bytes.Equal(w, r) {
		return fmt.Errorf("written through %s at %d, read otherwise through %s", from, off, to)
	}
	return nil
}

// snapshotRestore snapshots a volume with a file in it, changes the
// file, restores the snapshot into a new volume, publishes that on the
// other worker: the file is as it was at the snapshot; so it is in the
// volume restored again 1 MiB larger than the snapshot, whose file
// system grows to it.
func (f *fleet) snapshotRestore() {
	v := f.pick(func(v *fleetVol) bool { return v.storage == f.storage[0].name })
	var snapID string
	f.step("snapshot "+v.id+" and restore", 3*time.Minute, func(ctx context.Context) error {
		want, err := writeFile(filepath.Join(v.target, "snapped"), 1<<20)
		if err != nil {
			return err
		}
		rsp, err := f.ctrl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: v.id, Name: "fleet-snap"})
		if err != nil {
			return fmt.Errorf("CreateSnapshot: %w", err)
		}
		snapID = rsp.Snapshot.SnapshotId
		f.t.Cleanup(func() {
			f.ctrl.DeleteSnapshot(context.Background(), &csi.DeleteSnapshotRequest{SnapshotId: snapID})
		})
		if !rsp.Snapshot.ReadyToUse {
			return fmt.Errorf("snapshot %s is not ready to use", snapID)
		}
		if _, err := writeFile(filepath.Join(v.target, "snapped"), 1<<20); err != nil {
			return err
		}
		// No capacity asked: the snapshot's size.
		r := &fleetVol{name: "fleet-restored", frontend: "nbd", vc: v.vc}
		if err := f.create(ctx, r, &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapID}}}); err != nil {
			return err
		}
		if r.size != rsp.Snapshot.SizeBytes {
			return fmt.Errorf("restored without a capacity asked: %d bytes, the snapshot %d", r.size, rsp.Snapshot.SizeBytes)
		}
		if r.storage != v.storage {
			return fmt.Errorf("restored on %s, its snapshot is on %s", r.storage, v.storage)
		}
		other := f.workers[0]
		if v.w == other {
			other = f.workers[1]
		}
		if err := f.publish(ctx, r, other); err != nil {
			return err
		}
		got, err := sumFile(filepath.Join(r.target, "snapped"))
		if err != nil || got != want {
			return fmt.Errorf("the restored volume's file has sha256 %x (%v), %x at the snapshot", got, err, want)
		}
		// Made again 1 MiB larger than the snapshot (the pool has room
		// for it once the first is deleted): the file system grown to
		// the volume at its stage, the file as it was.
		var was unix.Statfs_t
		if err := unix.Statfs(r.target, &was); err != nil {
			return err
		}
		if err := f.unpublish(ctx, r); err != nil {
			return err
		}
		if _, err := f.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: r.id}); err != nil {
			return fmt.Errorf("DeleteVolume %s: %w", r.id, err)
		}
		f.vols = slices.DeleteFunc(f.vols, func(x *fleetVol) bool { return x == r })
		big := &fleetVol{name: "fleet-restored-big", frontend: "nbd", vc: v.vc, size: rsp.Snapshot.SizeBytes + 1<<20}
		if err := f.create(ctx, big, &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapID}}}); err != nil {
			return err
		}
		if err := f.publish(ctx, big, other); err != nil {
			return err
		}
		if got, err := sumFile(filepath.Join(big.target, "snapped")); err != nil || got != want {
			return fmt.Errorf("the volume restored larger: its file has sha256 %x (%v), %x at the snapshot", got, err, want)
		}
		var st unix.Statfs_t
		if err := unix.Statfs(big.target, &st); err != nil || st.Blocks*uint64(st.Bsize) <= was.Blocks*uint64(was.Bsize) {
			return fmt.Errorf("the volume restored at %d bytes from a snapshot of %d: its file system has %d blocks of %d (%v), the one restored at its size %d: not grown",
				big.size, rsp.Snapshot.SizeBytes, st.Blocks, st.Bsize, err, was.Blocks)
		}
		return nil
	})
	f.step("delete snapshot", time.Minute, func(ctx context.Context) error {
		if _, err := f.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snapID}); err != nil {
			return fmt.Errorf("DeleteSnapshot %s: %w", snapID, err)
		}
		return nil
	})
}

// deleteAll unpublishes and deletes every volume, as when the pods and
// the claims go.
func (f *fleet) deleteAll() {
	f.step("unpublish and delete", 5*time.Minute, func(ctx context.Context) error {
		return f.each(ctx, 4, f.vols, func(ctx context.Context, _ int, v *fleetVol) error {
			if v.w != nil {
				if err := f.unpublish(ctx, v); err != nil {
					return err
				}
			}
			// Unpublished, the export has no grant left.
			_, export, _ := strings.Cut(v.id, "/")
			grants, err := api.NewServer(f.storageNode(v.storage).ctl).VolumeGrants(ctx, export)
			if err != nil {
				return fmt.Errorf("grants of %s: %w", v.id, err)
			} else if len(grants) != 0 {
				return fmt.Errorf("%s unpublished still has grants: %v", v.id, grants)
			}
			if _, err := f.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.id}); err != nil {
				return fmt.Errorf("DeleteVolume %s: %w", v.id, err)
			}
			return nil
		})
	})
}

// kernelDevices are the connected /dev/nbdN (those with a pid in
// sysfs) and the ublk devices.
func kernelDevices(t *testing.T) []string {
	t.Helper()
	var devs []string
	nbd, _ := filepath.Glob("/sys/block/nbd*/pid")
	for _, p := range nbd {
		devs = append(devs, filepath.Base(filepath.Dir(p)))
	}
	ublk, _ := filepath.Glob("/dev/ublk[bc]*")
	devs = append(devs, ublk...)
	slices.Sort(devs)
	return devs
}

// nothingLeft: no export, grant, volume, snapshot on either storage
// node; nothing but the pool's own bookkeeping (its empty .rnbd-tmp and
// .rnbd-snap) in their pools; no mapping in either rnbd-client; no
// mount under the test's kubelet directory; no nbd or ublk device the
// test began without.
func (f *fleet) nothingLeft(devsBefore []string) {
	f.step("nothing left", time.Minute, func(ctx context.Context) error {
		var errs []error
		for _, s := range f.storage {
			for _, what := range []string{"exports", "volumes", "snapshots"} {
				var recs []output.Record
				if err := s.ctl.Do(ctx, "GET", "/v1/"+what, nil, &recs); err != nil {
					errs = append(errs, fmt.Errorf("%s: listing %s: %w", s.name, what, err))
				} else if len(recs) != 0 {
					errs = append(errs, fmt.Errorf("%s: %d %s left: %v", s.name, len(recs), what, recs))
				}
			}
			// The grants are the exports' (their allow_identities): the
			// state file keeps no export nor volume either.
			var st struct {
				Exports []json.RawMessage `json:"exports"`
				Volumes []json.RawMessage `json:"volumes"`
			}
			if b, err := os.ReadFile(filepath.Join(s.dir, "s.json")); err != nil {
				errs = append(errs, err)
			} else if err := json.Unmarshal(b, &st); err != nil || len(st.Exports)+len(st.Volumes) != 0 {
				errs = append(errs, fmt.Errorf("%s: its state file keeps exports or volumes (%v): %s", s.name, err, b))
			}
			err := filepath.Walk(s.pool, func(path string, fi os.FileInfo, err error) error {
				if err != nil || path == s.pool {
					return err
				}
				rel, _ := filepath.Rel(s.pool, path)
				if fi.IsDir() && (rel == ".rnbd-tmp" || rel == ".rnbd-snap") {
					return nil
				}
				errs = append(errs, fmt.Errorf("%s: %s left in its pool", s.name, rel))
				return nil
			})
			if err != nil {
				errs = append(errs, err)
			}
		}
		for _, w := range f.workers {
			var recs []output.Record
			if err := w.client.Do(ctx, "GET", "/v1/devices", nil, &recs); err != nil {
				errs = append(errs, fmt.Errorf("%s: listing its mappings: %w", w.name, err))
			} else if len(recs) != 0 {
				errs = append(errs, fmt.Errorf("%s: %d mappings left: %v", w.name, len(recs), recs))
			}
		}
		mi, err := os.Open("/proc/self/mountinfo")
		if err != nil {
			return err
		}
		defer mi.Close()
		sc := bufio.NewScanner(mi)
		for sc.Scan() {
			if fs := strings.Fields(sc.Text()); len(fs) > 4 && strings.HasPrefix(fs[4], f.dir) {
				errs = append(errs, fmt.Errorf("still mounted: %s", sc.Text()))
			}
		}
		if devs := kernelDevices(f.t); !slices.Equal(devs, devsBefore) {
			errs = append(errs, fmt.Errorf("kernel devices %v, %v before the test", devs, devsBefore))
		}
		return errors.Join(errs...)
	})
}
