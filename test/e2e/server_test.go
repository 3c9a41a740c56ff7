package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/testfs"
)

// lockedBuffer collects a process's output while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	// +checklocks:mu
	b bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// serverDaemon is a real rnbd-server process on loopback.
type serverDaemon struct {
	t      *testing.T
	dir    string // its state file, control socket and config live here
	sock   string
	port   int
	cmd    *exec.Cmd
	out    *lockedBuffer
	done   chan error
	notify *net.UnixConn
}

// freePort finds a loopback port nobody listens on.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startServer runs rnbd-server daemon in dir and waits for its READY=1 on
// a notify socket of the test's, as systemd would.
func startServer(t *testing.T, dir string, port int, extra ...string) *serverDaemon {
	t.Helper()
	return startServerConf(t, dir, port, "", extra...)
}

// startServerConf is startServer with more of the configuration file
// (TOML after the suite's keys).
func startServerConf(t *testing.T, dir string, port int, moreConf string, extra ...string) *serverDaemon {
	t.Helper()
	return startServerEnv(t, dir, port, moreConf, nil, extra...)
}

// startServerEnv is startServerConf with more of the environment.
func startServerEnv(t *testing.T, dir string, port int, moreConf string, env []string, extra ...string) *serverDaemon {
	t.Helper()
	d := &serverDaemon{t: t, dir: dir, sock: filepath.Join(dir, "server.sock"), port: port,
		out: &lockedBuffer{}, done: make(chan error, 1)}
	notifyPath := filepath.Join(dir, "notify.sock")
	os.Remove(notifyPath)
	var err error
	d.notify, err = net.ListenUnixgram("unixgram", &net.UnixAddr{Name: notifyPath, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	// The configuration file sets most; flags override it.
	conf := filepath.Join(dir, "server.toml")
	err = os.WriteFile(conf, []byte(fmt.Sprintf(`version = 1
listen = ["tcp://127.0.0.1:%d"]
queue_depth = 128
max_chunk_memory = "1GiB"
hb_interval = "1s"
control_socket = %q
state_file = %q
log_level = "debug"
`, port, d.sock, filepath.Join(dir, "state.json"))+moreConf), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{"daemon", "--config", conf, "--hb-missed-max", "10"}, tlsFlags("srv", extra...)...), extra...)
	d.cmd = exec.Command(bin("rnbd-server"), args...)
	d.cmd.Env = append(append(os.Environ(), "NOTIFY_SOCKET="+notifyPath), env...)
	d.cmd.Stdout, d.cmd.Stderr = d.out, d.out
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.done <- d.cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case <-d.done:
		default:
			d.cmd.Process.Kill()
			<-d.done
		}
		d.notify.Close()
		if t.Failed() {
			t.Logf("rnbd-server output:\n%s", d.out.String())
		}
	})
	if got := d.waitNotify(); got != "READY=1" {
		t.Fatalf("first notification %q, want READY=1", got)
	}
	if tlsFlags("srv", extra...) != nil {
		// Its start-up line says so (the output may trail READY=1).
		deadline := time.Now().Add(10 * time.Second)
		for !strings.Contains(d.out.String(), "tls=true") {
			if time.Now().After(deadline) {
				t.Fatalf("the suite runs with TLS, but the server does not:\n%s", d.out.String())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return d
}

func (d *serverDaemon) waitNotify() string {
	d.t.Helper()
	buf := make([]byte, 256)
	deadline := time.Now().Add(30 * time.Second)
	for {
		d.notify.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		n, err := d.notify.Read(buf)
		if err == nil {
			return string(buf[:n])
		}
		select {
		case err := <-d.done:
			d.done <- err
			d.t.Fatalf("rnbd-server exited (%v) instead of notifying\n%s", err, d.out.String())
		default:
		}
		if time.Now().After(deadline) {
			d.t.Fatalf("waiting for sd_notify: %v\n%s", err, d.out.String())
		}
	}
}

// stop sends SIGTERM and expects STOPPING=1 and a clean exit.
func (d *serverDaemon) stop() {
	d.t.Helper()
	d.cmd.Process.Signal(syscall.SIGTERM)
	if got := d.waitNotify(); got != "STOPPING=1" {
		d.t.Fatalf("notification on SIGTERM %q, want STOPPING=1", got)
	}
	select {
	case err := <-d.done:
		d.done <- err
		if err != nil {
			d.t.Fatalf("rnbd-server exited with %v\n%s", err, d.out.String())
		}
	case <-time.After(30 * time.Second):
		d.t.Fatalf("rnbd-server did not exit after SIGTERM\n%s", d.out.String())
	}
}

// ctl runs a control command against the daemon and returns its output
// and exit code.
func (d *serverDaemon) ctl(args ...string) (string, string, int) {
	d.t.Helper()
	cmd := exec.Command(bin("rnbd-server"), append(args, "--socket", d.sock)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		d.t.Fatalf("rnbd-server %v: %v", args, err)
	}
	return stdout.String(), stderr.String(), code
}

// ok runs a control command that must succeed.
func (d *serverDaemon) ok(args ...string) string {
	d.t.Helper()
	out, errOut, code := d.ctl(args...)
	if code != 0 {
		d.t.Fatalf("rnbd-server %s: exit %d: %s", strings.Join(args, " "), code, errOut)
	}
	return out
}

// fails runs a control command that must fail with code and one line.
func (d *serverDaemon) fails(code int, args ...string) string {
	d.t.Helper()
	out, errOut, got := d.ctl(args...)
	if got != code {
		d.t.Fatalf("rnbd-server %s: exit %d (%s%s), want %d", strings.Join(args, " "), got, out, errOut, code)
	}
	if lines := strings.Count(strings.TrimRight(errOut, "\n"), "\n"); lines != 0 || !strings.HasPrefix(errOut, "rnbd-server: ") {
		d.t.Fatalf("rnbd-server %s: error output is not one line: %q", strings.Join(args, " "), errOut)
	}
	return errOut
}

// records runs a list command with --format json and decodes it.
func (d *serverDaemon) records(args ...string) []map[string]any {
	d.t.Helper()
	out := d.ok(append(args, "--format", "json")...)
	var recs []map[string]any
	if err := json.Unmarshal([]byte(out), &recs); err != nil {
		d.t.Fatalf("rnbd-server %s --format json: %v\n%s", strings.Join(args, " "), err, out)
	}
	return recs
}

// written is what session sess has written to device dev (device
// list's rx_sect, in sectors), 0 while it has not opened it.
func (d *serverDaemon) written(dev, sess string) float64 {
	d.t.Helper()
	for _, r := range d.records("device", "list", "--fields", "devname,sessname,rx_sect") {
		if r["devname"] == dev && r["sessname"] == sess {
			n, _ := r["rx_sect"].(float64)
			return n
		}
	}
	return 0
}

// waitWritten waits until session sess has written n more 4 KiB blocks
// to device dev than when it was called: a load started just before is
// under way.
func (d *serverDaemon) waitWritten(dev, sess string, n int) {
	d.t.Helper()
	want := d.written(dev, sess) + float64(n*8)
	kit.WaitFor(d.t, time.Minute, fmt.Sprintf("%s to write %d blocks to %s", sess, n, dev), func() bool {
		return d.written(dev, sess) >= want
	})
}

// client dials an RNBD client session to the daemon.
func (d *serverDaemon) client(sessname string, paths int) *rnbd.CltSession {
	d.t.Helper()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName = sessname
	var tc *tls.Config
	if suitePKI != "" {
		var err error
		tc, err = conf.TLS{Cert: filepath.Join(suitePKI, "e2e-client.crt"), Key: filepath.Join(suitePKI, "e2e-client.key"),
			CA: filepath.Join(suitePKI, "ca.crt")}.Config()
		if err != nil {
			d.t.Fatal(err)
		}
	}
	cfg.Fabric = tcp.New(tcp.Options{TLS: tc})
	cfg.ConnsPerPath = 2
	cfg.Log = log.Discard()
	dst := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(d.port))
	for i := 0; i < paths; i++ {
		src := netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, byte(2 + i)}), 0)
		cfg.Paths = append(cfg.Paths, rtrs.PathAddr{Src: src, Dst: dst})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := rnbd.DialSession(ctx, cfg, 0)
	if err != nil {
		d.t.Fatalf("session %s: %v", sessname, err)
	}
	c.SetSizePoll(0) // the tests count the server's requests exactly
	d.t.Cleanup(func() { c.Close() })
	return c
}

// randPool is random bytes that writes take their data from.
var randPool = func() []byte {
	b := make([]byte, 4<<20)
	r := rand.NewChaCha8([32]byte{42})
	r.Read(b)
	return b
}()

// worker drives one region of a device with mixed IO and checks every
// read against a model of the region.
type worker struct {
	t     *testing.T
	dev   *rnbd.CltDev
	buf   *rtrs.Buffer
	base  int64
	model []byte
	rng   *rand.Rand
	moved int64 // bytes read and written
	ops   map[string]int
}

func (w *worker) do(op rnbd.Op, flags uint32, off int64, n int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return w.dev.Do(ctx, op, flags, w.base+off, n, w.buf, 0)
}

func (w *worker) verify(off int64, n int) error {
	if err := w.do(rnbd.OpRead, 0, off, n); err != nil {
		return fmt.Errorf("read %d at %d: %w", n, w.base+off, err)
	}
	if !bytes.Equal(w.buf.Bytes()[:n], w.model[off:off+int64(n)]) {
		return fmt.Errorf("read %d at %d: data differs from what was written", n, w.base+off)
	}
	w.moved += int64(n)
	return nil
}

func (w *worker) step(maxIO int) error {
	const blk = 4096
	n := (1 + w.rng.IntN(maxIO/blk)) * blk
	off := int64(w.rng.IntN((len(w.model)-n)/blk+1)) * blk
	switch r := w.rng.IntN(100); {
	case r < 45: // write, some with FUA or PREFLUSH
		flags := uint32(0)
		switch w.rng.IntN(10) {
		case 0:
			flags = rnbd.FFUA
		case 1:
			flags = rnbd.FPreflush
		}
		// Random data from a pool at a random offset: cheap, and
		// different for every write.
		b := w.buf.Bytes()[:n]
		copy(b, randPool[w.rng.IntN(len(randPool)-n):])
		if err := w.do(rnbd.OpWrite, flags, off, n); err != nil {
			return fmt.Errorf("write %d at %d: %w", n, w.base+off, err)
		}
		copy(w.model[off:], b)
		w.moved += int64(n)
		w.ops["write"]++
	case r < 85:
		w.ops["read"]++
		return w.verify(off, n)
	case r < 91:
		if err := w.do(rnbd.OpWriteZeroes, 0, off, n); err != nil {
			return fmt.Errorf("write zeroes %d at %d: %w", n, w.base+off, err)
		}
		clear(w.model[off : off+int64(n)])
		w.ops["write_zeroes"]++
	case r < 97:
		if err := w.do(rnbd.OpDiscard, 0, off, n); err != nil {
			return fmt.Errorf("discard %d at %d: %w", n, w.base+off, err)
		}
		clear(w.model[off : off+int64(n)]) // a file's punched hole reads zeroes
		w.ops["discard"]++
	default:
		if err := w.do(rnbd.OpFlush, 0, 0, 0); err != nil {
			return fmt.Errorf("flush: %w", err)
		}
		w.ops["flush"]++
	}
	return nil
}

// TestServerEndToEnd runs the real rnbd-server binary and drives it with
// the Go RTRS+RNBD client: an export mapped with the control command, 1
// GiB of mixed verified IO over two paths, the control commands' JSON
// while it is open, unmap with and without --force, force close, and a
// restart that keeps the export.
func TestServerEndToEnd(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "disk0.img")
	const size = 256 << 20
	kit.SparseFile(t, img, size)
	port := freePort(t)
	d := startServer(t, dir, port)

	out := d.ok("map", "disk0", img)
	if !strings.Contains(out, "disk0") {
		t.Fatalf("map output %q", out)
	}
	d.fails(4, "map", "disk0", img) // already exists
	d.fails(3, "unmap", "nothere")  // not found
	recs := d.records("device", "list")
	if len(recs) != 1 || recs[0]["devname"] != "disk0" || recs[0]["state"] != "exported" {
		t.Fatalf("device list before open: %v", recs)
	}

	c := d.client("e2e-sess", 2)
	dev, err := c.Map(context.Background(), "disk0", rnbd.AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	if dev.Size() != size {
		t.Fatalf("device size %d, want %d", dev.Size(), size)
	}
	maxIO := min(int(dev.Info().MaxHWSectors)*512, c.Session().MaxIOSize())
	if maxIO < 4096 {
		t.Fatalf("max IO %d", maxIO)
	}

	// 1 GiB of mixed IO: four workers, each on its own quarter.
	const workers = 4
	var wg sync.WaitGroup
	ws := make([]*worker, workers)
	errs := make(chan error, workers)
	start := time.Now()
	for i := range ws {
		buf, err := c.Session().AllocBuffer(maxIO)
		if err != nil {
			t.Fatal(err)
		}
		ws[i] = &worker{t: t, dev: dev, buf: buf, base: int64(i) * size / workers,
			model: make([]byte, size/workers), rng: rand.New(rand.NewPCG(uint64(i), 42)), ops: map[string]int{}}
		wg.Add(1)
		go func(w *worker) {
			defer wg.Done()
			for w.moved < (1<<30)/workers {
				if err := w.step(maxIO); err != nil {
					errs <- err
					return
				}
			}
		}(ws[i])
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var moved int64
	ops := map[string]int{}
	for _, w := range ws {
		moved += w.moved
		for k, v := range w.ops {
			ops[k] += v
		}
	}
	el := time.Since(start)
	t.Logf("mixed IO: %d MiB in %v (%.0f MiB/s), ops %v", moved>>20, el.Round(time.Millisecond), float64(moved)/(1<<20)/el.Seconds(), ops)

	// The control commands see the session, its two paths and the device.
	sess := d.records("session", "list")
	if len(sess) != 1 || sess[0]["sessname"] != "e2e-sess" || sess[0]["state"] != "connected" ||
		sess[0]["path_uu"] != "UU" || sess[0]["devices"] != float64(1) {
		t.Fatalf("session list: %v", sess)
	}
	paths := d.records("path", "list", "--fields", "all")
	if len(paths) != 2 {
		t.Fatalf("path list: %v", paths)
	}
	for _, p := range paths {
		if p["state"] != "connected" || p["sessname"] != "e2e-sess" || p["dst_addr"] != "ip:127.0.0.1" {
			t.Fatalf("path: %v", p)
		}
	}
	devs := d.records("device", "show", "disk0")
	if len(devs) != 1 || devs[0]["sessname"] != "e2e-sess" || devs[0]["access_mode"] != "rw" ||
		devs[0]["state"] != "open" || devs[0]["devpath"] != img {
		t.Fatalf("device show: %v", devs)
	}
	if devs[0]["rx_sect"].(float64) == 0 || devs[0]["tx_sect"].(float64) == 0 {
		t.Fatalf("device show counts no IO: %v", devs)
	}
	stats := d.records("stats")
	var rdma []any
	for _, s := range stats {
		rdma = append(rdma, s["rdma"])
		// The server's stats/rdma of newest kernels, by name: rd_cnt
		// rd_bytes wr_cnt wr_bytes (inflight is a field of its own).
		if r, _ := s["rdma"].(map[string]any); len(r) != 4 || r["rd_cnt"] == float64(0) || r["wr_cnt"] == float64(0) || r["wr_bytes"] == nil {
			t.Fatalf("stats rdma %v: want four counters, IO counted", s["rdma"])
		}
	}
	if len(stats) != 2 {
		t.Fatalf("stats: %v", stats)
	}
	d.ok("stats", "--reset")
	for _, s := range d.records("stats") {
		if r, _ := s["rdma"].(map[string]any); r["rd_cnt"] != float64(0) || r["wr_cnt"] != float64(0) {
			t.Fatalf("stats after reset: %v (before: %v)", s["rdma"], rdma)
		}
	}
	// csv and xml carry the same records.
	if out := d.ok("session", "list", "--format", "csv"); !strings.HasPrefix(out, "sessname,") || !strings.Contains(out, "e2e-sess") {
		t.Fatalf("csv: %q", out)
	}
	if out := d.ok("path", "list", "--format", "xml"); !strings.Contains(out, "<paths>") || strings.Count(out, "<path>") != 2 {
		t.Fatalf("xml: %q", out)
	}

	// Unmap refuses while the device is open.
	d.fails(5, "unmap", "disk0")

	// Everything written is there: read the whole device back, then
	// close it and compare the file itself.
	for _, w := range ws {
		for off := 0; off < len(w.model); off += maxIO {
			if err := w.verify(int64(off), min(maxIO, len(w.model)-off)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := dev.Unmap(context.Background()); err != nil {
		t.Fatal(err)
	}
	onDisk, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	for i, w := range ws {
		if !bytes.Equal(onDisk[w.base:w.base+int64(len(w.model))], w.model) {
			t.Fatalf("the backing file's quarter %d differs from what was written", i)
		}
	}
	if recs := d.records("device", "list"); len(recs) != 1 || recs[0]["state"] != "exported" {
		t.Fatalf("device list after close: %v", recs)
	}

	// Force close: the session's IO on the device then fails ENOTCONN.
	dev, err = c.Map(context.Background(), "disk0", rnbd.AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	ws[0].dev = dev
	d.fails(3, "device", "close", "disk0", "--session", "other-sess")
	if out := d.ok("device", "close", "disk0", "--session", "e2e-sess"); !strings.Contains(out, "1 session") {
		t.Fatalf("device close: %q", out)
	}
	if err := ws[0].do(rnbd.OpRead, 0, 0, 4096); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("IO after force close: %v, want ENOTCONN", err)
	}

	// unmap --force withdraws an export a session has open.
	img1 := filepath.Join(dir, "disk1.img")
	kit.SparseFile(t, img1, 16<<20)
	d.ok("map", "disk1", img1, "--ro", "--allow", "e2e-sess")
	if _, err := c.Map(context.Background(), "disk1", rnbd.AccessRW); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("rw open of a read-only export: %v, want EROFS", err)
	}
	dev1, err := c.Map(context.Background(), "disk1", rnbd.AccessRO)
	if err != nil {
		t.Fatal(err)
	}
	d.fails(5, "unmap", "disk1")
	d.ok("unmap", "disk1", "--force")
	if err := dev1.Do(context.Background(), rnbd.OpRead, 0, 0, 4096, ws[0].buf, 0); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("IO after unmap --force: %v, want ENOTCONN", err)
	}
	dev1.Unmap(context.Background()) // the server forgot it: CLOSE fails
	if _, err := c.Map(context.Background(), "disk1", rnbd.AccessRO); err == nil {
		t.Fatal("opened an unmapped export")
	}
	d.ok("map", "disk1", img1, "--ro", "--allow", "someone-else", "--write-through")

	// A restart keeps the explicit exports, with their options.
	c.Session().Close()
	d.stop()
	d = startServer(t, dir, port)
	recs = d.records("device", "list", "--fields", "all")
	if len(recs) != 2 || recs[0]["devname"] != "disk0" || recs[0]["devpath"] != img ||
		recs[1]["devname"] != "disk1" || recs[1]["read_only"] != true ||
		recs[0]["write_cache"] != "write back" || recs[1]["write_cache"] != "write through" {
		t.Fatalf("device list after restart: %v", recs)
	}
	c = d.client("e2e-sess2", 1)
	dev, err = c.Map(context.Background(), "disk0", rnbd.AccessRO)
	if err != nil {
		t.Fatal(err)
	}
	buf, err := c.Session().AllocBuffer(maxIO)
	if err != nil {
		t.Fatal(err)
	}
	w := &worker{t: t, dev: dev, buf: buf, base: 0, model: ws[0].model}
	for off := 0; off < 16<<20; off += maxIO {
		if err := w.verify(int64(off), maxIO); err != nil {
			t.Fatalf("after restart: %v", err)
		}
	}
	if _, err := c.Map(context.Background(), "disk1", rnbd.AccessRO); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("open of an export that does not allow the session: %v, want EPERM", err)
	}
	d.stop()
	// A control command without a daemon fails with "unavailable".
	if msg := d.fails(6, "device", "list"); !strings.Contains(msg, "not running") && !strings.Contains(msg, "connect") {
		t.Fatalf("control command without a daemon: %q", msg)
	}
}

// TestServerHostileClients sends the daemon what a broken or malicious
// client might: garbage instead of a connection request, a truncated
// request, names escaping the search directory. Each gets refused and the
// daemon keeps serving.
func TestServerHostileClients(t *testing.T) {
	dir := t.TempDir()
	search := filepath.Join(dir, "devs", "%SESSNAME%")
	os.MkdirAll(filepath.Join(dir, "devs", "good"), 0o755)
	kit.SparseFile(t, filepath.Join(dir, "devs", "good", "d0"), 1<<20)
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, bytes.Repeat([]byte("S"), 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	os.Symlink(secret, filepath.Join(dir, "devs", "good", "link"))
	port := freePort(t)
	d := startServer(t, dir, port, "--dev-search-path", search)
	addr := fmt.Sprintf("127.0.0.1:%d", port)

	raw := func(what string, data []byte) {
		t.Helper()
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		defer c.Close()
		c.Write(data)
		// The daemon must hang up (or answer with a reject) and not hang.
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		var b [4096]byte
		for {
			if _, err := c.Read(b[:]); err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					t.Fatalf("%s: the daemon kept the connection open", what)
				}
				return
			}
		}
	}
	raw("garbage", bytes.Repeat([]byte{0xff}, 4096))
	raw("truncated header", []byte{1, 2, 3})
	raw("huge frame length", append([]byte{0x01, 0, 0, 0}, bytes.Repeat([]byte{0xff}, 60)...))

	c := d.client("good", 1)
	for _, name := range []string{"../../secret", "/etc/passwd", "link", "../good/../../secret", strings.Repeat("a", 4000)} {
		if _, err := c.Map(context.Background(), name, rnbd.AccessRO); err == nil {
			t.Fatalf("open %q succeeded", name)
		}
	}
	// A session whose name would lead out of the search directory.
	for _, sess := range []string{"..", "../good"} {
		cfg := rtrs.DefaultCltConfig()
		cfg.SessName, cfg.Fabric, cfg.Log = sess, tcp.New(tcp.Options{}), log.Discard()
		cfg.Paths = []rtrs.PathAddr{{Dst: netip.MustParseAddrPort(addr)}}
		cl, err := rnbd.DialSession(context.Background(), cfg, 0)
		if err != nil {
			continue // refused at the session level: fine
		}
		if _, err := cl.Map(context.Background(), "d0", rnbd.AccessRO); err == nil {
			t.Fatalf("session %q opened a device", sess)
		}
		cl.Close()
	}
	// Still serving: the good device opens and reads.
	dev, err := c.Map(context.Background(), "d0", rnbd.AccessRO)
	if err != nil {
		t.Fatalf("after the hostile clients: %v", err)
	}
	buf, _ := c.Session().AllocBuffer(4096)
	if err := dev.Do(context.Background(), rnbd.OpRead, 0, 0, 4096, buf, 0); err != nil {
		t.Fatal(err)
	}
	if recs := d.records("session", "list"); len(recs) != 1 || recs[0]["sessname"] != "good" {
		t.Fatalf("sessions after the hostile clients: %v", recs)
	}
	d.stop()
}

// TestUnrestoredExportKept: an export whose backing file is missing when
// the server starts (a volume not there yet) is logged and not served,
// but stays in the state file through other changes of it — a map, a
// session name bound — until it is mapped again or unmapped.
func TestUnrestoredExportKept(t *testing.T) {
	dir := t.TempDir()
	late, other := filepath.Join(dir, "late.img"), filepath.Join(dir, "other.img")
	kit.SparseFile(t, late, 1<<20)
	kit.SparseFile(t, other, 1<<20)
	port := freePort(t)
	d := startServer(t, dir, port)
	d.ok("map", "late", late)
	d.stop()
	if err := os.Rename(late, late+".away"); err != nil {
		t.Fatal(err)
	}
	d = startServer(t, dir, port)
	kit.WaitFor(t, 10*time.Second, "the server to say it could not restore the export", func() bool {
		return strings.Contains(d.out.String(), "restoring export failed")
	})
	d.ok("map", "other", other)
	state := func() string {
		b, err := os.ReadFile(filepath.Join(dir, "state.json"))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if s := state(); !strings.Contains(s, `"late"`) || !strings.Contains(s, `"other"`) {
		t.Fatalf("state file after a map beside an unrestored export:\n%s", s)
	}
	d.ok("unmap", "late")
	if s := state(); strings.Contains(s, `"late"`) || !strings.Contains(s, `"other"`) {
		t.Fatalf("state file after unmapping the unrestored export:\n%s", s)
	}
	if _, errOut, code := d.ctl("unmap", "late"); code == 0 || !strings.Contains(errOut, "no export late") {
		t.Fatalf("unmap twice: exit %d %q", code, errOut)
	}
}

// TestConfigExports: exports of the configuration file ([[export]]) are
// served from start-up with their rules, listed as such, never saved in
// the state file, and map and unmap refuse their names; a name the state
// file also has is served as the configuration says, its state entry
// kept. dev_search_path_allow_from fences the search path's devices. An
// export whose file is not there yet does not keep the others from
// being served: it is listed as not served, with why, and served once
// the file appears.
func TestConfigExports(t *testing.T) {
	dir := t.TempDir()
	search := filepath.Join(dir, "search")
	os.MkdirAll(search, 0o755)
	vol, old, other := filepath.Join(dir, "vol.img"), filepath.Join(dir, "old.img"), filepath.Join(dir, "other.img")
	late := filepath.Join(dir, "late.img")
	for _, f := range []string{vol, old, other, filepath.Join(search, "found")} {
		kit.SparseFile(t, f, 16<<20)
	}
	port := freePort(t)
	d := startServer(t, dir, port)
	d.ok("map", "vol2", old)
	d.stop()
	d = startServerConf(t, dir, port, fmt.Sprintf(`dev_search_path = %q
dev_search_path_allow_from = ["10.99.0.0/16"]
export_retry = "200ms"

[[export]]
name = "vol"
path = %q
allow_from = ["127.0.0.0/8"]
max_sessions = 1

[[export]]
name = "vol2"
path = %q
read_only = true

[[export]]
name = "late"
path = %q
`, search, vol, other, late), "--listen", fmt.Sprintf("tcp://127.0.0.1:%d", port), "--listen", fmt.Sprintf("tcp://127.0.0.2:%d", port))
	// It serves on both addresses it was given, and says so.
	kit.WaitFor(t, 10*time.Second, "the server to log where it listens", func() bool {
		return strings.Contains(d.out.String(), fmt.Sprintf("listen=\"tcp://127.0.0.1:%d,tcp://127.0.0.2:%d\"", port, port)) &&
			strings.Contains(d.out.String(), "exports=2") && strings.Contains(d.out.String(), "not_served=1")
	})
	lateState := func() map[string]any {
		for _, r := range d.records("device", "list", "--fields", "devname,state,reason") {
			if r["devname"] == "late" {
				return r
			}
		}
		return nil
	}
	if r := lateState(); r["state"] != "not served" || !strings.Contains(fmt.Sprint(r["reason"]), "no such file") {
		t.Fatalf("an export whose file is missing: %v", r)
	}
	kit.SparseFile(t, late, 1<<20)
	kit.WaitFor(t, 10*time.Second, "the late export to be served once its file is there", func() bool {
		return strings.Contains(d.out.String(), "export of the configuration file served now") && lateState()["state"] == "exported"
	})
	if c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.2:%d", port)); err != nil {
		t.Fatalf("the second listen address: %v", err)
	} else {
		c.Close()
	}
	kit.WaitFor(t, 10*time.Second, "the server to say the configuration shadows the state's vol2", func() bool {
		return strings.Contains(d.out.String(), "export of the state file not served: the configuration file has one of that name")
	})
	src := map[string]any{}
	for _, r := range d.records("device", "list", "--fields", "devname,devpath,source") {
		src[r["devname"].(string)] = r["source"]
		if r["devname"] == "vol2" && r["devpath"] != other {
			t.Fatalf("vol2 is served from %v, want the configuration's %s", r["devpath"], other)
		}
	}
	if src["vol"] != "config" || src["vol2"] != "config" {
		t.Fatalf("device list sources: %v", src)
	}
	if _, errOut, code := d.ctl("unmap", "vol"); code == 0 || !strings.Contains(errOut, "one of the configuration file's") {
		t.Fatalf("unmap of a configured export: exit %d %q", code, errOut)
	}
	if _, errOut, code := d.ctl("map", "vol", other); code == 0 || !strings.Contains(errOut, "one of the configuration file's") {
		t.Fatalf("map over a configured export: exit %d %q", code, errOut)
	}
	state, _ := os.ReadFile(filepath.Join(dir, "state.json"))
	if !strings.Contains(string(state), old) || strings.Contains(string(state), vol) {
		t.Fatalf("state file: the map's vol2 kept, the configuration's exports never in it:\n%s", state)
	}

	cl := startClient(t, filepath.Join(dir, "c"))
	mapArgs := func(sess, dev, mode string) []string {
		return []string{"map", "--sessname", sess, "--path", "ip:127.0.0.1", "--device-path", dev,
			"--dest-port", fmt.Sprint(port), "--access-mode", mode}
	}
	uri, ok := strings.CutPrefix(strings.TrimSpace(cl.ok(mapArgs("s1", "vol", "rw")...)), "rnbd0 mapped: ")
	if !ok {
		t.Fatal("map output")
	}
	if out, err := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 0x7e 0 64k", "-c", "read -P 0x7e 0 64k", uri).CombinedOutput(); err != nil || strings.Contains(string(out), "failed") {
		t.Fatalf("IO on a configured export: %v %s", err, out)
	}
	// Its max_sessions is 1; read-only vol2 refuses rw; the search path
	// is fenced to another network.
	if _, errOut, code := cl.ctl(mapArgs("s2", "vol", "ro")...); code != 5 || !strings.Contains(errOut, "max_sessions") {
		t.Fatalf("a second session on an export of max_sessions 1: exit %d %q", code, errOut)
	}
	if _, errOut, code := cl.ctl(mapArgs("s1", "vol2", "rw")...); code != 7 || !strings.Contains(errOut, "read-only") {
		t.Fatalf("rw map of a read-only configured export: exit %d %q", code, errOut)
	}
	if _, errOut, code := cl.ctl(mapArgs("s1", "found", "ro")...); code != 7 || !strings.Contains(errOut, "client address") {
		t.Fatalf("map of a search-path device from outside dev_search_path_allow_from: exit %d %q", code, errOut)
	}
}

// TestMapRefusesUnservable: what can never be served — a directory, a
// FIFO, a socket, a character device — is refused at map with the reason
// and the class invalid_argument (exit 2), and nothing of it is left in
// device list or the state file. The same path in an [[export]] of the
// configuration file, or in an export of the state file (an older server
// accepted it), is not served, said why in device list, and the other
// exports are served; unmap takes the state file's out of it.
func TestMapRefusesUnservable(t *testing.T) {
	dir := t.TempDir()
	data, fifo, sock := filepath.Join(dir, "data"), filepath.Join(dir, "fifo"), filepath.Join(dir, "sock")
	if err := os.Mkdir(data, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	vol, old := filepath.Join(dir, "vol.img"), filepath.Join(dir, "old.img")
	kit.SparseFile(t, vol, 1<<20)
	kit.SparseFile(t, old, 1<<20)
	st := fmt.Sprintf(`{"version": 1, "exports": [{"name": "olddir", "path": %q}, {"name": "oldvol", "path": %q}]}`, data, old)
	if err := os.WriteFile(filepath.Join(dir, "state.json"), []byte(st), 0o600); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	d := startServerConf(t, dir, port, fmt.Sprintf(`
[[export]]
name = "cfgdir"
path = %q

[[export]]
name = "cfgvol"
path = %q
`, data, vol))
	kit.WaitFor(t, 10*time.Second, "the start-up line", func() bool {
		return strings.Contains(d.out.String(), "rnbd-server started")
	})
	if out := d.out.String(); !strings.Contains(out, "exports=2") || !strings.Contains(out, "not_served=2") {
		t.Fatalf("start-up: want 2 exports served and 2 not:\n%s", out)
	}
	devs := func() map[string]map[string]any {
		m := map[string]map[string]any{}
		for _, r := range d.records("device", "list", "--fields", "devname,state,reason") {
			m[r["devname"].(string)] = r
		}
		return m
	}
	got := devs()
	for _, name := range []string{"cfgdir", "olddir"} {
		if r := got[name]; r["state"] != "not served" || !strings.Contains(fmt.Sprint(r["reason"]), data+" is a directory: an export is a regular file or a block device") {
			t.Errorf("%s, a directory: %v, want not served, saying why", name, r)
		}
	}
	for _, name := range []string{"cfgvol", "oldvol"} {
		if r := got[name]; r["state"] != "exported" {
			t.Errorf("%s beside exports that cannot be served: %v, want exported", name, r)
		}
	}

	state := func() string {
		b, err := os.ReadFile(filepath.Join(dir, "state.json"))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	for _, c := range []struct{ path, is string }{
		{data, "is a directory"},
		{fifo, "is a FIFO"},
		{sock, "is a socket"},
		{"/dev/null", "is a character device"},
	} {
		errOut := d.fails(2, "map", "bad", c.path)
		if want := "export bad: " + c.path + " " + c.is + ": an export is a regular file or a block device"; !strings.Contains(errOut, want) {
			t.Errorf("map of %s: %q, want %q", c.path, errOut, want)
		}
	}
	if _, ok := devs()["bad"]; ok || strings.Contains(state(), `"bad"`) {
		t.Fatalf("a refused map left its export: device list %v\nstate file %s", devs(), state())
	}
	d.ok("unmap", "olddir")
	if s := state(); strings.Contains(s, "olddir") || !strings.Contains(s, "oldvol") {
		t.Fatalf("state file after unmapping the export of a directory:\n%s", s)
	}
}

// logField is the value of key="..." in the first line of out that has
// msg="msg" (the daemons' text log), and whether there is such a line.
func logField(out, msg, key string) (string, bool) {
	for _, l := range strings.Split(out, "\n") {
		if !strings.Contains(l, `msg="`+msg) && !strings.Contains(l, "msg="+msg+" ") {
			continue
		}
		_, v, ok := strings.Cut(l, " "+key+"=")
		if !ok {
			return "", true
		}
		if q, err := strconv.QuotedPrefix(v); err == nil {
			v, _ = strconv.Unquote(q)
			return v, true
		}
		v, _, _ = strings.Cut(v, " ")
		return v, true
	}
	return "", false
}

// TestListenEverywhereSaysWhatItBinds: a server told to listen on every
// interface (0.0.0.0, [::], and rdma://0.0.0.0 on a machine without
// RDMA) names the same addresses in its start-up line and in its
// warning: what it bound — 0.0.0.0 as IPv4 only (not a dual-stack
// [::]), [::] as itself, and no RDMA address it does not listen on. In a
// network namespace of the test's, with loopback only.
func TestListenEverywhereSaysWhatItBinds(t *testing.T) {
	requireRoot(t)
	ns := netns(t, fmt.Sprintf("rnbd-wild-%d", os.Getpid()))
	dir := t.TempDir()
	srv := start(t, append([]string{"ip", "netns", "exec", ns, bin("rnbd-server"), "daemon", "--config", "/dev/null",
		"--listen", "tcp://0.0.0.0:1234", "--listen", "tcp://[::]:1235", "--listen", "rdma://0.0.0.0:1234",
		"--control-socket", filepath.Join(dir, "s.sock"), "--state-file", filepath.Join(dir, "s.json")}, tlsFlags("srv")...)...)
	const warning = "listening on every interface"
	kit.WaitFor(t, 10*time.Second, "the start-up line and the warning", func() bool {
		_, ok := logField(srv.out.String(), warning, "listen")
		return ok
	})
	srv.cmd.Process.Signal(syscall.SIGTERM)
	if err := srv.wait(t, 20*time.Second); err != nil {
		t.Fatalf("server exit: %v\n%s", err, srv.out.String())
	}
	out := srv.out.String()
	started, _ := logField(out, "rnbd-server started", "listen")
	warned, _ := logField(out, warning, "listen")
	want := "tcp://0.0.0.0:1234,tcp://[::]:1235"
	if !strings.Contains(out, "not listening: this machine cannot") {
		want += ",rdma://0.0.0.0:1234" // a machine that does RDMA
	}
	if started != want || warned != started {
		t.Fatalf("start-up line listen=%q, warning listen=%q, want both %q:\n%s", started, warned, want, out)
	}
}

// TestBackendErrorsLogged: an export on a file system that fills up. A
// write past its space fails with ENOSPC at the NBD client, and both
// daemons log it: the server which backend IO failed, the client which
// request.
func TestBackendErrorsLogged(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small tmpfs")
	}
	needTools(t, "qemu-io")
	dir := t.TempDir()
	small := filepath.Join(dir, "small")
	os.MkdirAll(small, 0o755)
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "rnbd-e2e", small).CombinedOutput(); err != nil {
		t.Skipf("mount tmpfs: %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", "-l", small).Run() })
	vol := filepath.Join(small, "vol.img")
	kit.SparseFile(t, vol, 16<<20) // sparse: 16 MiB on a 1 MiB file system
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "vol", vol)
	cl := startClient(t, filepath.Join(dir, "c"))
	uri, ok := strings.CutPrefix(strings.TrimSpace(cl.ok("map", "--sessname", "full", "--path", "ip:127.0.0.1", "--device-path", "vol",
		"--dest-port", fmt.Sprint(port))), "rnbd0 mapped: ")
	if !ok {
		t.Fatal("map output")
	}
	out, _ := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 0x11 0 4M", uri).CombinedOutput()
	if !strings.Contains(string(out), "No space left on device") {
		t.Fatalf("a write past the file system's space: %s, want ENOSPC", out)
	}
	for _, l := range []struct {
		who, says string
		out       *lockedBuffer
	}{{"server", "IO failed on the backend", srv.out}, {"client", "IO failed", cl.out}} {
		kit.WaitFor(t, 10*time.Second, "the "+l.who+" to log the failed write", func() bool {
			s := l.out.String()
			return strings.Contains(s, l.says) && strings.Contains(s, "no space left on device")
		})
	}
}

// TestHungExportPath: an export whose path is on a mount that does not
// answer — here a FUSE mount whose daemon never replies, as a hard NFS
// mount of a server that is gone — holds nothing else: the server starts
// and serves the other exports, lists it not served with why, maps and
// unmaps others meanwhile, refuses a map on that mount within seconds,
// and stops.
func TestHungExportPath(t *testing.T) {
	mnt := testfs.HungMount(t)
	dir := t.TempDir()
	vol, other := filepath.Join(dir, "vol.img"), filepath.Join(dir, "other.img")
	kit.SparseFile(t, vol, 1<<20)
	kit.SparseFile(t, other, 1<<20)
	port := freePort(t)
	began := time.Now()
	d := startServerConf(t, dir, port, fmt.Sprintf(`export_retry = "200ms"

[[export]]
name = "vol"
path = %q

[[export]]
name = "hung"
path = %q
`, vol, filepath.Join(mnt, "disk.img")))
	if took := time.Since(began); took > 15*time.Second {
		t.Fatalf("the server took %v to start", took)
	}
	state := map[string]string{}
	for _, r := range d.records("device", "list", "--fields", "devname,state,reason") {
		state[r["devname"].(string)] = fmt.Sprint(r["state"], ": ", r["reason"])
	}
	if !strings.HasPrefix(state["vol"], "exported") || !strings.Contains(state["hung"], "not served") ||
		!strings.Contains(state["hung"], "no answer") {
		t.Fatalf("device list: %v", state)
	}
	// The retries of the hung path (every 200 ms) hold no map or unmap.
	// A retry has run once the reason says the first look has not
	// returned (the retries do not stat the path again while it hangs).
	kit.WaitFor(t, 10*time.Second, "a retry of the hung export", func() bool {
		for _, r := range d.records("device", "list", "--fields", "devname,reason") {
			if r["devname"] == "hung" {
				return strings.Contains(fmt.Sprint(r["reason"]), "an earlier look has not returned")
			}
		}
		return false
	})
	quick := func(what string, args ...string) (string, int) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin("rnbd-server"), append(args, "--socket", d.sock)...)
		var errOut bytes.Buffer
		cmd.Stderr = &errOut
		err := cmd.Run()
		if ctx.Err() != nil {
			t.Fatalf("%s took more than 5 s", what)
		}
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatalf("%s: %v", what, err)
		}
		return errOut.String(), cmd.ProcessState.ExitCode()
	}
	if errOut, code := quick("a map", "map", "other", other); code != 0 {
		t.Fatalf("map beside a hung export: exit %d %s", code, errOut)
	}
	if errOut, code := quick("a map on the hung mount", "map", "other2", filepath.Join(mnt, "other.img")); code == 0 ||
		!strings.Contains(errOut, "no answer") {
		t.Fatalf("map of a path that does not answer: exit %d %q", code, errOut)
	}
	if errOut, code := quick("an unmap", "unmap", "other"); code != 0 {
		t.Fatalf("unmap beside a hung export: exit %d %s", code, errOut)
	}
	began = time.Now()
	d.stop()
	if took := time.Since(began); took > 10*time.Second {
		t.Fatalf("the server took %v to stop", took)
	}
}

// TestExportMountHangs: the mount under an export stops answering after
// the export was mapped (a hard NFS mount whose server went away). A
// client's map of it fails within 10 s with the reason (at once once the
// path is known to hang), where the OPEN used to wait on the mount for
// ever and hold the client's map with it; a resize fails too, and the
// session's other device goes on serving IO.
func TestExportMountHangs(t *testing.T) {
	needTools(t, "qemu-io")
	dir := t.TempDir()
	under := filepath.Join(dir, "mnt")
	if err := os.Mkdir(under, 0o755); err != nil {
		t.Fatal(err)
	}
	vol, keep := filepath.Join(under, "vol.img"), filepath.Join(dir, "keep.img")
	kit.SparseFile(t, vol, 1<<20)
	kit.SparseFile(t, keep, 1<<20)
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "vol", vol)
	srv.ok("map", "keep", keep)
	cl := startClient(t, dir)
	sess := []string{"--sessname", "hang", "--path", "ip:127.0.0.1", "--dest-port", fmt.Sprint(port)}
	keepSock := filepath.Join(dir, "keep.sock")
	cl.ok(append([]string{"map", "--device-path", "keep", "--as", "socket:" + keepSock}, sess...)...)
	testfs.HungMountAt(t, under) // vol.img now lies under a mount that never answers

	// within runs a command that must fail, saying "timed out", in
	// limit (an OPEN waits 10 s for the path, a resize 2 s).
	within := func(what string, limit time.Duration, prog string, args ...string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin(prog), args...)
		var errOut bytes.Buffer
		cmd.Stderr = &errOut
		began := time.Now()
		err := cmd.Run()
		took := time.Since(began)
		if ctx.Err() != nil {
			t.Fatalf("%s of an export on a mount that does not answer still waited after 30 s", what)
		}
		if err == nil || !strings.Contains(errOut.String(), "timed out") || took > limit {
			t.Fatalf("%s of an export on a hung mount: %v after %v: %q", what, err, took, errOut.String())
		}
	}
	within("a client's map", 15*time.Second, "rnbd-client", append([]string{"map", "--device-path", "vol", "--socket", cl.sock}, sess...)...)
	// The path is known to hang now: at once.
	within("a second map", 3*time.Second, "rnbd-client", append([]string{"map", "--device-path", "vol", "--socket", cl.sock}, sess...)...)
	within("a resize", 3*time.Second, "rnbd-server", "resize", "vol", "2MiB", "--socket", srv.sock)
	uri := "nbd+unix:///keep?socket=" + keepSock
	qemuIO(t, uri, "write -P 0x5a 0 64k", "read -P 0x5a 0 64k", "flush")
	kit.WaitFor(t, 10*time.Second, "the server to log the refused open", func() bool {
		return strings.Contains(srv.out.String(), "no answer in")
	})
}
