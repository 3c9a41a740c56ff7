// Tests of the IO: the range check, write-through, and errors that name
// the file.

package blockdev

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/test/testfs"
)

// TestPastTheEnd: IO beyond the end fails whole; nothing is written, the
// file does not grow.
func TestPastTheEnd(t *testing.T) {
	path := sparseFile(t, os.TempDir(), 1<<20)
	b := open(t, path, Options{})
	buf := make([]byte, 8192)
	for _, c := range []struct {
		name string
		err  error
		want syscall.Errno
	}{
		{"read straddling the end", b.ReadAt(buf, 1<<20-4096), syscall.EINVAL},
		{"read past the end", b.ReadAt(buf, 2<<20), syscall.EINVAL},
		{"write straddling the end", b.WriteAt(buf, 1<<20-4096, false), syscall.ENOSPC},
		{"write past the end", b.WriteAt(buf, 1<<20, true), syscall.ENOSPC},
		{"negative offset", b.WriteAt(buf, -512, false), syscall.ENOSPC},
		{"discard past the end", b.Discard(1<<20-512, 1024), syscall.ENOSPC},
		{"zeroes past the end", b.WriteZeroes(1<<20, 512, true), syscall.ENOSPC},
	} {
		if !errors.Is(c.err, c.want) || !errors.Is(c.err, ErrOutOfRange) {
			t.Errorf("%s: %v, want %v", c.name, c.err, c.want)
		}
	}
	st, _ := os.Stat(path)
	if st.Size() != 1<<20 {
		t.Fatalf("file grew to %d", st.Size())
	}
	if !testfs.IsHole(t, path, 1<<20-4096) {
		t.Fatal("a refused write wrote the part that fitted")
	}
}

// TestWriteThrough: a write-through backend reports no write cache and
// writes through an O_DSYNC descriptor; discards and write-zeroes work.
func TestWriteThrough(t *testing.T) {
	for _, dir := range dirs {
		t.Run(strings.ReplaceAll(dir, "/", "_"), func(t *testing.T) {
			path := sparseFile(t, dir, 1<<20)
			b := open(t, path, Options{WriteThrough: true})
			if c := b.Caps(); c.WriteCache || c.FUA || !b.WriteThrough() {
				t.Fatalf("write-through caps %+v", c)
			}
			if !dsync(t, b.writer(false)) {
				t.Fatal("a plain write of a write-through backend is not O_DSYNC")
			}
			data := bytes.Repeat([]byte("durable!"), 2048) // 16 KiB
			if err := b.WriteAt(data, 8192, false); err != nil {
				t.Fatal(err)
			}
			if err := b.Discard(8192, 4096); err != nil {
				t.Fatal(err)
			}
			if err := b.WriteZeroes(12288, 4096, true); err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(path)
			if !bytes.Equal(got[8192:16384], make([]byte, 8192)) || !bytes.Equal(got[16384:24576], data[8192:]) {
				t.Fatal("write, discard and write-zeroes did not land")
			}
			plain := open(t, path, Options{})
			if dsync(t, plain.writer(false)) || !dsync(t, plain.writer(true)) || !plain.Caps().WriteCache {
				t.Fatal("a default backend: plain writes must be cached, FUA writes O_DSYNC")
			}
			if ro := open(t, path, Options{ReadOnly: true, WriteThrough: true}); ro.WriteThrough() {
				t.Fatal("a read-only backend claims write-through")
			}
		})
	}
}

func dsync(t *testing.T, f *os.File) bool {
	t.Helper()
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	if err != nil {
		t.Fatal(err)
	}
	return fl&unix.O_DSYNC == unix.O_DSYNC
}

// TestWriteErrorsNamePath: a write that fails on the backend names the
// file, whichever descriptor it went through — the FUA one (O_DSYNC,
// opened through /proc/self/fd) included, and on a write-through backend,
// whose every write goes there. Provoked with a file system that is full.
func TestWriteErrorsNamePath(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small tmpfs")
	}
	mnt := t.TempDir()
	if err := unix.Mount("rnbd-blockdev-test", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	path := sparseFile(t, mnt, 16<<20) // 16 MiB on a file system of 1 MiB
	data := bytes.Repeat([]byte{0x5a}, 2<<20)
	for i, c := range []struct {
		name string
		opts Options
		fua  bool
	}{
		{"plain", Options{}, false},
		{"FUA", Options{}, true},
		{"write-through", Options{WriteThrough: true}, false},
	} {
		b := open(t, path, c.opts)
		// Each past what the one before filled.
		off := int64(i) * 4 << 20
		err := b.WriteAt(data, off, c.fua)
		if !errors.Is(err, syscall.ENOSPC) {
			t.Fatalf("%s write of 2 MiB on a full 1 MiB file system: %v, want ENOSPC", c.name, err)
		}
		if msg := err.Error(); !strings.Contains(msg, path) || strings.Contains(msg, "/proc/") {
			t.Errorf("%s write: %q does not name the file %s", c.name, msg, path)
		}
	}
}
