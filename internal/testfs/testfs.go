// Package testfs has the file checks tests of the backends and of the
// RNBD server share: what a file has allocated, and where its holes are.
package testfs

import (
	"os"
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
