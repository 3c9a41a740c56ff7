package e2e

import (
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestServerPushedResize: rnbd-server resize reaches the client's mapping
// by itself (the client's size poll), new NBD connections see the new
// size and IO in the grown part works; shrinking an export in use needs
// --force.
func TestServerPushedResize(t *testing.T) {
	needTools(t, "qemu-io", "nbdinfo")
	m := mapVol(t, 64<<20, "rs", nil, []string{"--size-poll", "200ms"})
	srv, cl, uri := m.srv, m.cl, m.uri
	size := func() string { return strings.TrimSpace(run(t, time.Minute, "nbdinfo", "--size", uri)) }
	waitSize := func(want int64) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for size() != fmt.Sprint(want) {
			if time.Now().After(deadline) {
				t.Fatalf("the mapping shows %s bytes, want %d", size(), want)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	if s := size(); s != fmt.Sprint(64<<20) {
		t.Fatalf("size %s", s)
	}
	if out := srv.ok("resize", "vol", "128MiB"); !strings.Contains(out, "resized vol from 67108864 to 134217728 bytes") {
		t.Fatalf("resize: %q", out)
	}
	waitSize(128 << 20)
	run(t, time.Minute, "qemu-io", "-f", "raw", "-c", "write -P 0x5a 127M 1M", "-c", "read -P 0x5a 127M 1M", uri)

	// Shrinking what a session has open: refused, busy (exit 5), said why.
	if _, errOut, code := srv.ctl("resize", "vol", "32MiB"); code != 5 || !strings.Contains(errOut, "--force") ||
		!strings.Contains(errOut, "export vol is open 1 time(s), by session rs: shrinking it from 134217728 to 33554432 bytes") {
		t.Fatalf("shrink in use: exit %d %q", code, errOut)
	}
	srv.ok("resize", "vol", "96MiB", "--force")
	waitSize(96 << 20)
	if s := cl.records("device", "list"); len(s) != 1 || s[0]["size"] != float64(96<<20) {
		t.Fatalf("device list: %v", s)
	}
	if !strings.Contains(cl.out.String(), "remote device size changed") {
		t.Fatalf("the client did not log the change:\n%s", cl.out.String())
	}
}

// TestShrinkBehindServer: a mapped 64 MiB file cut to 16 MiB behind the
// server's back (truncate) is an error, not a resize: the client's device
// keeps 64 MiB, the server logs the shrink at error level and counts it
// (rnbd_server_backing_shrinks_total, rnbd_server_device_backing_problem),
// a write past 16 MiB fails with EIO and does not grow the file back, the
// data below 16 MiB reads back intact; once the file is grown back, IO
// past 16 MiB works again.
func TestShrinkBehindServer(t *testing.T) {
	needTools(t, "qemu-io", "nbdinfo", "truncate")
	metrics := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	m := mapVol(t, 64<<20, "shrink", []string{"--metrics-listen", metrics}, []string{"--size-poll", "200ms"})
	srv, cl, vol, uri := m.srv, m.cl, m.vol, m.uri
	qemuIO(t, uri, "write -P 0x5a 0 1M", "write -P 0x5a 15M 1M", "write -P 0xa5 32M 1M", "flush")
	before := fetchMetrics(t, metrics)
	if n := before.sum("rnbd_server_backing_shrinks_total"); n != 0 {
		t.Fatalf("%v shrinks counted before any", n)
	}

	run(t, time.Minute, "truncate", "-s", "16M", vol)
	shrinkLogged := func() bool {
		for _, l := range strings.Split(srv.out.String(), "\n") {
			if strings.Contains(l, "level=error") && strings.Contains(l, "backing store changed behind the server") &&
				strings.Contains(l, "shrank from 67108864 to 16777216") {
				return true
			}
		}
		return false
	}
	kit.WaitFor(t, 20*time.Second, "the server to log the shrink at error level", shrinkLogged)
	after := fetchMetrics(t, metrics)
	if n := after.sum("rnbd_server_backing_shrinks_total", `device="vol"`); n != 1 {
		t.Errorf("rnbd_server_backing_shrinks_total{device=\"vol\"} %v, want 1", n)
	}
	if n := after.sum("rnbd_server_device_backing_problem", `device="vol"`, `session="shrink"`); n != 1 {
		t.Errorf("rnbd_server_device_backing_problem of vol %v, want 1", n)
	}
	lintMetrics(t, "server", after)

	// Four size polls later, the client still has 64 MiB. Each poll
	// reads a block of the device before it asks its size, and nothing
	// else reads it meanwhile: of five more reads, the first may be of a
	// poll under way now, and the four polls before the last are
	// answered.
	polls := func() float64 {
		return fetchMetrics(t, metrics).sum("rnbd_server_device_requests_total", `device="vol"`, `session="shrink"`, `op="read"`)
	}
	from := polls()
	kit.WaitFor(t, 20*time.Second, "four size polls", func() bool { return polls() >= from+5 })
	if d := cl.records("device", "list"); len(d) != 1 || d[0]["size"] != float64(64<<20) {
		t.Fatalf("the client's device after the shrink: %v, want 64 MiB", d)
	}
	if s := strings.TrimSpace(run(t, time.Minute, "nbdinfo", "--size", uri)); s != fmt.Sprint(64<<20) {
		t.Fatalf("the mapping shows %s bytes, want %d", s, 64<<20)
	}
	if strings.Contains(cl.out.String(), "remote device size changed") {
		t.Fatalf("the client followed the shrink:\n%s", cl.out.String())
	}

	// Past 16 MiB: EIO, and the file stays cut.
	out, _ := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 0x11 32M 64k", uri).CombinedOutput()
	if !strings.Contains(string(out), "Input/output error") {
		t.Fatalf("a write past the file's end: %s, want EIO", out)
	}
	out, _ = exec.Command("qemu-io", "-f", "raw", "-c", "read 40M 64k", uri).CombinedOutput()
	if !strings.Contains(string(out), "Input/output error") {
		t.Fatalf("a read past the file's end: %s, want EIO", out)
	}
	if st, err := os.Stat(vol); err != nil || st.Size() != 16<<20 {
		t.Fatalf("the file after a write past its end: %v %v, want it left at 16 MiB", st.Size(), err)
	}
	kit.WaitFor(t, 10*time.Second, "the server to log the write refused", func() bool {
		return strings.Contains(srv.out.String(), "IO past the end of a file that shrank behind the server")
	})
	// Below 16 MiB: intact.
	qemuIO(t, uri, "read -P 0x5a 0 1M", "read -P 0x5a 15M 1M")

	// Grown back: healthy, IO past 16 MiB works again (what was there is
	// gone with the cut: zeros).
	run(t, time.Minute, "truncate", "-s", "64M", vol)
	kit.WaitFor(t, 20*time.Second, "the server to log the recovery", func() bool {
		return strings.Contains(srv.out.String(), "backing store healthy again")
	})
	qemuIO(t, uri, "read -P 0 32M 1M", "write -P 0x22 32M 1M", "read -P 0x22 32M 1M", "read -P 0x5a 0 1M")
	healed := fetchMetrics(t, metrics)
	if n := healed.sum("rnbd_server_device_backing_problem", `device="vol"`); n != 0 {
		t.Errorf("rnbd_server_device_backing_problem of vol %v once healed, want 0", n)
	}
	if n := healed.sum("rnbd_server_backing_shrinks_total", `device="vol"`); n != 1 {
		t.Errorf("rnbd_server_backing_shrinks_total{device=\"vol\"} %v once healed, want 1", n)
	}
}
