package csi

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/api"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testfs"
)

// serverBin and clientBin are rnbd-server and rnbd-client, built once
// for the package's tests.
var serverBin, clientBin string

func TestMain(m *testing.M) {
	if bin := os.Getenv("RNBD_BIN"); bin != "" {
		// The daemons built already (the VM tier's guest has no Go).
		serverBin, clientBin = filepath.Join(bin, "rnbd-server"), filepath.Join(bin, "rnbd-client")
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "rnbd-csi-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	serverBin, clientBin = filepath.Join(dir, "rnbd-server"), filepath.Join(dir, "rnbd-client")
	if out, err := exec.Command("go", "build", "-o", dir, "github.com/rnbd/rnbd/cmd/rnbd-server", "github.com/rnbd/rnbd/cmd/rnbd-client").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building rnbd-server and rnbd-client: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// rig is two storage nodes (rnbd-server with a dir pool and an admin
// listener whose provisioner is csi-controller) and the controller on a
// unix socket, called through a gRPC client.
type rig struct {
	t     *testing.T
	pki   string
	nodes []StorageNode
	procs map[string]*daemonProc // the storage nodes' processes, by name
	pools map[string]string      // their pools' directories, by name
	admin map[string]*ctl.Client
	d     *Driver
	cc    csi.ControllerClient
	id    csi.IdentityClient
}

func newRig(t *testing.T, labels ...map[string]string) *rig {
	return newRigWith(t, rigOptions{labels: labels})
}

// rigOptions change a rig: the storage nodes' topology labels, their
// environment (RNBD_TEST_CRASH_AT), the controller's configuration.
type rigOptions struct {
	labels []map[string]string
	// reflinks: the pools on a file system with reflinks (XFS on a loop
	// device: root), where snapshots and clones are made.
	reflinks bool
	env      map[string][]string // by storage node name
	edit     func(*Config)
	// nodes is how many storage nodes (node-a, node-b, ...): 2 where 0.
	nodes int
}

func newRigWith(t *testing.T, o rigOptions) *rig {
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("no openssl: scripts/test-ca.sh needs it")
	}
	dir := t.TempDir()
	r := &rig{t: t, pki: filepath.Join(dir, "pki"), admin: map[string]*ctl.Client{}, procs: map[string]*daemonProc{}, pools: map[string]string{}}
	names := []string{"node-a", "node-b"}
	for i := 2; i < o.nodes; i++ {
		names = append(names, "node-"+string(rune('a'+i)))
	}
	certs := [][]string{{"ca"}, {"admin", "csi-controller"}}
	for _, name := range names {
		certs = append(certs, []string{"server", name, "127.0.0.1"})
	}
	for _, args := range certs {
		if out, err := exec.Command("bash", append([]string{"../../scripts/test-ca.sh", r.pki}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("test-ca.sh %v: %v\n%s", args, err, out)
		}
	}
	ca := filepath.Join(r.pki, "ca.crt")
	for i, name := range names {
		pool := filepath.Join(dir, name, "pool")
		if err := os.MkdirAll(pool, 0o700); err != nil {
			t.Fatal(err)
		}
		if o.reflinks {
			pool = testfs.ReflinkDir(t)
		}
		sn, proc := startStorageNodeEnv(t, filepath.Join(dir, name), r.pki, name, pool, o.env[name])
		if i < len(o.labels) {
			sn.Labels = o.labels[i]
		}
		r.procs[name], r.pools[name] = proc, pool
		r.nodes = append(r.nodes, sn)
	}
	cfg := DefaultConfig()
	cfg.StorageNodes = r.nodes
	cfg.TLS.Cert, cfg.TLS.Key, cfg.TLS.CA = filepath.Join(r.pki, "csi-controller.crt"), filepath.Join(r.pki, "csi-controller.key"), ca
	cfg.Workers = WorkersConfig{Source: WorkersList, Names: []string{"host-1", "host-2", "h"}}
	if o.edit != nil {
		o.edit(&cfg)
	}
	d, err := NewDriver(cfg, ModeController, log.Discard())
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range d.ctrl.nodes {
		r.admin[n.cfg.Name] = n.c
		kit.WaitFor(t, 30*time.Second, n.String()+"'s admin listener", func() bool {
			_, err := n.pools(context.Background())
			return err == nil
		})
	}
	conn := serveDriver(t, d)
	r.d, r.cc, r.id = d, csi.NewControllerClient(conn), csi.NewIdentityClient(conn)
	return r
}

// serveDriver serves d on a unix socket until the test ends, and is a
// gRPC client of it, as the sidecars are.
func serveDriver(t *testing.T, d *Driver) *grpc.ClientConn {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "csi.sock")
	if _, err := d.Listen("unix://" + sock); err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- d.Serve() }()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		d.Stop()
		if err := <-served; err != nil {
			t.Error(err)
		}
	})
	return conn
}

// startStorageNode runs rnbd-server name (its certificate in pki, by
// scripts/test-ca.sh) with a dir pool "files" at pool and an admin
// listener whose provisioner is csi-controller, its files under nd; it
// is stopped when the test ends.
func startStorageNode(t *testing.T, nd, pki, name, pool string) StorageNode {
	t.Helper()
	sn, _ := startStorageNodeEnv(t, nd, pki, name, pool, nil)
	return sn
}

// startStorageNodeEnv is startStorageNode with env added to the
// daemon's environment; its process is returned, to stop, freeze and
// start again.
func startStorageNodeEnv(t *testing.T, nd, pki, name, pool string, env []string) (StorageNode, *daemonProc) {
	t.Helper()
	if err := os.MkdirAll(nd, 0o700); err != nil {
		t.Fatal(err)
	}
	port, aport := freePort(t), freePort(t)
	conf := filepath.Join(nd, "server.toml")
	if err := os.WriteFile(conf, storageNodeConfig("127.0.0.1", port, aport, nd, filepath.Join(pki, name+".crt"),
		filepath.Join(pki, name+".key"), filepath.Join(pki, "ca.crt"), pool), 0o600); err != nil {
		t.Fatal(err)
	}
	proc := &daemonProc{t: t, name: name, logFile: filepath.Join(nd, "log"), bin: serverBin, args: []string{"daemon", "--config", conf}, env: env}
	proc.start()
	t.Cleanup(proc.stop)
	return StorageNode{Name: name, Admin: fmt.Sprintf("https://127.0.0.1:%d", aport), Paths: []string{"ip:127.0.0.1"},
		Port: port, Pool: "files"}, proc
}

// storageNodeConfig is a storage node's server.toml: its fabric on
// addr:port, its admin listener on 127.0.0.1:aport with csi-controller
// its provisioner (and the lines of admin in its table), TLS with cert,
// key and ca, a dir pool "files" at pool, its control socket and state
// file in dir.
func storageNodeConfig(addr string, port, aport int, dir, cert, key, ca, pool string, admin ...string) []byte {
	return fmt.Appendf(nil, `listen = ["tcp://%s:%d"]
control_socket = %q
state_file = %q
[tls]
cert = %q
key = %q
ca = %q
[admin]
listen = ["127.0.0.1:%d"]
provisioners = ["csi-controller"]
%s[[pool]]
name = "files"
type = "dir"
path = %q
`, addr, port, filepath.Join(dir, "s.sock"), filepath.Join(dir, "s.json"), cert, key, ca, aport, lines(admin), pool)
}

// lines is each of ls on a line of its own.
func lines(ls []string) string {
	var b strings.Builder
	for _, l := range ls {
		b.WriteString(l + "\n")
	}
	return b.String()
}

// diesWithTest: a daemon a test starts is sent SIGTERM when the test
// process dies without its cleanups (Ginkgo exits the process on some
// errors; a test binary killed by its timeout), not left running with
// its ports and mounts.
func diesWithTest() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM} }

// startDaemon runs bin with args, its output in logFile (shown when the
// test fails), and interrupts it when the test ends.
func startDaemon(t *testing.T, name, logFile, bin string, args ...string) {
	t.Helper()
	p := &daemonProc{t: t, name: name, logFile: logFile, bin: bin, args: args}
	p.start()
	t.Cleanup(p.stop)
}

// daemonProc is a daemon a test runs, stops, freezes and starts again,
// by its PID; its output is appended to logFile, shown when the test
// fails.
type daemonProc struct {
	t             *testing.T
	name, logFile string
	bin           string
	args, env     []string
	cmd           *exec.Cmd
	out           *os.File
	frozen        bool
}

func (p *daemonProc) start() {
	p.t.Helper()
	out, err := os.OpenFile(p.logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		p.t.Fatal(err)
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Env = append(os.Environ(), p.env...)
	cmd.SysProcAttr = diesWithTest()
	if err := cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	p.cmd, p.out = cmd, out
}

// stop interrupts the daemon (a frozen one is thawed first) and waits
// for it; one that exited already (a crash point) is only reaped.
func (p *daemonProc) stop() {
	if p.cmd == nil {
		return
	}
	if p.frozen {
		p.thaw()
	}
	p.cmd.Process.Signal(os.Interrupt)
	p.cmd.Wait()
	p.out.Close()
	p.cmd = nil
	if p.t.Failed() {
		b, _ := os.ReadFile(p.logFile)
		p.t.Logf("%s:\n%s", p.name, b)
	}
}

// freeze stops the daemon where it is (SIGSTOP): its sockets stay open
// and answer nothing; thaw lets it go on (SIGCONT).
func (p *daemonProc) freeze() {
	p.t.Helper()
	p.cmd.Process.Signal(syscall.SIGSTOP)
	p.frozen = true
	kit.WaitFor(p.t, 10*time.Second, p.name+" stopped by SIGSTOP", func() bool { return stoppedBySignal(p.cmd.Process.Pid) })
}

// stoppedBySignal reports whether process pid is stopped (state T: a
// SIGSTOP took effect).
func stoppedBySignal(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	// "pid (comm) T ...": the state after the command's name.
	i := bytes.LastIndexByte(b, ')')
	return err == nil && i > 0 && i+2 < len(b) && b[i+2] == 'T'
}

func (p *daemonProc) thaw() {
	p.cmd.Process.Signal(syscall.SIGCONT)
	p.frozen = false
}

func mountCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
}

func blockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
}

var rwo = mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)

func (r *rig) create(name string, size int64, params map[string]string, ar *csi.TopologyRequirement) (*csi.Volume, error) {
	resp, err := r.cc.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: name,
		CapacityRange: &csi.CapacityRange{RequiredBytes: size}, VolumeCapabilities: []*csi.VolumeCapability{rwo},
		Parameters: params, AccessibilityRequirements: ar})
	return resp.GetVolume(), err
}

func (r *rig) mustCreate(name string, size int64, params map[string]string, ar *csi.TopologyRequirement) *csi.Volume {
	r.t.Helper()
	v, err := r.create(name, size, params, ar)
	if err != nil {
		r.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return v
}

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if status.Code(err) != want {
		t.Errorf("%s: %v, want %s", what, err, want)
	}
}

func (r *rig) grants(id string) map[string]string {
	r.t.Helper()
	node, name, _ := strings.Cut(id, "/")
	gs, err := api.NewServer(r.admin[node]).VolumeGrants(context.Background(), name)
	if err != nil {
		r.t.Fatal(err)
	}
	out := map[string]string{}
	for _, g := range gs {
		out[g.Identity] = g.Access
	}
	return out
}

// accessibility: the plugin reports VOLUME_ACCESSIBILITY_CONSTRAINTS.
func (r *rig) accessibility() bool {
	r.t.Helper()
	pc, err := r.id.GetPluginCapabilities(context.Background(), &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		r.t.Fatal("GetPluginCapabilities:", err)
	}
	for _, c := range pc.GetCapabilities() {
		if c.GetService().GetType() == csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS {
			return true
		}
	}
	return false
}

// TestController: create (a retry finds the volume; the name with
// another size is AlreadyExists), placement by free capacity, publish
// and unpublish as grants on the storage node, expansion, list pages,
// snapshots and clones, delete (twice).
func TestController(t *testing.T) {
	r := newRigWith(t, rigOptions{reflinks: true})
	ctx := context.Background()
	info, err := r.id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil || info.GetName() != DefaultDriverName {
		t.Fatalf("GetPluginInfo: %v %v", info, err)
	}
	if _, err := r.id.Probe(ctx, &csi.ProbeRequest{}); err != nil {
		t.Fatal("Probe:", err)
	}
	if r.accessibility() {
		t.Error("accessibility constraints reported where no storage node has topology labels")
	}

	v1 := r.mustCreate("pvc-1", 128<<20, map[string]string{"writeThrough": "true"}, nil)
	// replicas 1 is what a volume is: the same parameters.
	again := r.mustCreate("pvc-1", 128<<20, map[string]string{"writeThrough": "true", "replicas": "1"}, nil)
	if again.GetVolumeId() != v1.GetVolumeId() || again.GetCapacityBytes() != 128<<20 {
		t.Fatalf("a retry of CreateVolume: %v, first %v", again, v1)
	}
	_, err = r.create("pvc-1", 256<<20, map[string]string{"writeThrough": "true"}, nil)
	wantCode(t, "the name again with another size", err, codes.AlreadyExists)
	_, err = r.create("pvc-1", 128<<20, nil, nil)
	wantCode(t, "the name again with other parameters", err, codes.AlreadyExists)

	// The first took 128 MiB of its node's room (a sparse file promises
	// it): the second goes to the other node.
	v2 := r.mustCreate("pvc-2", 128<<20, nil, nil)
	n1, _, _ := strings.Cut(v1.GetVolumeId(), "/")
	n2, _, _ := strings.Cut(v2.GetVolumeId(), "/")
	if n1 == n2 {
		t.Errorf("two volumes on %s: placement by free capacity puts the second on the other node", n1)
	}

	// Publish: the node's identity granted, ro for a read-only publish.
	pub := func(id, node string, ro bool, vc *csi.VolumeCapability) (*csi.ControllerPublishVolumeResponse, error) {
		return r.cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node,
			VolumeCapability: vc, Readonly: ro, VolumeContext: v1.GetVolumeContext()})
	}
	resp, err := pub(v1.GetVolumeId(), "host-1", false, rwo)
	if err != nil {
		t.Fatal("ControllerPublishVolume:", err)
	}
	if resp.GetPublishContext()[PCExport] != "pvc-1" || resp.GetPublishContext()["paths"] != "ip:127.0.0.1" {
		t.Errorf("publish context %v", resp.GetPublishContext())
	}
	if g := r.grants(v1.GetVolumeId()); g["host-1"] != "rw" || len(g) != 1 {
		t.Errorf("grants after publish: %v", g)
	}
	if _, err := pub(v1.GetVolumeId(), "host-1", false, rwo); err != nil {
		t.Error("publish again:", err)
	}
	_, err = pub(v1.GetVolumeId(), "host-1", true, rwo)
	wantCode(t, "publish again read-only", err, codes.AlreadyExists)
	_, err = pub(v1.GetVolumeId(), "host-2", false, rwo)
	wantCode(t, "a single-node volume published to a second node", err, codes.FailedPrecondition)
	if _, err := pub(v2.GetVolumeId(), "host-2", true, mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY)); err != nil {
		t.Error("read-only publish:", err)
	}
	if g := r.grants(v2.GetVolumeId()); g["host-2"] != "ro" {
		t.Errorf("grants after a read-only publish: %v", g)
	}
	// Multi-node writers on raw block: RNBD's migration access for
	// each, two of them at most; a third is refused, a reader is not.
	mnmw := blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	shared := r.mustCreate("pvc-shared", 1<<20, nil, nil)
	for _, node := range []string{"host-1", "host-2", "host-2"} {
		resp, err := pub(shared.GetVolumeId(), node, false, mnmw)
		if err != nil || resp.GetPublishContext()[PCAccess] != "migration" {
			t.Fatalf("multi-node writer publish to %s: %v %v", node, resp, err)
		}
	}
	_, err = pub(shared.GetVolumeId(), "h", false, mnmw)
	wantCode(t, "a third multi-node writer", err, codes.FailedPrecondition)
	if resp, err := pub(shared.GetVolumeId(), "h", true, mnmw); err != nil || resp.GetPublishContext()[PCAccess] != "ro" {
		t.Errorf("a read-only publish beside two writers: %v %v", resp, err)
	}
	if g := r.grants(shared.GetVolumeId()); g["host-1"] != "migration" || g["host-2"] != "migration" || g["h"] != "ro" {
		t.Errorf("grants of the shared volume: %v", g)
	}
	if _, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: shared.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}

	// A node no worker has: NotFound, and nothing granted to it.
	if _, err := pub(v2.GetVolumeId(), "host-9", true, mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY)); status.Code(err) != codes.NotFound {
		t.Errorf("publish to an unknown node: %v, want NotFound", err)
	}
	if g := r.grants(v2.GetVolumeId()); g["host-9"] != "" {
		t.Errorf("an unknown node granted: %v", g)
	}
	for range 2 {
		if _, err := r.cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v1.GetVolumeId(), NodeId: "host-1"}); err != nil {
			t.Fatal("ControllerUnpublishVolume:", err)
		}
	}
	if g := r.grants(v1.GetVolumeId()); len(g) != 0 {
		t.Errorf("grants after unpublish: %v", g)
	}

	// Expand: grows; the same size again is success.
	for range 2 {
		ex, err := r.cc.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v1.GetVolumeId(),
			CapacityRange: &csi.CapacityRange{RequiredBytes: 256 << 20}, VolumeCapability: rwo})
		if err != nil || ex.GetCapacityBytes() != 256<<20 || !ex.GetNodeExpansionRequired() {
			t.Fatalf("ControllerExpandVolume: %v %v", ex, err)
		}
	}

	// Snapshot and a volume restored from it, on the same node (the
	// pools' XFS has reflinks: a dir pool makes no full copies).
	wantVolumes, cleanup := 2, []string{v1.GetVolumeId()}
	snap, err := r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-1", SourceVolumeId: v2.GetVolumeId()})
	switch {
	case err != nil:
		t.Fatal("CreateSnapshot:", err)
	default:
		if _, err := r.cc.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-1", SourceVolumeId: v2.GetVolumeId()}); err != nil {
			t.Error("CreateSnapshot again:", err)
		}
		restored, err := r.cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-3", CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{rwo}, VolumeContentSource: &csi.VolumeContentSource{
				Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}}})
		if err != nil {
			t.Fatal("CreateVolume from a snapshot:", err)
		}
		if n3, _, _ := strings.Cut(restored.GetVolume().GetVolumeId(), "/"); n3 != n2 {
			t.Errorf("restored on %s, its snapshot on %s", n3, n2)
		}
		ls, err := r.cc.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: v2.GetVolumeId()})
		if err != nil || len(ls.GetEntries()) != 1 {
			t.Errorf("ListSnapshots: %v %v", ls, err)
		}
		wantVolumes++
		cleanup = append(cleanup, restored.GetVolume().GetVolumeId())
		defer func() {
			for range 2 {
				if _, err := r.cc.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}); err != nil {
					t.Errorf("DeleteSnapshot: %v", err)
				}
			}
		}()
	}

	// List, a page at a time.
	var listed []string
	token := ""
	for i := 0; ; i++ {
		lv, err := r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: token})
		if err != nil {
			t.Fatal("ListVolumes:", err)
		}
		for _, e := range lv.GetEntries() {
			listed = append(listed, e.GetVolume().GetVolumeId())
		}
		if token = lv.GetNextToken(); token == "" || i > 5 {
			break
		}
	}
	if len(listed) != wantVolumes {
		t.Errorf("listed %v: want the %d volumes", listed, wantVolumes)
	}
	_, err = r.cc.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "bogus"})
	wantCode(t, "ListVolumes with a token not ours", err, codes.Aborted)

	for _, id := range cleanup {
		for range 2 {
			if _, err := r.cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Errorf("DeleteVolume %s: %v", id, err)
			}
		}
	}
	_, err = r.cc.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v1.GetVolumeId(),
		CapacityRange: &csi.CapacityRange{RequiredBytes: 384 << 20}})
	wantCode(t, "expanding a deleted volume", err, codes.NotFound)
}

// TestControllerTopology: a volume goes to a storage node of the
// topology asked; one no node is in is ResourceExhausted; capacity is
// per segment.
func TestControllerTopology(t *testing.T) {
	const zone = "topology.kubernetes.io/zone"
	r := newRig(t, map[string]string{zone: "a"}, map[string]string{zone: "b"})
	ctx := context.Background()
	seg := func(z string) *csi.Topology { return &csi.Topology{Segments: map[string]string{zone: z}} }
	if !r.accessibility() {
		t.Error("no accessibility constraints reported: the storage nodes have topology labels")
	}
	for _, z := range []string{"b", "a", "b"} {
		v := r.mustCreate("pvc-"+z+fmt.Sprint(time.Now().UnixNano()), 64<<20, nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{seg(z)}})
		if got := v.GetAccessibleTopology(); len(got) != 1 || got[0].GetSegments()[zone] != z {
			t.Errorf("a volume of zone %s: accessible from %v", z, got)
		}
	}
	// Preferred first, whatever the room.
	v := r.mustCreate("pvc-pref", 64<<20, nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{seg("a"), seg("b")},
		Preferred: []*csi.Topology{seg("b"), seg("a")}})
	if !strings.HasPrefix(v.GetVolumeId(), "node-b/") {
		t.Errorf("preferred zone b: %s", v.GetVolumeId())
	}
	_, err := r.create("pvc-c", 64<<20, nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{seg("c")}})
	wantCode(t, "a zone no storage node is in", err, codes.ResourceExhausted)
	all, err := r.cc.GetCapacity(ctx, &csi.GetCapacityRequest{})
	if err != nil {
		t.Fatal(err)
	}
	a, err := r.cc.GetCapacity(ctx, &csi.GetCapacityRequest{AccessibleTopology: seg("a")})
	if err != nil || a.GetAvailableCapacity() <= 0 || a.GetAvailableCapacity() >= all.GetAvailableCapacity() {
		t.Errorf("capacity of zone a %v, of all %v (%v)", a, all, err)
	}
}
