package e2e

import (
	"context"
	"github.com/rnbd/rnbd/test/kit"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rnbd"
)

// roMount mounts what at where, read-only: a bind mount of a directory
// (bind: the file system stays writable elsewhere) or a tmpfs remounted
// read-only after fill put its files there (the file system itself is
// read-only). Unmounted at the test's end.
func roMount(t *testing.T, what, where string, bind bool, fill func(dir string)) {
	t.Helper()
	if err := os.MkdirAll(where, 0o755); err != nil {
		t.Fatal(err)
	}
	mount := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("mount", args...).CombinedOutput(); err != nil {
			t.Skipf("mount %s: %v %s", strings.Join(args, " "), err, out)
		}
	}
	if bind {
		mount("--bind", what, where)
	} else {
		mount("-t", "tmpfs", "-o", "size=32m", what, where)
	}
	t.Cleanup(func() { exec.Command("umount", "-l", where).Run() })
	mount("--make-private", where)
	if fill != nil {
		fill(where)
	}
	if bind {
		mount("-o", "remount,bind,ro", where)
	} else {
		mount("-o", "remount,ro", where)
	}
}

// TestMapReadOnlyFileSystem: a read-write export of a file on a file
// system the server sees read-only — as its packaged unit's sandbox
// (ProtectSystem=strict) makes every directory but /srv/rnbd, here a
// read-only bind mount, and a file system mounted read-only — is refused
// at map (EROFS, exit 7), saying why and that --ro exports it; --ro does,
// and a session opens that read-only. An export of the state file that
// became read-only since is served as before, with a warning.
func TestMapReadOnlyFileSystem(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount")
	}
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	if err := os.Mkdir(data, 0o755); err != nil {
		t.Fatal(err)
	}
	kit.SparseFile(t, filepath.Join(data, "vol.img"), 16<<20)
	view := filepath.Join(dir, "view")
	roMount(t, data, view, true, nil)
	frozen := filepath.Join(dir, "frozen")
	roMount(t, "rnbd-e2e", frozen, false, func(d string) { kit.SparseFile(t, filepath.Join(d, "vol.img"), 1<<20) })

	port := freePort(t)
	srv := startServer(t, dir, port)
	onView := filepath.Join(view, "vol.img")
	errOut := srv.fails(7, "map", "vol", onView)
	for _, want := range []string{"export vol: " + onView, "no session could open it read-write", "export it read-only (--ro)",
		"read-only file system"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("map of a read-write export on a read-only bind mount: %q does not say %q", errOut, want)
		}
	}
	// Why: the mount, or where the test runs in a systemd service, its
	// sandbox and the drop-in.
	if !strings.Contains(errOut, "read-only mount (on "+view+")") &&
		!(strings.Contains(errOut, ".service sees read-only") && strings.Contains(errOut, "ReadWritePaths="+view)) {
		t.Errorf("map of a read-write export on a read-only bind mount: %q does not say why", errOut)
	}
	errOut = srv.fails(7, "map", "frozen", filepath.Join(frozen, "vol.img"))
	for _, want := range []string{"mounted read-only (rnbd-e2e on " + frozen + ")", "remount it read-write", "--ro"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("map of a read-write export on a read-only file system: %q does not say %q", errOut, want)
		}
	}
	if recs := srv.records("device", "list"); len(recs) != 0 {
		t.Fatalf("refused exports are listed: %v", recs)
	}
	srv.ok("map", "vol", onView, "--ro")
	srv.ok("map", "rw", filepath.Join(data, "vol.img")) // writable: as before
	c := srv.client("s1", 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.Map(ctx, "vol", rnbd.AccessRO); err != nil {
		t.Fatalf("read-only open of the --ro export: %v", err)
	}

	// An export of the state file whose directory became read-only while
	// the server was down: served, and the server says no session can
	// open it read-write.
	later := filepath.Join(dir, "later")
	if err := os.Mkdir(later, 0o755); err != nil {
		t.Fatal(err)
	}
	kit.SparseFile(t, filepath.Join(later, "vol.img"), 1<<20)
	srv.ok("map", "later", filepath.Join(later, "vol.img"))
	srv.stop()
	roMount(t, later, later, true, nil)
	srv = startServer(t, dir, port)
	kit.WaitFor(t, 10*time.Second, "the warning about the read-only export", func() bool {
		return strings.Contains(srv.out.String(), "export served, but no session can open it read-write")
	})
	served := false
	for _, r := range srv.records("device", "list") {
		served = served || r["devname"] == "later" && r["state"] == "exported"
	}
	if !served {
		t.Fatalf("the read-only state-file export is not served: %v", srv.records("device", "list"))
	}
	srv.stop()
}
