package blockdev

import (
	"bytes"
	"crypto/rand"
	"errors"
	"os"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// denseFile is a tmpfs file of size bytes of random data: every block
// allocated, so its backend reads through its mapping.
func denseFile(t *testing.T, size int64) (string, []byte) {
	t.Helper()
	onTmpfs(t)
	path := sparseFile(t, "/dev/shm", 0)
	data := make([]byte, size)
	rand.Read(data)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, data
}

func onTmpfs(t *testing.T) {
	t.Helper()
	var fs unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &fs); err != nil || uint32(fs.Type) != tmpfsMagic {
		t.Skip("/dev/shm is not tmpfs")
	}
}

// cur is the backend's current mapping, nil if none.
func cur(b *Backend) []byte {
	if m := b.mp.m.Load(); m != nil {
		if c := m.view[b.viewOf()].Load(); c != nil {
			return *c
		}
	}
	return nil
}

// reads reports whether the backend's reads go through its mapping.
func reads(b *Backend) bool {
	m := b.mp.m.Load()
	return m != nil && m.reads.Load()
}

func blocks(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks
}

// TestMappedIO: on a dense tmpfs file inline reads and writes go through
// the mapping, and they see what system calls wrote and the other way.
func TestMappedIO(t *testing.T) {
	path, data := denseFile(t, 1<<20)
	b := open(t, path, Options{})
	if cur(b) == nil || !reads(b) || !b.mp.writable {
		t.Fatalf("a dense tmpfs file is not mapped for reads and writes: mapped %v reads %v writes %v",
			cur(b) != nil, reads(b), b.mp.writable)
	}
	got := make([]byte, 64<<10)
	if done, err := b.TryReadAt(got, 128<<10); !done || err != nil || !bytes.Equal(got, data[128<<10:][:len(got)]) {
		t.Fatalf("read of the file's data: done %v err %v equal %v", done, err, bytes.Equal(got, data[128<<10:][:len(got)]))
	}
	w := bytes.Repeat([]byte("mapped.."), 1024)
	if done, err := b.TryWriteAt(w, 4096); !done || err != nil {
		t.Fatalf("write: done %v err %v", done, err)
	}
	if err := b.ReadAt(got[:len(w)], 4096); err != nil || !bytes.Equal(got[:len(w)], w) {
		t.Fatalf("a system call's read after a mapped write: err %v equal %v", err, bytes.Equal(got[:len(w)], w))
	}
	w2 := bytes.Repeat([]byte("syscall."), 1024)
	if err := b.WriteAt(w2, 8192, false); err != nil {
		t.Fatal(err)
	}
	if done, err := b.TryReadAt(got[:len(w2)], 8192); !done || err != nil || !bytes.Equal(got[:len(w2)], w2) {
		t.Fatalf("a mapped read after a system call's write: done %v err %v", done, err)
	}
}

// TestMappedReadsAllocateNothing: a read of a hole through a shared
// mapping would allocate its page; so a file with holes, or one that a
// discard may have punched, is read by system calls.
func TestMappedReadsAllocateNothing(t *testing.T) {
	onTmpfs(t)
	t.Run("sparse", func(t *testing.T) {
		path := sparseFile(t, "/dev/shm", 4<<20)
		b := open(t, path, Options{})
		got := make([]byte, 1<<20)
		if done, err := b.TryReadAt(got, 1<<20); !done || err != nil || !bytes.Equal(got, make([]byte, len(got))) {
			t.Fatalf("read of a hole: done %v err %v", done, err)
		}
		if n := blocks(t, path); n != 0 {
			t.Fatalf("reading a hole allocated %d blocks", n)
		}
	})
	t.Run("discard", func(t *testing.T) {
		path, _ := denseFile(t, 4<<20)
		b := open(t, path, Options{})
		if err := b.Discard(1<<20, 2<<20); err != nil {
			t.Fatal(err)
		}
		before := blocks(t, path)
		got := make([]byte, 1<<20)
		if done, err := b.TryReadAt(got, 1<<20); !done || err != nil || !bytes.Equal(got, make([]byte, len(got))) {
			t.Fatalf("read of a discarded range: done %v err %v", done, err)
		}
		if after := blocks(t, path); after != before {
			t.Fatalf("reading a discarded range allocated: %d blocks, then %d", before, after)
		}
	})
	t.Run("preallocated past the end", func(t *testing.T) {
		// As many blocks as its size, some of them past its end:
		// the blocks say dense, the file has a hole.
		path := sparseFile(t, "/dev/shm", 2<<20)
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteAt(make([]byte, 1<<20), 0); err != nil {
			t.Fatal(err)
		}
		if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_KEEP_SIZE, 2<<20, 1<<20); err != nil {
			t.Skipf("fallocate: %v", err)
		}
		b := open(t, path, Options{})
		before := blocks(t, path)
		if done, err := b.TryReadAt(make([]byte, 1<<20), 1<<20); !done || err != nil {
			t.Fatalf("read of the hole: done %v err %v", done, err)
		}
		if after := blocks(t, path); after != before {
			t.Fatalf("reading the hole allocated: %d blocks, then %d", before, after)
		}
	})
	t.Run("write zeroes", func(t *testing.T) {
		path, _ := denseFile(t, 4<<20)
		b := open(t, path, Options{})
		// Zeros written (tmpfs has no zero range): no hole.
		if err := b.WriteZeroes(0, 1<<20, true); err != nil || !reads(b) {
			t.Fatalf("write zeroes without unmap: err %v, mapped reads %v", err, reads(b))
		}
		if err := b.WriteZeroes(0, 1<<20, false); err != nil || reads(b) {
			t.Fatalf("write zeroes that may unmap: err %v, mapped reads %v", err, reads(b))
		}
	})
	t.Run("grown", func(t *testing.T) {
		path, _ := denseFile(t, 1<<20)
		b := open(t, path, Options{})
		if err := os.Truncate(path, 4<<20); err != nil {
			t.Fatal(err)
		}
		if _, _, err := b.Refresh(); err != nil {
			t.Fatal(err)
		}
		before := blocks(t, path)
		got := make([]byte, 1<<20)
		if done, err := b.TryReadAt(got, 2<<20); !done || err != nil {
			t.Fatalf("read of the grown part: done %v err %v", done, err)
		}
		if after := blocks(t, path); after != before {
			t.Fatalf("reading the hole a grow left allocated: %d blocks, then %d", before, after)
		}
	})
}

// TestMappedGrow: a dense file grown and refreshed is mapped again, and
// read through the new mapping.
func TestMappedGrow(t *testing.T) {
	path, _ := denseFile(t, 1<<20)
	b := open(t, path, Options{})
	more := make([]byte, 1<<20)
	rand.Read(more)
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.WriteAt(more, 1<<20)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	if _, now, err := b.Refresh(); err != nil || now != 2<<20 {
		t.Fatalf("refresh: size %d err %v", now, err)
	}
	if m := cur(b); m == nil || len(m) != 2<<20 || !reads(b) {
		t.Fatalf("not mapped again after the grow (reads %v)", reads(b))
	}
	got := make([]byte, 64<<10)
	if !b.readMapped(got, 1<<20+4096) || !bytes.Equal(got, more[4096:][:len(got)]) {
		t.Fatal("the grown part is not read through the mapping")
	}
}

// TestMappedCutUnder: a file cut behind the backend's back faults the
// mapping; the IO is then made by a system call, which says what is
// wrong, and the daemon lives.
func TestMappedCutUnder(t *testing.T) {
	path, _ := denseFile(t, 1<<20)
	b := open(t, path, Options{})
	if err := os.Truncate(path, 64<<10); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if b.readMapped(got, 512<<10) {
		t.Fatal("a read past the cut went through the mapping")
	}
	if done, err := b.TryReadAt(got, 512<<10); !done || !errors.Is(err, syscall.EIO) {
		t.Fatalf("read past the cut: done %v err %v, want EIO", done, err)
	}
	if b.writeMapped(got, 512<<10) {
		t.Fatal("a write past the cut went through the mapping")
	}
}

// TestMappedShared: the opens of one file share its mappings (their page
// tables are paid once); they stay while one of them is open, the last
// Close unmaps them, and a discard through one open stops the mapped
// reads of every open.
func TestMappedShared(t *testing.T) {
	path, data := denseFile(t, 4<<20)
	a := open(t, path, Options{})
	b := open(t, path, Options{})
	ro := open(t, path, Options{ReadOnly: true})
	m := a.mp.m.Load()
	if m == nil || b.mp.m.Load() != m || ro.mp.m.Load() != m {
		t.Fatal("three opens of one file do not share its mappings")
	}
	if ro.mp.writable || len(cur(ro)) == 0 || &cur(ro)[0] == &cur(a)[0] {
		t.Fatal("the read-only open does not read through a read-only mapping of its own")
	}
	got := make([]byte, 4096)
	if !ro.readMapped(got, 8192) || !bytes.Equal(got, data[8192:][:4096]) {
		t.Fatal("the read-only open does not read the file through its mapping")
	}
	a.Close()
	if !b.readMapped(got, 8192) || !bytes.Equal(got, data[8192:][:4096]) {
		t.Fatal("the mapping went with the first of its backends")
	}
	// A discard through b: the read-only open reads by pread from then
	// on, and allocates nothing reading the hole.
	if err := b.Discard(1<<20, 1<<20); err != nil {
		t.Fatal(err)
	}
	before := blocks(t, path)
	if done, err := ro.TryReadAt(make([]byte, 1<<20), 1<<20); !done || err != nil {
		t.Fatalf("read of the hole: done %v err %v", done, err)
	}
	if after := blocks(t, path); after != before {
		t.Fatalf("the other open read the discarded range through its mapping: %d blocks, then %d", before, after)
	}
	b.Close()
	ro.Close()
	if m.view[0].Load() != nil || m.view[1].Load() != nil || !m.done {
		t.Fatal("still mapped after the last Close")
	}
	maps.mu.Lock()
	_, left := maps.m[m.key]
	maps.mu.Unlock()
	if left {
		t.Fatal("a closed mapping is still registered")
	}
	// Opened again (the file has a hole now: written full first), it is
	// mapped afresh.
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	c := open(t, path, Options{})
	if c.mp.m.Load() == m || !c.readMapped(got, 8192) || !bytes.Equal(got, data[8192:][:4096]) {
		t.Fatal("an open after the last Close is not mapped afresh")
	}
}

// TestCopyFaultingHidesOnlyItsOwn: a fault of the mapping is the IO's to
// make by a system call; any other fault still panics.
func TestCopyFaultingHidesOnlyItsOwn(t *testing.T) {
	path, _ := denseFile(t, 1<<20)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), 0, 1<<20, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	if copyFaulting(buf, m[8192:][:4096], m[8192:][:4096]) {
		t.Fatal("a copy from past the end of the file succeeded")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a fault outside the mapping given was hidden")
		}
	}()
	copyFaulting(buf, m[8192:][:4096], buf)
}
