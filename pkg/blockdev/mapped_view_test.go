// Tests of ReadView: large reads of a tmpfs file lent as the mapping
// itself, only when in memory, and across a grow.

package blockdev

import (
	"bytes"
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestReadView: a large read of a dense tmpfs file is lent as the mapping
// itself, and the mapping outlives the backend's Close until the view is
// released; small reads, holes and reads past the end are not lent.
func TestReadView(t *testing.T) {
	path, data := denseFile(t, 4<<20)
	b := open(t, path, Options{})
	if v, h := b.ReadView(4096, viewMin-512); v != nil || h != nil {
		t.Fatal("a read shorter than viewMin was lent")
	}
	if v, _ := b.ReadView(4<<20-viewMin+512, viewMin); v != nil {
		t.Fatal("a read past the end was lent")
	}
	if err := b.Discard(2<<20, 1<<20); err != nil {
		t.Fatal(err)
	}
	if v, _ := b.ReadView(2<<20-4096, viewMin); v != nil {
		t.Fatal("a read of a hole was lent: sending it would allocate its pages")
	}
	off, n := int64(1<<20+512), 256<<10
	v, h := b.ReadView(off, n)
	if v == nil || !bytes.Equal(v, data[off:][:n]) {
		t.Fatalf("a read of the file's data is not lent, or not as the file holds it (lent %v)", v != nil)
	}
	m := b.mp.m.Load()
	b.Close()
	if m.view[0].Load() == nil && m.view[1].Load() == nil {
		t.Fatal("the mapping went at Close with a view still lent")
	}
	if !bytes.Equal(v, data[off:][:n]) {
		t.Fatal("a lent view changed at Close")
	}
	h.Release()
	if m.view[0].Load() != nil || m.view[1].Load() != nil {
		t.Fatal("still mapped after the last view was released")
	}
	var vec [1]byte
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(unsafe.SliceData(v)))&^(1<<pageShift-1), 1<<pageShift, uintptr(unsafe.Pointer(&vec[0]))); e != unix.ENOMEM {
		t.Fatalf("mincore of the released view: %v, want ENOMEM (unmapped)", e)
	}
}

// TestReadViewNotMemory: a file elsewhere than tmpfs is never lent.
func TestReadViewNotMemory(t *testing.T) {
	path := sparseFile(t, t.TempDir(), 1<<20)
	b := open(t, path, Options{})
	if b.nw.mem {
		t.Skip("the test directory is on a memory file system")
	}
	if v, _ := b.ReadView(0, 256<<10); v != nil {
		t.Fatal("a file on disk was lent")
	}
}

// TestInMemory: inMemory tells pages in memory from pages not there yet.
func TestInMemory(t *testing.T) {
	const size = 3 << 20 // more than one mincore vector of 256 pages
	m, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	if inMemory(m[100:]) {
		t.Fatal("pages never touched are in memory")
	}
	for i := 0; i < size; i += 1 << pageShift {
		m[i] = 1
	}
	if !inMemory(m[100:]) || !inMemory(m[:4096]) {
		t.Fatal("pages written are not in memory")
	}
	if err := unix.Madvise(m[size-4096:], unix.MADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if inMemory(m[100:]) {
		t.Fatal("the last page was dropped, yet all of them are in memory")
	}
	if !inMemory(m[100 : size-4096]) {
		t.Fatal("the pages before the one dropped are not in memory")
	}
}

// TestReadViewAcrossGrow: a view lent before a grow, which maps the file
// again, stays as it was through the grow and the last Close of two
// opens of the file, until it is released.
func TestReadViewAcrossGrow(t *testing.T) {
	path, data := denseFile(t, 1<<20)
	a := open(t, path, Options{})
	b := open(t, path, Options{ReadOnly: true})
	v, h := b.ReadView(4096, viewMin)
	if v == nil {
		t.Fatal("not lent")
	}
	if err := os.Truncate(path, 2<<20); err != nil {
		t.Fatal(err)
	}
	for _, x := range []*Backend{a, b} {
		if _, now, err := x.Refresh(); err != nil || now != 2<<20 {
			t.Fatalf("refresh: size %d err %v", now, err)
		}
	}
	m := b.mp.m.Load()
	a.Close()
	b.Close()
	if !bytes.Equal(v, data[4096:][:viewMin]) {
		t.Fatal("a view lent before the grow changed after it and the Close")
	}
	m.mu.Lock()
	old := len(m.old)
	m.mu.Unlock()
	if old == 0 {
		t.Fatal("the mapping replaced by the grow was not kept")
	}
	h.Release()
	m.mu.Lock()
	old = len(m.old)
	m.mu.Unlock()
	if old != 0 || m.view[0].Load() != nil || m.view[1].Load() != nil {
		t.Fatal("still mapped after the view was released")
	}
}
