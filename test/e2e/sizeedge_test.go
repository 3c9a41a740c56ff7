package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/kit"
)

// qemuIOOut runs qemu-io commands on an NBD URI and returns what it
// printed (qemu-io exits 0 when a command fails: the output says).
func qemuIOOut(t *testing.T, uri string, cmds ...string) string {
	t.Helper()
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	out, _ := exec.Command("qemu-io", append(args, uri)...).CombinedOutput()
	return string(out)
}

// TestWritePastEndENOSPC: after a forced shrink the client, which has
// not polled the size yet, still shows the old size; a write that starts
// past the new end goes to the server and gets ENOSPC through the NBD
// socket — not EINVAL, which tools take for a misaligned O_DIRECT buffer
// (busybox dd then wrote again through the page cache and lost the
// data). A read there gets EINVAL; the file does not grow.
func TestWritePastEndENOSPC(t *testing.T) {
	needTools(t, "qemu-io")
	m := mapVol(t, 8<<20, "pe", nil, []string{"--size-poll", "0"})
	srv, vol, uri := m.srv, m.vol, m.uri
	qemuIO(t, uri, "write -P 0x11 6M 64k", "read -P 0x11 6M 64k")
	srv.ok("resize", "vol", "4MiB", "--force")
	for _, c := range []struct{ cmd, want string }{
		{"write -P 0xab 6M 64k", "write failed: No space left on device"},   // starts past the end
		{"write -P 0xab 4M 4k", "write failed: No space left on device"},    // starts at the end
		{"write -P 0xab 4092k 8k", "write failed: No space left on device"}, // runs past it
		{"write -z 5M 64k", "write failed: No space left on device"},        // write-zeroes
		{"read 6M 64k", "read failed: Invalid argument"},                    // a read past the end
	} {
		if out := qemuIOOut(t, uri, c.cmd); !strings.Contains(out, c.want) {
			t.Errorf("%s: %q, want %q", c.cmd, strings.TrimSpace(out), c.want)
		}
	}
	if st, err := os.Stat(vol); err != nil || st.Size() != 4<<20 {
		t.Fatalf("the file after writes past its end: %v, size %d", err, st.Size())
	}
	qemuIO(t, uri, "write -P 0x22 4088k 4k", "read -P 0x22 4088k 4k")
}

// TestServerCloseSticks: rnbd-server device close of a mapped device
// (the kernel's force_close) sticks across the client's size polls: the
// device shows "closed by server", the server has nothing open for the
// session, its IO fails; rnbd-client remap opens it again with its data.
func TestServerCloseSticks(t *testing.T) {
	needTools(t, "qemu-io")
	metrics := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	m := mapVol(t, 8<<20, "sc", []string{"--metrics-listen", metrics}, []string{"--size-poll", "100ms"})
	srv, cl, uri := m.srv, m.cl, m.uri
	// A clock, mapped through the session after vol: a size poll goes
	// through the session's devices in the order they were mapped, and
	// reads a block of each one open, so every read of the clock, which
	// nothing else reads, is a poll that has been through vol.
	clock := filepath.Join(m.dir, "clock.img")
	kit.SparseFile(t, clock, 1<<20)
	srv.ok("map", "clock", clock)
	cl.ok("map", "--sessname", "sc", "--path", "ip:127.0.0.1", "--device-path", "clock", "--dest-port", fmt.Sprint(m.port))
	qemuIO(t, uri, "write -P 0x5c 1M 64k")
	state := func() string {
		for _, r := range cl.records("device", "list") {
			if r["mapping_path"] == "vol" {
				return fmt.Sprint(r["state"])
			}
		}
		t.Fatalf("device list: no vol: %v", cl.records("device", "list"))
		return ""
	}
	srv.ok("device", "close", "vol", "--session", "sc")
	deadline := time.Now().Add(20 * time.Second)
	for state() != "closed by server" {
		if time.Now().After(deadline) {
			t.Fatalf("device state %q after the server closed it\n%s", state(), cl.out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Ten polls: of eleven more reads of the clock, the first may be of
	// a poll under way now.
	polls := func() float64 {
		return fetchMetrics(t, metrics).sum("rnbd_server_device_requests_total", `device="clock"`, `session="sc"`, `op="read"`)
	}
	from := polls()
	kit.WaitFor(t, 20*time.Second, "ten size polls", func() bool { return polls() >= from+11 })
	if st := state(); st != "closed by server" {
		t.Fatalf("state %q after ten size polls", st)
	}
	for _, r := range srv.records("device", "list") {
		if r["devname"] == "vol" && r["sessname"] == "sc" {
			t.Fatalf("the server has the device open again for the session: %v", r)
		}
	}
	if out := qemuIOOut(t, uri, "read 1M 64k"); !strings.Contains(out, "read failed: Input/output error") {
		t.Fatalf("read of a device its server closed: %q", out)
	}
	if n := strings.Count(cl.out.String(), `msg="the server closed the device (its administrator`); n != 1 {
		t.Fatalf("the client said %d times that the server closed the device\n%s", n, cl.out.String())
	}
	cl.ok("remap", "rnbd0")
	if st := state(); st != "open" {
		t.Fatalf("state %q after remap", st)
	}
	qemuIO(t, uri, "read -P 0x5c 1M 64k", "write -P 0x5d 2M 64k", "read -P 0x5d 2M 64k")
}
