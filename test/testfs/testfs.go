// Package testfs has the file checks tests of the backends and of the
// RNBD server share: what a file has allocated, and where its holes are;
// and the file systems they need: one that hangs, one with reflinks.
package testfs

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Allocated returns the bytes the file at path has allocated (st_blocks).
func Allocated(t testing.TB, path string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// IsHole reports whether the byte at off is in a hole of the file
// (SEEK_HOLE lands on off).
func IsHole(t testing.TB, path string, off int64) bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h, err := unix.Seek(int(f.Fd()), off, unix.SEEK_HOLE)
	if err != nil {
		t.Fatal(err)
	}
	return h == off
}

// HungMount mounts a FUSE file system that never answers (its device is
// opened and never read), as a hard NFS mount of a server that is gone:
// every stat under it waits until the test ends, when closing the device
// aborts the connection. It skips the test where it cannot mount (not
// root, no FUSE).
func HungMount(t testing.TB) string {
	t.Helper()
	return HungMountAt(t, t.TempDir())
}

// HungMountAt mounts the file system of HungMount on mnt, over what the
// directory held: a path under it that answered stops answering, as a
// mount does whose server goes away.
func HungMountAt(t testing.TB, mnt string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("no FUSE here: %v", err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", fd)
	if err := unix.Mount("rnbd-test", mnt, "fuse", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		unix.Close(fd)
		t.Skipf("mounting FUSE: %v", err)
	}
	t.Cleanup(func() {
		unix.Close(fd) // aborts the connection: every stat waiting returns ENOTCONN
		if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
			t.Errorf("unmounting %s: %v", mnt, err)
		}
	})
	return mnt
}

// ReflinkDir mounts a small XFS file system (reflinks on) on a loop
// device and returns a directory in it, unmounted when the test ends:
// where clones and snapshots by FICLONE work, as the machine's own
// file system (ext4) cannot. It skips the test where it cannot mount
// (not root); a missing mkfs.xfs is an error (make deps installs
// xfsprogs).
func ReflinkDir(t testing.TB) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	if _, err := exec.LookPath("mkfs.xfs"); err != nil {
		t.Fatal("mkfs.xfs is missing (make deps installs xfsprogs)")
	}
	dir := t.TempDir()
	img, mnt := filepath.Join(dir, "xfs.img"), filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, c := range [][]string{{"truncate", "-s", "512M", img}, {"mkfs.xfs", "-q", "-m", "reflink=1", img}, {"mount", "-o", "loop", img, mnt}} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(c, " "), err, out)
		}
	}
	t.Cleanup(func() {
		// Lazily, so a daemon the test has not reaped yet does not
		// keep it; the loop device goes with the last reference. (A
		// test may have unmounted it itself.)
		var a, b unix.Stat_t
		if unix.Stat(mnt, &a) == nil && unix.Stat(dir, &b) == nil && a.Dev == b.Dev {
			return
		}
		if out, err := exec.Command("umount", "-l", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v\n%s", mnt, err, out)
		}
	})
	pool := filepath.Join(mnt, "pool")
	if err := os.Mkdir(pool, 0o755); err != nil {
		t.Fatal(err)
	}
	return pool
}
