package e2e

import (
	"fmt"
	"path/filepath"
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
	dir := t.TempDir()
	vol := filepath.Join(dir, "vol.img")
	sparseFile(t, vol, 64<<20)
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "vol", vol)
	cl := startClient(t, dir, "--size-poll", "200ms")
	cl.ok("map", "--sessname", "rs", "--path", "ip:127.0.0.1", "--device-path", "vol", "--dest-port", fmt.Sprint(port))
	uri := "nbd+unix:///vol?socket=" + filepath.Join(dir, "rnbd0.sock")
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
	if _, errOut, code := srv.ctl("resize", "vol", "32MiB"); code != 5 || !strings.Contains(errOut, "--force") {
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
