package csi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/api"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/test/kit"
)

// kernelRig is a storage node (rnbd-server with a directory pool, no
// TLS: its volumes open to any client) and a worker's rnbd-client, as
// processes, for the node service on a real kernel.
type kernelRig struct {
	dir, bin string
	port     int
	client   *exec.Cmd // the worker's rnbd-client
}

func (r *kernelRig) clientArgs() []string {
	return []string{"daemon", "--config", "/dev/null", "--control-socket", filepath.Join(r.dir, "c.sock"),
		"--state-file", filepath.Join(r.dir, "c.json"), "--socket-dir", r.dir, "--size-poll", "1s", "--mirror-leg-timeout", "2s", "--mirror-spare-after", "1s"}
}

// newKernelRig starts them, where the VM tier's csi part says the
// kernel has nbd and ublk (RNBD_CSI_KERNEL=1; RNBD_BIN, the directory
// of the daemons, read by TestMain); elsewhere the test is skipped: this
// machine's kernel has neither.
func newKernelRig(t *testing.T) *kernelRig {
	t.Helper()
	needKernel(t)
	r := &kernelRig{dir: t.TempDir(), bin: filepath.Dir(serverBin), port: 1250}
	r.start(t, "rnbd-server", "daemon", "--config", r.serverConfig(t, r.dir, r.port))
	r.client = r.start(t, "rnbd-client", r.clientArgs()...)
	for _, s := range []string{"s.sock", "c.sock"} {
		kit.WaitFor(t, 20*time.Second, s, func() bool { _, err := os.Stat(filepath.Join(r.dir, s)); return err == nil })
	}
	return r
}

// serverConfig writes the configuration of a storage node in dir
// listening on port: a directory pool "p", no TLS (its volumes open to
// any client), its control socket dir/s.sock.
func (r *kernelRig) serverConfig(t *testing.T, dir string, port int) string {
	t.Helper()
	pool := filepath.Join(dir, "pool")
	if err := os.MkdirAll(pool, 0o700); err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, "server.toml")
	err := os.WriteFile(conf, []byte(fmt.Sprintf("listen = [\"tcp://127.0.0.1:%d\"]\ncontrol_socket = %q\nstate_file = %q\n"+
		"[[pool]]\nname = \"p\"\ntype = \"dir\"\npath = %q\n", port, filepath.Join(dir, "s.sock"), filepath.Join(dir, "s.json"), pool)), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	return conf
}

// needKernel skips the test unless the VM tier runs it (RNBD_CSI_KERNEL=1):
// this machine's kernel has neither nbd nor ublk.
func needKernel(t *testing.T) {
	t.Helper()
	if os.Getenv("RNBD_CSI_KERNEL") != "1" {
		t.Skip("needs a kernel with nbd and ublk: the VM tier's csi part runs it (RNBD_CSI_KERNEL=1)")
	}
}

// start runs a daemon, its output in RNBD_CSI_LOGS/NAME.log (the VM
// guest shows them when the test hangs) or the test's directory.
func (r *kernelRig) start(t *testing.T, name string, args ...string) *exec.Cmd {
	t.Helper()
	return r.run(t, name, append([]string{filepath.Join(r.bin, name)}, args...)...)
}

// run runs argv as a daemon logging as name (a daemon started again
// under the same name appends to its log); stopped when the test ends.
func (r *kernelRig) run(t *testing.T, name string, argv ...string) *exec.Cmd {
	t.Helper()
	logs := os.Getenv("RNBD_CSI_LOGS")
	if logs == "" {
		logs = r.dir
	}
	out, err := os.OpenFile(filepath.Join(logs, name+".log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	var w io.Writer = out
	if c, err := os.OpenFile("/dev/console", os.O_WRONLY, 0); err == nil && os.Getenv("RNBD_CSI_CONSOLE") == "1" {
		// The VM guest's console too: a test stuck in the kernel
		// never gets to print them.
		t.Cleanup(func() { c.Close() })
		w = io.MultiWriter(out, prefixed{c, name})
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = diesWithTest()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil { // not waited for by a test that killed it
			cmd.Process.Signal(unix.SIGTERM)
			cmd.Wait()
		}
		out.Close()
		if t.Failed() {
			b, _ := os.ReadFile(out.Name())
			t.Logf("%s:\n%s", name, b)
		}
	})
	return cmd
}

// prefixed writes each write with its daemon's name before it.
type prefixed struct {
	w    io.Writer
	name string
}

func (p prefixed) Write(b []byte) (int, error) {
	if _, err := fmt.Fprintf(p.w, "DETAIL %s: %s", p.name, b); err != nil {
		return 0, err
	}
	return len(b), nil
}

// srv runs an rnbd-server command against the storage node.
func (r *kernelRig) srv(t *testing.T, args ...string) {
	t.Helper()
	r.srvIn(t, r.dir, args...)
}

// srvIn runs an rnbd-server command against the storage node of dir.
func (r *kernelRig) srvIn(t *testing.T, dir string, args ...string) {
	t.Helper()
	out, err := exec.Command(filepath.Join(r.bin, "rnbd-server"), append(args, "--socket", filepath.Join(dir, "s.sock"))...).CombinedOutput()
	if err != nil {
		t.Fatalf("rnbd-server %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func (r *kernelRig) node() *NodeServer {
	return NewNodeServer(NodeOptions{NodeID: "w1", ClientSocket: filepath.Join(r.dir, "c.sock"), Log: log.Discard()})
}

func (r *kernelRig) context(export, frontend string) map[string]string {
	return map[string]string{PCExport: export, PCStorageNode: "sn1", PCPaths: "ip:127.0.0.1", PCPort: fmt.Sprint(r.port), PCFrontend: frontend}
}

// mappings are the worker's rnbd-client devices.
func (r *kernelRig) mappings(t *testing.T, n *NodeServer) []api.CltDeviceRecord {
	t.Helper()
	recs, err := n.client.Devices(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return recs
}

// TestNodeOnKernel: a file system volume, through /dev/nbdN and
// through ublk, as the kubelet drives the node service: staged (mapped,
// formatted as it held nothing, mounted), staged again (success, nothing
// redone), published (a bind mount, written through), grown on the
// storage node and expanded (the file system grows, mounted), then
// unpublished and unstaged (nothing left: no mount, no mapping), each
// twice; staged again, the data is there (never formatted twice).
func TestNodeOnKernel(t *testing.T) {
	r := newKernelRig(t)
	for _, fe := range []string{"nbd", "ublk"} {
		t.Run(fe, func(t *testing.T) {
			vol := "fs-" + fe
			r.srv(t, "volume", "create", vol, "--pool", "p", "--size", "64MiB")
			n := r.node()
			ctx := context.Background()
			id := "sn1/" + vol
			staging, target := filepath.Join(r.dir, vol+"-staging"), filepath.Join(r.dir, vol+"-target")
			vc := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
			stage := &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: vc, PublishContext: r.context(vol, fe)}
			publish := &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: vc}
			// Whatever fails, nothing stays mounted or mapped once the
			// daemons stop (a mount of a dead device hangs the test).
			t.Cleanup(func() {
				n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
				n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			})
			for range 2 {
				if _, err := n.NodeStageVolume(ctx, stage); err != nil {
					t.Fatal(err)
				}
			}
			m := r.mappings(t, n)
			if len(m) != 1 || !strings.Contains(m[0].DevPath, map[string]string{"nbd": "/dev/nbd", "ublk": "/dev/ublkb"}[fe]) {
				t.Fatalf("mappings %v, want one %s device", m, fe)
			}
			if f, err := n.mounter.GetDiskFormat(m[0].DevPath); err != nil || f != "ext4" {
				t.Fatalf("the staged device holds %q (%v), want ext4", f, err)
			}
			for range 2 {
				if _, err := n.NodePublishVolume(ctx, publish); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.WriteFile(filepath.Join(target, "data"), []byte("kept"), 0o600); err != nil {
				t.Fatal(err)
			}
			st, err := n.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
			if err != nil || len(st.Usage) != 2 || st.Usage[0].Total <= 0 {
				t.Fatalf("stats %v %v", st, err)
			}
			h, err := n.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id})
			if err != nil || len(h.GetVolumeHealth().GetHealthStatuses()) != 0 {
				t.Fatalf("health %v %v, want healthy", h, err)
			}
			before := st.Usage[0].Total
			r.srv(t, "volume", "resize", vol, "--size", "128MiB")
			ex, err := n.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: target,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20}})
			if fe == "ublk" && !kernelAtLeast(6, 16) {
				// No UPDATE_SIZE before 6.16: refused, saying what to do.
				if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "6.16") {
					t.Fatalf("expand on ublk before 6.16: %v, want FailedPrecondition naming 6.16", err)
				}
			} else if err != nil || ex.CapacityBytes != 128<<20 {
				t.Fatalf("expand: %v %v", ex, err)
			}
			st, _ = n.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
			if err == nil && st.Usage[0].Total <= before {
				t.Fatalf("the file system did not grow: %d bytes, was %d", st.Usage[0].Total, before)
			}
			for range 2 {
				if _, err := n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
					t.Fatal(err)
				}
				if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
					t.Fatal(err)
				}
			}
			if m := r.mappings(t, n); len(m) != 0 {
				t.Fatalf("mappings left after unstage: %v", m)
			}
			if notMnt, _ := n.mounter.IsLikelyNotMountPoint(staging); !notMnt {
				t.Fatal("the staging path is still mounted")
			}
			// Staged again: the data is there, not formatted over.
			if _, err := n.NodeStageVolume(ctx, stage); err != nil {
				t.Fatal(err)
			}
			if b, err := os.ReadFile(filepath.Join(staging, "data")); err != nil || string(b) != "kept" {
				t.Fatalf("after a second stage: %q %v", b, err)
			}
			n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		})
	}
}

// kernelAtLeast reports whether the running kernel is major.minor or
// newer.
func kernelAtLeast(major, minor int) bool {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return false
	}
	var a, b int
	fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &a, &b)
	return a > major || a == major && b >= minor
}

// TestNodeBlockOnKernel: a raw block volume is staged (mapped, nothing
// formatted) and published as the device node bound on a file at the
// target, which writes reach; unpublish and unstage leave nothing.
func TestNodeBlockOnKernel(t *testing.T) {
	r := newKernelRig(t)
	r.srv(t, "volume", "create", "blk", "--pool", "p", "--size", "16MiB")
	n := r.node()
	ctx := context.Background()
	vc := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	staging, target := filepath.Join(r.dir, "blk-staging"), filepath.Join(r.dir, "blk-target")
	t.Cleanup(func() {
		n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "sn1/blk", TargetPath: target})
		n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "sn1/blk", StagingTargetPath: staging})
	})
	if _, err := n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "sn1/blk", StagingTargetPath: staging,
		VolumeCapability: vc, PublishContext: r.context("blk", "")}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "sn1/blk", StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: vc}); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(target, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("raw!"), 4096); err != nil {
		t.Fatal(err)
	}
	f.Sync()
	f.Close()
	if fi, err := os.Stat(target); err != nil || fi.Mode()&os.ModeDevice == 0 {
		t.Fatalf("the target %v (%v) is not the device node", fi, err)
	}
	if _, err := n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "sn1/blk", TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "sn1/blk", StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if m := r.mappings(t, n); len(m) != 0 {
		t.Fatalf("mappings left: %v", m)
	}
	// What was written reached the volume's file on the storage node.
	b := make([]byte, 4)
	vf, err := os.Open(filepath.Join(r.dir, "pool", "blk.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer vf.Close()
	if _, err := vf.ReadAt(b, 4096); err != nil || string(b) != "raw!" {
		t.Fatalf("the volume holds %q (%v)", b, err)
	}

	// The same volume asked for as a file system: it holds data blkid
	// knows no format of, so it is not formatted; the stage fails and
	// leaves no mapping, no mount, and the data as it was.
	fsStaging := filepath.Join(r.dir, "blk-fs-staging")
	t.Cleanup(func() {
		n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "sn1/blk", StagingTargetPath: fsStaging})
	})
	_, err = n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "sn1/blk", StagingTargetPath: fsStaging,
		VolumeCapability: mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), PublishContext: r.context("blk", "")})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "holds data at byte 4096") {
		t.Fatalf("staging a raw volume with data as ext4: %v, want FailedPrecondition naming byte 4096", err)
	}
	r.nothingStaged(t, n, fsStaging)
	if _, err := vf.ReadAt(b, 4096); err != nil || string(b) != "raw!" {
		t.Fatalf("after the refused stage the volume holds %q (%v)", b, err)
	}
}

// TestNodeReadOnlyOnKernel: a volume published read-only (the
// controller's access ro in the publish context, whatever the access
// mode) is mapped ro and mounted ro: its files are read, a write is
// refused (EROFS), and nothing is formatted; unstage leaves nothing.
func TestNodeReadOnlyOnKernel(t *testing.T) {
	r := newKernelRig(t)
	n := r.node()
	ctx := context.Background()
	r.srv(t, "volume", "create", "ro", "--pool", "p", "--size", "32MiB")
	staging := filepath.Join(r.dir, "ro-staging")
	t.Cleanup(func() {
		n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "sn1/ro", StagingTargetPath: staging})
	})
	req := &csi.NodeStageVolumeRequest{VolumeId: "sn1/ro", StagingTargetPath: staging,
		VolumeCapability: mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), PublishContext: r.context("ro", "nbd")}
	if _, err := n.NodeStageVolume(ctx, req); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(staging, "data"), []byte("written rw"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "sn1/ro", StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}

	req.PublishContext[PCAccess] = "ro"
	if _, err := n.NodeStageVolume(ctx, req); err != nil {
		t.Fatalf("staging read-only: %v", err)
	}
	if m := r.mappings(t, n); len(m) != 1 || m[0].AccessMode != "ro" {
		t.Fatalf("mappings %v, want one ro", m)
	}
	if b, err := os.ReadFile(filepath.Join(staging, "data")); err != nil || string(b) != "written rw" {
		t.Fatalf("read-only: %q %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(staging, "other"), []byte("x"), 0o600); !errors.Is(err, unix.EROFS) {
		t.Fatalf("a write to the read-only volume: %v, want EROFS", err)
	}
	if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "sn1/ro", StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	r.nothingStaged(t, n, staging)
}

// TestNodeFailedStageOnKernel: a stage whose mount fails (a mount
// option the file system refuses) undoes its mapping: no device, no
// mount left, on nbd and on ublk; a stage after it, with good options,
// works.
func TestNodeFailedStageOnKernel(t *testing.T) {
	r := newKernelRig(t)
	n := r.node()
	ctx := context.Background()
	for _, fe := range []string{"nbd", "ublk"} {
		vol := "bad-" + fe
		r.srv(t, "volume", "create", vol, "--pool", "p", "--size", "32MiB")
		staging := filepath.Join(r.dir, vol+"-staging")
		t.Cleanup(func() {
			n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "sn1/" + vol, StagingTargetPath: staging})
		})
		vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
		vc.GetMount().MountFlags = []string{"rnbd_no_such_option"}
		req := &csi.NodeStageVolumeRequest{VolumeId: "sn1/" + vol, StagingTargetPath: staging, VolumeCapability: vc, PublishContext: r.context(vol, fe)}
		if _, err := n.NodeStageVolume(ctx, req); status.Code(err) != codes.Internal {
			t.Fatalf("%s: a stage whose mount fails: %v, want Internal", fe, err)
		}
		r.nothingStaged(t, n, staging)
		req.VolumeCapability = mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
		if _, err := n.NodeStageVolume(ctx, req); err != nil {
			t.Fatalf("%s: staged after a failed stage: %v", fe, err)
		}
		if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "sn1/" + vol, StagingTargetPath: staging}); err != nil {
			t.Fatal(err)
		}
		r.nothingStaged(t, n, staging)
	}
}

// TestNodeRestartOnKernel: a worker whose rnbd-client dies (kill -9)
// and whose node plugin restarts with volumes staged: the restarted
// daemon takes its devices back (nbd's reconfigure, ublk's user
// recovery), the mounts stay and carry IO, a new node plugin's stage
// of the staged volume is success with nothing redone, and unstage
// leaves nothing.
func TestNodeRestartOnKernel(t *testing.T) {
	r := newKernelRig(t)
	n := r.node()
	ctx := context.Background()
	vc := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	stages := map[string]*csi.NodeStageVolumeRequest{}
	for _, fe := range []string{"nbd", "ublk"} {
		vol := "rs-" + fe
		r.srv(t, "volume", "create", vol, "--pool", "p", "--size", "32MiB")
		req := &csi.NodeStageVolumeRequest{VolumeId: "sn1/" + vol, StagingTargetPath: filepath.Join(r.dir, vol+"-staging"),
			VolumeCapability: vc, PublishContext: r.context(vol, fe)}
		stages[fe] = req
		t.Cleanup(func() {
			r.node().NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: req.VolumeId, StagingTargetPath: req.StagingTargetPath})
		})
		if _, err := n.NodeStageVolume(ctx, req); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(req.StagingTargetPath, "before"), []byte(fe), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	devices := r.mappings(t, n)

	r.client.Process.Kill()
	r.client.Wait()
	os.Remove(filepath.Join(r.dir, "c.sock"))
	r.client = r.start(t, "rnbd-client", r.clientArgs()...)
	kit.WaitFor(t, 20*time.Second, "the restarted rnbd-client's socket", func() bool {
		_, err := os.Stat(filepath.Join(r.dir, "c.sock"))
		return err == nil
	})
	n = r.node() // the node plugin restarted too: it keeps nothing
	for fe, req := range stages {
		if _, err := n.NodeStageVolume(ctx, req); err != nil {
			t.Fatalf("%s: staging a staged volume after the restarts: %v", fe, err)
		}
		// The mount carries IO through the restored device.
		p := filepath.Join(req.StagingTargetPath, "after")
		if err := os.WriteFile(p, []byte(fe), 0o600); err != nil {
			t.Fatalf("%s: writing after the restart: %v", fe, err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		err = f.Sync()
		f.Close()
		if err != nil {
			t.Fatalf("%s: fsync after the restart: %v", fe, err)
		}
		if b, err := os.ReadFile(filepath.Join(req.StagingTargetPath, "before")); err != nil || string(b) != fe {
			t.Fatalf("%s: the file written before: %q %v", fe, b, err)
		}
	}
	if after := r.mappings(t, n); len(after) != len(devices) {
		t.Fatalf("mappings before the restart %v, after %v", devices, after)
	} else {
		for i := range after {
			if after[i].DevPath != devices[i].DevPath {
				t.Fatalf("device %v came back as %v", devices[i].DevPath, after[i].DevPath)
			}
		}
	}
	for _, req := range stages {
		if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: req.VolumeId, StagingTargetPath: req.StagingTargetPath}); err != nil {
			t.Fatal(err)
		}
	}
	for _, req := range stages {
		r.nothingStaged(t, n, req.StagingTargetPath)
	}
}

// nothingStaged: the worker's daemon maps nothing and staging is not a
// mount point.
func (r *kernelRig) nothingStaged(t *testing.T, n *NodeServer, staging string) {
	t.Helper()
	if m := r.mappings(t, n); len(m) != 0 {
		t.Fatalf("mappings left: %v", m)
	}
	if notMnt, err := n.mounter.IsLikelyNotMountPoint(staging); err == nil && !notMnt {
		t.Fatalf("%s is still mounted", staging)
	}
}

// TestNodeReplicatedOnKernel: a replicated volume as the node service
// stages it from the publish context the controller gives (its legs on
// two storage nodes, its witness on a third): the first stage makes the
// mirror (create_if_new) and an ext4 on it; one leg's node killed (-9)
// under a write, which completes, the volume DEGRADED; the node back:
// the leg rejoins and is resynced, healthy again; unstaged and staged
// again, the mirror is assembled, not made anew, and the files are there.
func TestNodeReplicatedOnKernel(t *testing.T) {
	r := newKernelRig(t)
	ctx := context.Background()
	const vol = "rv"
	// sn1 is the rig's; sn2 and sn3 two more storage nodes.
	dirs := map[string]string{"sn1": r.dir}
	ports := map[string]int{"sn1": r.port}
	servers := map[string]*exec.Cmd{}
	for i, name := range []string{"sn2", "sn3", "sn4"} {
		dirs[name], ports[name] = filepath.Join(r.dir, name), r.port+1+i
		servers[name] = r.run(t, "rnbd-server-"+name, filepath.Join(r.bin, "rnbd-server"), "daemon", "--config", r.serverConfig(t, dirs[name], ports[name]))
		kit.WaitFor(t, 20*time.Second, name+"'s socket", func() bool { _, err := os.Stat(filepath.Join(dirs[name], "s.sock")); return err == nil })
	}
	r.srvIn(t, dirs["sn1"], "volume", "create", vol, "--pool", "p", "--size", "72MiB")
	r.srvIn(t, dirs["sn2"], "volume", "create", vol, "--pool", "p", "--size", "72MiB")
	r.srvIn(t, dirs["sn3"], "volume", "create", vol, "--pool", "p", "--size", "1MiB")
	leg := func(name string) string {
		return fmt.Sprintf(`{"storageNode":%q,"export":%q,"paths":["ip:127.0.0.1"],"port":%d}`, name, vol, ports[name])
	}
	pc := map[string]string{PCMirror: vol, PCLegs: "[" + leg("sn1") + "," + leg("sn2") + "]", PCWitness: leg("sn3"), PCAccess: accessRW, PCFrontend: "ublk"}
	id, staging := mirrorID(vol), filepath.Join(r.dir, "rv-staging")
	stage := &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, PublishContext: pc,
		VolumeCapability: mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)}
	n := r.node()
	t.Cleanup(func() {
		n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
	})
	health := func() []*csi.VolumeHealth_VolumeHealthEntry {
		t.Helper()
		h, err := n.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id})
		if err != nil {
			t.Fatal(err)
		}
		return h.GetVolumeHealth().GetHealthStatuses()
	}
	write := func(name string) {
		t.Helper()
		p := filepath.Join(staging, name)
		if err := os.WriteFile(p, []byte(name), 0o600); err != nil {
			t.Fatalf("writing %s: %v", name, err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := f.Sync(); err != nil {
			t.Fatalf("fsync of %s: %v", name, err)
		}
	}

	for range 2 {
		if _, err := n.NodeStageVolume(ctx, stage); err != nil {
			t.Fatal(err)
		}
	}
	m := r.mappings(t, n)
	if len(m) != 1 || m[0].Mirror != vol || m[0].State != "open" || m[0].Size != 64<<20 || len(m[0].Legs) != 3 {
		t.Fatalf("mappings %+v, want the mirror of two legs and a witness, 64 MiB, open", m)
	}
	write("first")
	if h := health(); len(h) != 0 {
		t.Fatalf("health %v, want healthy", h)
	}

	// Leg 1's node lost: the write completes on leg 0, the volume is
	// degraded.
	servers["sn2"].Process.Kill()
	servers["sn2"].Wait()
	write("second")
	if h := health(); len(h) != 1 || h[0].GetStatus() != csi.VolumeHealthErrorType_DEGRADED {
		t.Fatalf("health with a leg's node down %v, want DEGRADED", h)
	}
	// Back: rejoined and resynced while staged.
	servers["sn2"] = r.run(t, "rnbd-server-sn2", filepath.Join(r.bin, "rnbd-server"), "daemon", "--config", filepath.Join(dirs["sn2"], "server.toml"))
	kit.WaitFor(t, 90*time.Second, "the leg to rejoin and resync", func() bool { return len(health()) == 0 })

	for range 2 {
		if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
			t.Fatal(err)
		}
	}
	r.nothingStaged(t, n, staging)
	if h := health(); len(h) != 1 || h[0].GetStatus() != csi.VolumeHealthErrorType_INACCESSIBLE {
		t.Fatalf("health unstaged %v, want INACCESSIBLE (not mapped here)", h)
	}
	// Staged again, published with a spare (sn4, no volume there yet):
	// assembled from both legs, the files there.
	pc[PCSpares] = "[" + leg("sn4") + "]"
	if _, err := n.NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}
	readAll := func(names ...string) {
		t.Helper()
		for _, name := range names {
			if b, err := os.ReadFile(filepath.Join(staging, name)); err != nil || string(b) != name {
				t.Fatalf("%s: %q %v", name, b, err)
			}
		}
	}
	readAll("first", "second")

	// sn2 lost for good: the controller makes leg 1 anew on the spare
	// (here by hand, as its reconciler does once the node is gone for
	// mirror_replace_after); the worker's rnbd-client, the leg out for
	// its mirror_spare_after, takes it and rebuilds it in full under
	// IO, ext4 on it.
	servers["sn2"].Process.Kill()
	servers["sn2"].Wait()
	write("third")
	r.srvIn(t, dirs["sn4"], "volume", "create", vol, "--pool", "p", "--size", "72MiB")
	start := time.Now()
	kit.WaitFor(t, 2*time.Minute, "the spare to take leg 1's place and be rebuilt", func() bool {
		m := r.mappings(t, n)
		return len(health()) == 0 && len(m) == 1 && len(m[0].Legs) == 3 && strings.Contains(m[0].Legs[1].SessName, "sn4")
	})
	t.Logf("leg 1 replaced by the spare and rebuilt %v after its volume was made", time.Since(start))
	write("fourth")
	readAll("first", "second", "third", "fourth")
	if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	r.nothingStaged(t, n, staging)
	// Published again with the new placement (leg 1 on sn4), sn2 still
	// gone, as /dev/nbdN this time: assembled, every file there.
	pc[PCLegs], pc[PCSpares], pc[PCFrontend] = "["+leg("sn1")+","+leg("sn4")+"]", "", "nbd"
	if _, err := n.NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}
	readAll("first", "second", "third", "fourth")
	if h := health(); len(h) != 0 {
		t.Fatalf("health over the new placement %v, want healthy", h)
	}
	// Expanded: its legs grown on their storage nodes (what the
	// controller's ControllerExpandVolume does), then NodeExpandVolume
	// grows the mirror, the device and ext4 on it, mounted.
	r.srvIn(t, dirs["sn1"], "volume", "resize", vol, "--size", "104MiB")
	r.srvIn(t, dirs["sn4"], "volume", "resize", vol, "--size", "104MiB")
	ex, err := n.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: staging, CapacityRange: &csi.CapacityRange{RequiredBytes: 96 << 20}})
	if err != nil || ex.GetCapacityBytes() != 96<<20 {
		t.Fatalf("NodeExpandVolume: %v, %v", ex, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(staging, &st); err != nil || int64(st.Blocks)*int64(st.Bsize) < 80<<20 {
		t.Fatalf("ext4 after the expansion: %d blocks of %d (%v), want more than 80 MiB", st.Blocks, st.Bsize, err)
	}
	if m := r.mappings(t, n); len(m) != 1 || m[0].Size != 96<<20 {
		t.Fatalf("mappings after the expansion %+v, want 96 MiB", m)
	}
	write("fifth")
	readAll("first", "second", "third", "fourth", "fifth")
	if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	r.nothingStaged(t, n, staging)
}
