package clientd

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/rnbd/rnbd/internal/log"
)

// TestDevLinks: a mapping's stable name is DIR/SESSNAME/DEVICE_PATH
// ('/' as '!'), points at the device it has now, and goes with the
// mapping, its session's directory too once empty; names that cannot be
// files get none, and a file that is not a link is left alone.
func TestDevLinks(t *testing.T) {
	dir := t.TempDir()
	d := &Daemon{cfg: Config{DevLinksDir: dir}, log: log.Discard()}
	m := Mapping{SessName: "host7", DevicePath: "vg/lv1", Device: "rnbd0"}
	link := filepath.Join(dir, "host7", "vg!lv1")
	for _, target := range []string{"/dev/nbd3", "/dev/nbd5"} {
		d.makeDevLink(m, target)
		if got, err := os.Readlink(link); err != nil || got != target {
			t.Fatalf("%s -> %q %v, want %s", link, got, err, target)
		}
	}
	d.removeDevLink(m)
	if _, err := os.Lstat(filepath.Join(dir, "host7")); !os.IsNotExist(err) {
		t.Fatalf("session directory after the last link went: %v", err)
	}
	for _, p := range []string{"", ".", ".."} {
		if l := d.devLink(Mapping{SessName: "s", DevicePath: p}); l != "" {
			t.Errorf("device path %q has link %q", p, l)
		}
	}
	// Not a link: not ours to remove.
	os.MkdirAll(filepath.Join(dir, "s"), 0o755)
	plain := filepath.Join(dir, "s", "f")
	os.WriteFile(plain, nil, 0o644)
	d.removeDevLink(Mapping{SessName: "s", DevicePath: "f"})
	if _, err := os.Stat(plain); err != nil {
		t.Fatalf("a plain file was removed: %v", err)
	}
	if (&Daemon{cfg: Config{}}).devLink(m) != "" {
		t.Error("a link without dev_links_dir")
	}
}
