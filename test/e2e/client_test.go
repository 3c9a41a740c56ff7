package e2e

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// clientDaemon is a real rnbd-client process.
type clientDaemon struct {
	t    *testing.T
	dir  string
	sock string
	cmd  *exec.Cmd
	out  *lockedBuffer
	done chan error
}

func startClient(t *testing.T, dir string, extra ...string) *clientDaemon {
	t.Helper()
	c := &clientDaemon{t: t, dir: dir, sock: filepath.Join(dir, "client.sock"), out: &lockedBuffer{}, done: make(chan error, 1)}
	args := append([]string{"daemon", "--config", "/dev/null",
		"--control-socket", c.sock,
		"--state-file", filepath.Join(dir, "client.json"),
		"--socket-dir", dir,
		"--conns-per-path", "2",
		"--hb-interval", "1s",
	}, append(tlsFlags("e2e-client", extra...), extra...)...)
	c.cmd = exec.Command(bin("rnbd-client"), args...)
	c.cmd.Stdout, c.cmd.Stderr = c.out, c.out
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { c.done <- c.cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case <-c.done:
		default:
			c.cmd.Process.Kill()
			<-c.done
		}
		if t.Failed() {
			t.Logf("rnbd-client output:\n%s", c.out.String())
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, _, code := c.ctl("device", "list"); code == 0 {
			return c
		}
		select {
		case err := <-c.done:
			c.done <- err
			t.Fatalf("rnbd-client exited: %v\n%s", err, c.out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("rnbd-client did not come up\n%s", c.out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (c *clientDaemon) stop() {
	c.t.Helper()
	c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-c.done:
		c.done <- err
		if err != nil {
			c.t.Fatalf("rnbd-client exited with %v\n%s", err, c.out.String())
		}
	case <-time.After(30 * time.Second):
		c.t.Fatalf("rnbd-client did not stop\n%s", c.out.String())
	}
}

func (c *clientDaemon) ctl(args ...string) (string, string, int) {
	cmd := exec.Command(bin("rnbd-client"), append(args, "--socket", c.sock)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return stdout.String(), stderr.String(), ee.ExitCode()
	}
	if err != nil {
		c.t.Fatalf("rnbd-client %v: %v", args, err)
	}
	return stdout.String(), stderr.String(), 0
}

func (c *clientDaemon) ok(args ...string) string {
	c.t.Helper()
	out, errOut, code := c.ctl(args...)
	if code != 0 {
		c.t.Fatalf("rnbd-client %s: exit %d: %s", strings.Join(args, " "), code, errOut)
	}
	return out
}

func (c *clientDaemon) records(args ...string) []map[string]any {
	c.t.Helper()
	out := c.ok(append(args, "--format", "json", "--fields", "all")...)
	var recs []map[string]any
	if err := json.Unmarshal([]byte(out), &recs); err != nil {
		c.t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return recs
}

// fioVerify writes size of random data in blocks of 4 KiB to maxBlock at
// depth 16 through the NBD URI with fio's nbd engine, reads every block
// mappedVol is a server exporting a sparse file as "vol" and a client
// mapping it over one loopback path, served on an NBD socket.
type mappedVol struct {
	dir, vol, uri string
	port          int
	srv           *serverDaemon
	cl            *clientDaemon
}

// mapVol starts a server (srvArgs added) exporting a sparse file of
// size, and a client (cltArgs added) that maps it as session sess.
func mapVol(t *testing.T, size int64, sess string, srvArgs, cltArgs []string) *mappedVol {
	t.Helper()
	m := &mappedVol{dir: t.TempDir()}
	m.vol = filepath.Join(m.dir, "vol.img")
	kit.SparseFile(t, m.vol, size)
	m.port = freePort(t)
	m.srv = startServer(t, m.dir, m.port, srvArgs...)
	m.srv.ok("map", "vol", m.vol)
	m.cl = startClient(t, m.dir, cltArgs...)
	out := m.cl.ok("map", "--sessname", sess, "--path", "ip:127.0.0.1", "--device-path", "vol", "--dest-port", fmt.Sprint(m.port))
	var ok bool
	if m.uri, ok = strings.CutPrefix(strings.TrimSpace(out), "rnbd0 mapped: "); !ok {
		t.Fatalf("map output %q", out)
	}
	return m
}

// back and verifies it (crc32c).
func fioVerify(t *testing.T, uri, maxBlock, size string, within time.Duration) {
	t.Helper()
	out := run(t, within, "fio", "--name=verify", "--ioengine=nbd", "--uri="+uri,
		"--rw=randwrite", "--bsrange=4k-"+maxBlock, "--iodepth=16", "--size="+size, "--verify=crc32c",
		"--verify_fatal=1", "--do_verify=1", "--verify_state_save=0", "--randrepeat=0", "--output-format=json")
	if !strings.Contains(out, `"error" : 0`) {
		t.Fatalf("fio: %s", out)
	}
}

func needTools(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (make deps installs it as root on Debian)", tool)
		}
	}
}

func run(t *testing.T, timeout time.Duration, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out.String())
		}
	case <-time.After(timeout):
		cmd.Process.Kill()
		<-done
		t.Fatalf("%s did not finish within %v\n%s", name, timeout, out.String())
	}
	return out.String()
}

// TestClientEndToEnd runs both daemons and drives a mapping with the real
// NBD clients: qemu-img, qemu-io, nbdinfo and fio's nbd engine.
func TestClientEndToEnd(t *testing.T) {
	needTools(t, "qemu-io", "qemu-img", "nbdinfo", "fio")
	dir := t.TempDir()
	const size = 1 << 30
	for _, n := range []string{"vol0", "vol1"} {
		kit.SparseFile(t, filepath.Join(dir, n+".img"), size)
	}
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "vol0", filepath.Join(dir, "vol0.img"))
	srv.ok("map", "vol1", filepath.Join(dir, "vol1.img"), "--write-through")
	srv.ok("map", "fenced", filepath.Join(dir, "vol1.img"), "--allow-from", "10.99.0.0/16")
	cl := startClient(t, dir, "--no-path-timeout", "60s")
	path := fmt.Sprintf("ip:127.0.0.1")
	out := cl.ok("map", fmt.Sprintf("sessname=e2e path=%s device_path=vol0 dest_port=%d", path, port))
	if !strings.HasPrefix(out, "rnbd0 mapped: nbd+unix:///vol0?socket=") {
		t.Fatalf("map output %q", out)
	}
	sock0 := filepath.Join(dir, "rnbd0.sock")
	uri0 := "nbd+unix:///vol0?socket=" + sock0
	// A second device on the same session, read-only.
	cl.ok("map", "--sessname", "e2e", "--path", path, "--device-path", "vol1", "--access-mode", "ro",
		"--dest-port", fmt.Sprint(port), "--as", "socket:"+filepath.Join(dir, "ro.sock"))
	uri1 := "nbd+unix:///vol1?socket=" + filepath.Join(dir, "ro.sock")
	if s := cl.records("session", "list"); len(s) != 1 || s[0]["devices"] != float64(2) {
		t.Fatalf("sessions: %v", s)
	}
	// Each socket serves its own device: a client of one lists and
	// opens no other.
	if list := run(t, time.Minute, "nbdinfo", "--list", "nbd+unix:///?socket="+sock0); !strings.Contains(list, "export=\"vol0\"") ||
		strings.Contains(list, "vol1") {
		t.Fatalf("nbdinfo --list on vol0's socket:\n%s", list)
	}
	if out, err := exec.Command("nbdinfo", "nbd+unix:///vol1?socket="+sock0).CombinedOutput(); err == nil {
		t.Fatalf("vol1 opened through vol0's socket:\n%s", out)
	}
	// A missing device: a clear error and the not-found exit code.
	if _, errOut, code := cl.ctl("map", "--sessname", "e2e", "--path", path, "--device-path", "nothere", "--dest-port", fmt.Sprint(port)); code != 3 || !strings.Contains(errOut, "\nrnbd-client: rnbd: open nothere: no such file or directory: the server has no such device\n") {
		t.Fatalf("map of a missing device: exit %d %q", code, errOut)
	}
	// An export for another network: refused, said why, permission exit code.
	if _, errOut, code := cl.ctl("map", "--sessname", "e2e", "--path", path, "--device-path", "fenced", "--dest-port", fmt.Sprint(port)); code != 7 ||
		!strings.Contains(errOut, "rnbd: open fenced: operation not permitted: the export does not allow this session name or client address") {
		t.Fatalf("map of an export fenced to another network: exit %d %q", code, errOut)
	}
	// The server's log names what refused it.
	kit.WaitFor(t, 10*time.Second, "the server to log the refused open", func() bool {
		return strings.Contains(srv.out.String(), "export fenced does not allow clients at 127.0.0.1")
	})
	// A kernel device where the kernel has no nbd: said so, exit 8.
	if _, err := os.Stat("/sys/module/nbd"); err != nil {
		if _, errOut, code := cl.ctl("map", "--sessname", "e2e", "--path", path, "--device-path", "vol0", "--dest-port", fmt.Sprint(port), "--as", "nbd"); code != 8 || !strings.Contains(errOut, "no nbd driver (modprobe nbd)") {
			t.Fatalf("map --as nbd without nbd: exit %d %q", code, errOut)
		}
	}

	if info := run(t, time.Minute, "qemu-img", "info", uri0); !strings.Contains(info, "virtual size: 1 GiB") {
		t.Fatalf("qemu-img info: %s", info)
	}
	var ni struct {
		Exports []struct {
			Size      int64 `json:"export-size"`
			CanFlush  bool  `json:"can_flush"`
			CanTrim   bool  `json:"can_trim"`
			CanZero   bool  `json:"can_zero"`
			CanMulti  bool  `json:"can_multi_conn"`
			ReadOnly  bool  `json:"is_read_only"`
			BlockSize int   `json:"block_size_preferred"`
		} `json:"exports"`
	}
	if err := json.Unmarshal([]byte(run(t, time.Minute, "nbdinfo", "--json", uri0)), &ni); err != nil || len(ni.Exports) != 1 {
		t.Fatalf("nbdinfo: %v %+v", err, ni)
	}
	if e := ni.Exports[0]; e.Size != size || !e.CanFlush || !e.CanTrim || !e.CanZero || !e.CanMulti || e.ReadOnly {
		t.Fatalf("nbdinfo: %+v", e)
	}
	for _, can := range []string{"flush", "trim", "zero", "multi-conn"} {
		run(t, time.Minute, "nbdinfo", "--can", can, uri0)
	}
	// vol1 is exported write-through: the mapping has nothing to flush
	// and tells its NBD clients so.
	ni.Exports = nil
	if err := json.Unmarshal([]byte(run(t, time.Minute, "nbdinfo", "--json", uri1)), &ni); err != nil || len(ni.Exports) != 1 {
		t.Fatalf("nbdinfo: %v %+v", err, ni)
	}
	if e := ni.Exports[0]; e.CanFlush || !e.ReadOnly {
		t.Fatalf("nbdinfo of the write-through, read-only mapping: %+v", e)
	}
	run(t, time.Minute, "qemu-io", "-f", "raw", "-c", "write -P 0xab 1M 256k", "-c", "write -z 2M 64k", uri0)
	run(t, time.Minute, "qemu-io", "-f", "raw", "-c", "read -P 0xab 1M 256k", "-c", "read -P 0 2M 64k", uri0)
	// The read-only mapping refuses writes.
	cmd := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 1 0 4k", uri1)
	if out, err := cmd.CombinedOutput(); err == nil && !strings.Contains(string(out), "denied") && !strings.Contains(string(out), "read-only") && !strings.Contains(string(out), "Operation not permitted") {
		t.Fatalf("write to a read-only mapping: %s", out)
	}
	// fio: 1 GiB of random writes of mixed sizes, then every block read
	// back and verified.
	fioVerify(t, uri0, "256k", "1g", 10*time.Minute)

	// The server restarts: the client reconnects, reopens the device and
	// the IO that waited meanwhile completes.
	srv.stop()
	ioDone := make(chan string, 1)
	go func() {
		cmd := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 0xcd 8M 64k", "-c", "read -P 0xcd 8M 64k", uri0)
		out, err := cmd.CombinedOutput()
		if err != nil {
			out = append(out, []byte(err.Error())...)
		}
		ioDone <- string(out)
	}()
	srv = startServer(t, dir, port)
	select {
	case out := <-ioDone:
		if strings.Contains(out, "error") || strings.Contains(out, "failed") || strings.Contains(out, "exit status") {
			t.Fatalf("IO across the server restart: %s", out)
		}
	case <-time.After(90 * time.Second):
		t.Fatal("IO across the server restart did not finish")
	}
	run(t, time.Minute, "qemu-io", "-f", "raw", "-c", "read -P 0xcd 8M 64k", uri0)
	cl.ok("remap", "rnbd0")

	// A client restart restores the mappings.
	cl.stop()
	cl = startClient(t, dir, "--no-path-timeout", "60s")
	if d := cl.records("device", "list"); len(d) != 2 || d[0]["devname"] != "rnbd0" || d[0]["state"] != "open" {
		t.Fatalf("devices after restart: %v", d)
	}
	run(t, time.Minute, "qemu-io", "-f", "raw", "-c", "read -P 0xcd 8M 64k", uri0)

	// Unmap; the socket goes away.
	cl.ok("unmap", "rnbd0")
	if _, err := os.Stat(sock0); err == nil {
		t.Fatal("the socket of an unmapped device is still there")
	}
	if _, _, code := cl.ctl("unmap", "rnbd0"); code != 3 {
		t.Fatalf("second unmap: exit %d, want 3", code)
	}
	cl.ok("unmap", "rnbd1")
	cl.stop()
}

// TestClientWait: rnbd-client wait returns once every mapping is open. A
// mapping whose server is not there when the daemon starts (a boot where
// the client comes up first) is "restoring": wait waits for it and names
// it at its timeout, and the mapping comes back by itself once the
// server is up, its data there. With no daemon wait fails after its
// timeout.
func TestClientWait(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "w.img")
	kit.SparseFile(t, img, 8<<20)
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "w", img)
	cl := startClient(t, dir)
	out := cl.ok("map", "--sessname", "ws", "--path", "ip:127.0.0.1", "--device-path", "w", "--dest-port", fmt.Sprint(port))
	uri, ok := strings.CutPrefix(strings.TrimSpace(out), "rnbd0 mapped: ")
	if !ok {
		t.Fatalf("map output %q", out)
	}
	if out := cl.ok("wait", "--timeout", "10s"); strings.TrimSpace(out) != "1 device(s) open" {
		t.Fatalf("wait: %q", out)
	}
	qemuIO(t, uri, "write -P 0x3c 0 64k")
	cl.stop()
	srv.stop()
	cl = startClient(t, dir) // the server is gone: the mapping does not come back yet
	if _, errOut, code := cl.ctl("wait", "--timeout", "2s"); code != 6 || !strings.Contains(errOut, "not open after 2s") ||
		!strings.Contains(errOut, "rnbd0 (restoring)") {
		t.Fatalf("wait with a mapping whose server is not there: exit %d %q", code, errOut)
	}
	if devs := cl.records("device", "list"); len(devs) != 1 || devs[0]["state"] != "restoring" || devs[0]["devname"] != "rnbd0" {
		t.Fatalf("device list: %v", devs)
	}
	srv = startServer(t, dir, port)
	if out := cl.ok("wait", "--timeout", "60s"); strings.TrimSpace(out) != "1 device(s) open" {
		t.Fatalf("wait once the server is back: %q", out)
	}
	kit.WaitFor(t, 10*time.Second, "the client to log the restore", func() bool {
		return strings.Contains(cl.out.String(), "mapping restored")
	})
	qemuIO(t, uri, "read -P 0x3c 0 64k")
	cl.stop()
	if _, errOut, code := cl.ctl("wait", "--timeout", "1s"); code != 6 || !strings.Contains(errOut, "did not answer within 1s") {
		t.Fatalf("wait without a daemon: exit %d %q", code, errOut)
	}
}

// qemuIO runs qemu-io commands on an NBD URI; a failed command or a
// pattern that does not match fails the test (qemu-io itself exits 0).
func qemuIO(t *testing.T, uri string, cmds ...string) {
	t.Helper()
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	out, err := exec.Command("qemu-io", append(args, uri)...).CombinedOutput()
	if err != nil || strings.Contains(string(out), "failed") || strings.Contains(string(out), "error") {
		t.Fatalf("qemu-io %v on %s: %v\n%s", cmds, uri, err, out)
	}
}

// TestMapSaysHowServed: on a kernel without the nbd driver, map without
// --as serves the device on an NBD socket and says so — on stderr beside
// the URI on stdout, and in the daemon's log — instead of doing it
// quietly; --as ublk without the ublk driver is refused (exit 8,
// not_supported) suggesting only what this kernel has: not --as nbd
// where the nbd driver is missing too. The parts a kernel with the
// drivers cannot show are skipped, not faked: the test loads or unloads
// no module.
func TestMapSaysHowServed(t *testing.T) {
	_, nbdErr := os.Stat("/sys/module/nbd")
	_, ublkErr := os.Stat("/dev/ublk-control")
	if nbdErr == nil && ublkErr == nil {
		t.Skip("this kernel has the nbd and the ublk drivers: nothing to say")
	}
	dir := t.TempDir()
	vol := filepath.Join(dir, "vol.img")
	kit.SparseFile(t, vol, 16<<20)
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "vol", vol)
	cl := startClient(t, dir)
	mapArgs := []string{"map", "--sessname", "s1", "--path", "ip:127.0.0.1", "--device-path", "vol", "--dest-port", fmt.Sprint(port)}
	if ublkErr != nil {
		_, errOut, code := cl.ctl(append(mapArgs, "--as", "ublk")...)
		want := "map with --as nbd or --as socket:PATH instead"
		if nbdErr != nil {
			want = "this kernel has no ublk driver (modprobe ublk_drv), nor the nbd driver for --as nbd (modprobe nbd); map with --as socket:PATH instead"
		}
		if code != 8 || !strings.Contains(errOut, want) {
			t.Errorf("map --as ublk without the ublk driver (nbd driver: %v): exit %d %q, want 8 saying %q", nbdErr == nil, code, errOut, want)
		}
	}
	if nbdErr == nil {
		t.Log("this kernel has the nbd driver: map without --as would make a /dev/nbdN, not tried here")
		return
	}
	out, errOut, code := cl.ctl(mapArgs...)
	sock := filepath.Join(dir, "rnbd0.sock")
	const says = "this kernel has no nbd driver (modprobe nbd), so the device is served on an NBD socket, not as /dev/nbdN"
	if code != 0 || strings.TrimSpace(out) != "rnbd0 mapped: nbd+unix:///vol?socket="+sock || !strings.Contains(errOut, "rnbd0: "+says) {
		t.Fatalf("map without --as and without the nbd driver: exit %d, stdout %q, stderr %q; want the socket's URI, and stderr saying %q",
			code, out, errOut, says)
	}
	kit.WaitFor(t, 10*time.Second, "the daemon to log it", func() bool {
		l, ok := logField(cl.out.String(), "this kernel has no nbd driver", "socket")
		return ok && l == sock
	})
	qemuIO(t, "nbd+unix:///vol?socket="+sock, "write -P 0x3c 0 64k", "read -P 0x3c 0 64k")
}

// TestOpenRefusalsSaid: a refused OPEN tells the client its cause by
// its errno alone (OPEN_RSP carries no text), one cause per errno: a
// second writer is busy (EBUSY, exit 5) and names access_mode=migration,
// a read-write map of a read-only export is EROFS (exit 7); the server's
// log has the detail. A device named by the server's name on the client
// says which mapping it is.
func TestOpenRefusalsSaid(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []string{"vol", "rovol"} {
		kit.SparseFile(t, filepath.Join(dir, n+".img"), 16<<20)
	}
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "vol", filepath.Join(dir, "vol.img"))
	srv.ok("map", "rovol", filepath.Join(dir, "rovol.img"), "--ro")
	cl := startClient(t, dir)
	mapArgs := func(sess, dev string) []string {
		return []string{"map", "--sessname", sess, "--path", "ip:127.0.0.1", "--device-path", dev, "--dest-port", fmt.Sprint(port)}
	}
	cl.ok(mapArgs("s1", "vol")...)
	if _, errOut, code := cl.ctl(mapArgs("s2", "vol")...); code != 5 || !strings.Contains(errOut,
		"rnbd: open vol: device or resource busy: another session has the device open for writing: a second writer needs access_mode=migration") {
		t.Fatalf("a second writer: exit %d %q", code, errOut)
	}
	kit.WaitFor(t, 10*time.Second, "the server to log the refused open", func() bool {
		return strings.Contains(srv.out.String(), "vol.img is open for writing by another session")
	})
	if _, errOut, code := cl.ctl(mapArgs("s2", "rovol")...); code != 7 || !strings.Contains(errOut,
		"rnbd: open rovol: read-only file system: the export is read-only: map it with access_mode=ro") {
		t.Fatalf("a read-write map of a read-only export: exit %d %q", code, errOut)
	}
	if _, errOut, code := cl.ctl("unmap", "vol"); code != 3 || !strings.Contains(errOut, "no device vol; vol is mapped as rnbd0 (session s1): unmap rnbd0") {
		t.Fatalf("unmap by the server's name: exit %d %q", code, errOut)
	}
	cl.ok("unmap", "rnbd0")
}
