package clientd

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/pkg/log"
)

// TestDevLinks: without udev, a mapping's stable name is a link
// DIR/SESSNAME/DEVICE_PATH (a '/' makes a directory) to the device it
// has now; it goes with the mapping, its directories too once empty, but
// not while it names another mapping's device; names that cannot be
// files get none, and a file that is not a link is left alone.
func TestDevLinks(t *testing.T) {
	dir := t.TempDir()
	d := &Daemon{cfg: Config{DevLinksDir: dir}, log: log.Discard()}
	m := api.Mapping{SessName: "host7", DevicePath: "vg/lv1", Device: "rnbd0"}
	link := filepath.Join(dir, "host7", "vg", "lv1")
	for _, target := range []string{"/dev/nbd3", "/dev/nbd5"} {
		d.makeDevLink(m, target)
		if got, err := os.Readlink(link); err != nil || got != target {
			t.Fatalf("%s -> %q %v, want %s", link, got, err, target)
		}
	}
	m.Kernel = "/dev/nbd3" // a mapping whose device the name no longer names
	d.removeDevLink(m)
	if _, err := os.Lstat(link); err != nil {
		t.Fatalf("the link of another device was removed: %v", err)
	}
	m.Kernel = "/dev/nbd5"
	d.removeDevLink(m)
	if _, err := os.Lstat(filepath.Join(dir, "host7")); !os.IsNotExist(err) {
		t.Fatalf("session directory after the last link went: %v", err)
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Fatalf("left in the links' directory: %v", left)
	}
	for _, p := range []string{"", "/", "//"} {
		if l := d.devLink(api.Mapping{SessName: "s", DevicePath: p}); l != "" {
			t.Errorf("device path %q has link %q", p, l)
		}
	}
	// As udev writes link names: what it does not allow becomes '_',
	// and no part leaves the session's directory.
	for p, want := range map[string]string{
		"../../etc/x": "s/__/__/etc/x", "./a": "s/_/a", "a b\tc!d": "s/a_b_c_d", "/abs//x/": "s/abs/x", "zürich": "s/zürich",
	} {
		if l := d.devLink(api.Mapping{SessName: "s", DevicePath: p}); l != filepath.Join(dir, want) {
			t.Errorf("device path %q has link %q, want %s", p, l, filepath.Join(dir, want))
		}
	}
	// Not a link: not ours to remove.
	os.MkdirAll(filepath.Join(dir, "s"), 0o755)
	plain := filepath.Join(dir, "s", "f")
	os.WriteFile(plain, nil, 0o644)
	d.removeDevLink(api.Mapping{SessName: "s", DevicePath: "f", Kernel: "/dev/nbd1"})
	if _, err := os.Stat(plain); err != nil {
		t.Fatalf("a plain file was removed: %v", err)
	}
	if (&Daemon{cfg: Config{}}).devLink(m) != "" {
		t.Error("a link without dev_links_dir")
	}
}

// TestDevLinksUdev: where udev runs, the daemon leaves the name in a file
// named after the kernel device, for the udev rule, and asks udev to
// look at the device again (a change uevent); the file goes with the
// mapping, not while it names another mapping.
func TestDevLinksUdev(t *testing.T) {
	hints, sys := t.TempDir(), t.TempDir()
	os.MkdirAll(filepath.Join(sys, "ublkb2"), 0o755)
	uevent := filepath.Join(sys, "ublkb2", "uevent")
	d := &Daemon{cfg: Config{DevLinksDir: "/dev/rnbd"}, log: log.Discard(), hints: hints, sysBlock: sys}
	m := api.Mapping{SessName: "ub", DevicePath: "disk2", Device: "rnbd1", Kernel: "/dev/ublkb2"}
	d.makeDevLink(m, m.Kernel)
	if b, err := os.ReadFile(filepath.Join(hints, "ublkb2")); err != nil || string(b) != "ub/disk2\n" {
		t.Fatalf("hint %q %v", b, err)
	}
	if b, _ := os.ReadFile(uevent); string(b) != "change" {
		t.Fatalf("uevent %q, want change", b)
	}
	os.Remove(uevent)
	d.removeDevLink(api.Mapping{SessName: "other", DevicePath: "disk2", Kernel: "/dev/ublkb2"})
	if _, err := os.Stat(filepath.Join(hints, "ublkb2")); err != nil {
		t.Fatalf("another mapping's name was withdrawn: %v", err)
	}
	d.removeDevLink(m)
	if _, err := os.Stat(filepath.Join(hints, "ublkb2")); !os.IsNotExist(err) {
		t.Fatalf("hint after unmap: %v", err)
	}
	if b, _ := os.ReadFile(uevent); string(b) != "change" {
		t.Fatalf("uevent after unmap %q, want change", b)
	}
}

// TestDevLinkHolder: two device paths that make one stable name ("a!b"
// and "a_b") — the second mapping is told who holds it; a socket mapping
// and the mapping itself hold nothing.
func TestDevLinkHolder(t *testing.T) {
	d := &Daemon{cfg: Config{DevLinksDir: "/dev/rnbd"}, log: log.Discard(), maps: map[string]*mapped{}}
	first := api.Mapping{SessName: "s", DevicePath: "a!b", Device: "rnbd0", Kernel: "/dev/nbd0"}
	d.maps["rnbd0"] = &mapped{Mapping: first}
	d.maps["rnbd2"] = &mapped{Mapping: api.Mapping{SessName: "s", DevicePath: "c", Device: "rnbd2"}} // a socket
	if h := d.linkHolder(first); h != "" {
		t.Fatalf("a mapping holds its own name from %q", h)
	}
	if h := d.linkHolder(api.Mapping{SessName: "s", DevicePath: "a_b", Device: "rnbd1"}); h != "rnbd0" {
		t.Fatalf("holder of s/a_b %q, want rnbd0", h)
	}
	if h := d.linkHolder(api.Mapping{SessName: "s", DevicePath: "c", Device: "rnbd3"}); h != "" {
		t.Fatalf("a socket mapping holds %q's name", h)
	}
}
