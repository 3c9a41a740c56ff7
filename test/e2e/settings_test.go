package e2e

import (
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"path/filepath"
	"strings"
	"testing"
)

// TestSessionSettingsKept: timers given at map time (--set, or in the
// kernel-style map string) and changed by session set are the session's,
// shown by session show, and come back after a restart of the client.
func TestSessionSettingsKept(t *testing.T) {
	dir := t.TempDir()
	kit.SparseFile(t, filepath.Join(dir, "a.img"), 8<<20)
	kit.SparseFile(t, filepath.Join(dir, "b.img"), 8<<20)
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "a", filepath.Join(dir, "a.img"))
	srv.ok("map", "b", filepath.Join(dir, "b.img"))
	cl := startClient(t, dir)
	cl.ok("map", fmt.Sprintf("sessname=st path=ip:127.0.0.1 device_path=a dest_port=%d no_path_timeout=45s", port),
		"--set", "fast_io_fail_tmo=5s", "--set", "max_reconnect_attempts=7", "--set", "ctrl_loss_tmo=10m", "--set", "reconnect_delay=3s")
	show := func() map[string]any {
		t.Helper()
		s := cl.records("session", "show", "st")
		if len(s) != 1 {
			t.Fatalf("session show: %v", s)
		}
		return s[0]
	}
	want := func(k string, v any) {
		t.Helper()
		if got := show()[k]; got != v {
			t.Fatalf("%s = %v, want %v", k, got, v)
		}
	}
	want("no_path_timeout_sec", float64(45))
	want("fast_io_fail_tmo_sec", float64(5))
	want("fast_io_fail_in_sec", nil) // the session has its path
	want("max_reconnect_attempts", float64(7))
	want("ctrl_loss_tmo_sec", float64(600))
	want("reconnect_delay_sec", float64(3))
	cl.ok("session", "set", "st", "fast_io_fail_tmo=off", "mpath_policy=round-robin", "reconnect_delay=2s")
	if _, errOut, code := cl.ctl("session", "set", "st", "reconnect_delay=1ms"); code != 2 || !strings.Contains(errOut, "want a duration from 100ms to 1h0m0s") {
		t.Fatalf("reconnect_delay=1ms: exit %d %q", code, errOut)
	}
	// A bad value among good ones: nothing is applied.
	if _, errOut, code := cl.ctl("session", "set", "st", "no_path_timeout=10s", "fast_io_fail_tmo=soon"); code != 2 || !strings.Contains(errOut, "want a duration or off") {
		t.Fatalf("a bad fast_io_fail_tmo: exit %d %q", code, errOut)
	}
	want("no_path_timeout_sec", float64(45))
	// A second device joins the session; the first goes: the settings
	// stay with the session.
	cl.ok("map", "--sessname", "st", "--path", "ip:127.0.0.1", "--device-path", "b", "--dest-port", fmt.Sprint(port))
	cl.ok("unmap", "rnbd0")
	cl.stop()
	cl = startClient(t, dir)
	want("fast_io_fail_tmo_sec", nil)
	want("mpath_policy", "round-robin")
	want("no_path_timeout_sec", float64(45))
	want("max_reconnect_attempts", float64(7))
	want("ctrl_loss_tmo_sec", float64(600))
	want("reconnect_delay_sec", float64(2))
}
