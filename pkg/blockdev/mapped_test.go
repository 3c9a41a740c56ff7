// Tests of the IO through the mapping of a tmpfs file: reads and writes,
// holes, grows and cuts, mappings shared between opens, faults, mtimes;
// and the helpers of the mapping's tests.

package blockdev

import (
	"bytes"
	"crypto/rand"
	"errors"
	"os"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

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

// mappedRead reports whether a read of n bytes at off goes through the
// backend's mapping (and makes it).
func mappedRead(b *Backend, off int64, n int) bool {
	return b.readMapped(make([]byte, n), off)
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
	if cur(b) == nil || !mappedRead(b, 0, 1<<20) || !b.mp.writable {
		t.Fatalf("a dense tmpfs file is not mapped for reads and writes: mapped %v reads %v writes %v",
			cur(b) != nil, mappedRead(b, 0, 1<<20), b.mp.writable)
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
// mapping would allocate its page; so the pages of a file that are holes
// — at open, after a discard, a grow — are read by system calls until
// the backend writes them.
func TestMappedReadsAllocateNothing(t *testing.T) {
	onTmpfs(t)
	zeros := make([]byte, 1<<20)
	// readHole reads n bytes of a hole at off: zeros (or want), nothing
	// allocated.
	readHole := func(t *testing.T, b *Backend, path string, off int64, n int, want ...byte) {
		t.Helper()
		if want == nil {
			want = zeros[:n]
		}
		before := blocks(t, path)
		// With huge pages on /dev/shm a write allocates 2 MiB: the
		// rest of them may then be read through the mapping. Either
		// way a read allocates nothing.
		mappedRead(b, off, n)
		got := make([]byte, n)
		if done, err := b.TryReadAt(got, off); !done || err != nil || !bytes.Equal(got, want) {
			t.Fatalf("read of the hole at %d: done %v err %v", off, done, err)
		}
		if after := blocks(t, path); after != before {
			t.Fatalf("reading the hole at %d allocated: %d blocks, then %d", off, before, after)
		}
	}
	t.Run("sparse", func(t *testing.T) {
		path := sparseFile(t, "/dev/shm", 4<<20)
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		_, err = f.WriteAt(bytes.Repeat([]byte{1}, 64<<10), 2<<20)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		b := open(t, path, Options{})
		readHole(t, b, path, 1<<20, 1<<20)
		readHole(t, b, path, 2<<20-4096, 8192, append(make([]byte, 4096), bytes.Repeat([]byte{1}, 4096)...)...) // half data
		if !mappedRead(b, 2<<20, 64<<10) {
			t.Fatal("the data found at open is not read through the mapping")
		}
		// Written through the backend, a hole's pages are there.
		if done, err := b.TryWriteAt(bytes.Repeat([]byte{2}, 6000), 3<<20+100); !done || err != nil {
			t.Fatalf("write: done %v err %v", done, err)
		}
		if !mappedRead(b, 3<<20, 8192) {
			t.Fatal("the pages written are not read through the mapping")
		}
		readHole(t, b, path, 3<<20+8192, 4096)
	})
	t.Run("discard", func(t *testing.T) {
		path, _ := denseFile(t, 4<<20)
		b := open(t, path, Options{})
		// Not the pages it covers only in part: they stay.
		if err := b.Discard(1<<20+512, 2<<20); err != nil {
			t.Fatal(err)
		}
		readHole(t, b, path, 1<<20+4096, 1<<20)
		if !mappedRead(b, 1<<20, 4096) || !mappedRead(b, 3<<20, 4096) {
			t.Fatal("the pages a discard covers in part are not read through the mapping")
		}
		if err := b.WriteAt(zeros[:4096], 2<<20, false); err != nil {
			t.Fatal(err)
		}
		if !mappedRead(b, 2<<20, 4096) {
			t.Fatal("a page written again after a discard is not read through the mapping")
		}
	})
	t.Run("preallocated past the end", func(t *testing.T) {
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
		readHole(t, b, path, 1<<20, 1<<20)
	})
	t.Run("write zeroes", func(t *testing.T) {
		path, _ := denseFile(t, 4<<20)
		b := open(t, path, Options{})
		// Zeros written (tmpfs has no zero range): no hole.
		if err := b.WriteZeroes(0, 1<<20, true); err != nil || !mappedRead(b, 0, 1<<20) {
			t.Fatalf("write zeroes without unmap: err %v, mapped read %v", err, mappedRead(b, 0, 1<<20))
		}
		if err := b.WriteZeroes(0, 1<<20, false); err != nil {
			t.Fatal(err)
		}
		readHole(t, b, path, 0, 1<<20)
	})
	t.Run("shrunk and grown again", func(t *testing.T) {
		// As a forced resize does it, while another open keeps the
		// file's bits.
		path, _ := denseFile(t, 4<<20)
		b := open(t, path, Options{})
		keep := open(t, path, Options{ReadOnly: true})
		if err := b.Cap(1<<20, time.Second, 1); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(path, 1<<20); err != nil {
			t.Fatal(err)
		}
		b.Uncap(1)
		if _, now, err := b.Refresh(); err != nil || now != 1<<20 {
			t.Fatalf("refresh after the cut: size %d err %v", now, err)
		}
		if err := os.Truncate(path, 4<<20); err != nil {
			t.Fatal(err)
		}
		if _, now, err := b.Refresh(); err != nil || now != 4<<20 {
			t.Fatalf("refresh after the grow: size %d err %v", now, err)
		}
		readHole(t, b, path, 2<<20, 1<<20)
		keep.Refresh()
		readHole(t, keep, path, 1<<20, 1<<20)
	})
	t.Run("grown behind its back after a shrink", func(t *testing.T) {
		// The shrink was never seen: the grow walks the file again.
		path, _ := denseFile(t, 4<<20)
		b := open(t, path, Options{})
		if err := os.Truncate(path, 1<<20); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(path, 8<<20); err != nil {
			t.Fatal(err)
		}
		if _, now, err := b.Refresh(); err != nil || now != 8<<20 {
			t.Fatalf("refresh: size %d err %v", now, err)
		}
		readHole(t, b, path, 2<<20, 1<<20)
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
		readHole(t, b, path, 2<<20, 1<<20)
	})
}

// TestMappedGrow: a file grown and refreshed is mapped again, and what
// the backend writes past the old end is read through the new mapping.
func TestMappedGrow(t *testing.T) {
	path, _ := denseFile(t, 1<<20)
	b := open(t, path, Options{})
	if err := os.Truncate(path, 2<<20); err != nil {
		t.Fatal(err)
	}
	if _, now, err := b.Refresh(); err != nil || now != 2<<20 {
		t.Fatalf("refresh: size %d err %v", now, err)
	}
	if m := cur(b); m == nil || len(m) != 2<<20 {
		t.Fatal("not mapped again after the grow")
	}
	more := make([]byte, 64<<10)
	rand.Read(more)
	if done, err := b.TryWriteAt(more, 1<<20+4096); !done || err != nil {
		t.Fatalf("write: done %v err %v", done, err)
	}
	got := make([]byte, len(more))
	if !b.readMapped(got, 1<<20+4096) || !bytes.Equal(got, more) {
		t.Fatal("the grown part is not read through the mapping")
	}
	if !mappedRead(b, 0, 1<<20) {
		t.Fatal("the pages known before the grow are forgotten")
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

// BenchmarkTryIO: the inline IO of a tmpfs export, through the mapping
// and by system calls (mapping off), 4 KiB at random offsets.
func BenchmarkTryIO(b *testing.B) {
	var fs unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &fs); err != nil || uint32(fs.Type) != tmpfsMagic {
		b.Skip("/dev/shm is not tmpfs")
	}
	const size = 16 << 20
	f, err := os.CreateTemp("/dev/shm", "bench-*.img")
	if err != nil {
		b.Fatal(err)
	}
	defer os.Remove(f.Name())
	if _, err := f.WriteAt(make([]byte, size), 0); err != nil {
		b.Fatal(err)
	}
	f.Close()
	offs := make([]int64, 4096)
	for i := range offs {
		offs[i] = int64(i*7919%(size/4096)) * 4096
	}
	for _, mapped := range []bool{true, false} {
		be, err := Open(f.Name(), Options{})
		if err != nil {
			b.Fatal(err)
		}
		if !mapped {
			be.unmap()
		}
		buf := make([]byte, 4096)
		name := map[bool]string{true: "mapped", false: "syscall"}[mapped]
		b.Run(name+"/read", func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				if done, err := be.TryReadAt(buf, offs[i%len(offs)]); !done || err != nil {
					b.Fatal(done, err)
				}
			}
		})
		b.Run(name+"/write", func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				if done, err := be.TryWriteAt(buf, offs[i%len(offs)]); !done || err != nil {
					b.Fatal(done, err)
				}
			}
		})
		be.Close()
	}
}

// TestMappedWritesMoveMtime: writes through the mapping move the file's
// mtime, though they fault no page in: within mtimeLag, at a Flush and
// at Close; reads do not.
func TestMappedWritesMoveMtime(t *testing.T) {
	path, _ := denseFile(t, 1<<20)
	past := time.Now().Add(-time.Hour).Truncate(time.Second)
	setPast := func() {
		t.Helper()
		if err := os.Chtimes(path, past, past); err != nil {
			t.Fatal(err)
		}
	}
	moved := func() bool {
		t.Helper()
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return !st.ModTime().Equal(past)
	}
	w := bytes.Repeat([]byte{5}, 4096)
	write := func(b *Backend) {
		t.Helper()
		if !b.writeMapped(w, 8192) {
			t.Fatal("the write did not go through the mapping")
		}
	}
	synctest.Test(t, func(t *testing.T) {
		b, err := Open(path, Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		b.mp.m.Load().pop.Wait()
		setPast()
		if !mappedRead(b, 0, 1<<20) {
			t.Fatal("the read did not go through the mapping")
		}
		if err := b.Flush(); err != nil || moved() {
			t.Fatalf("a read moved the mtime (flush err %v)", err)
		}
		write(b)
		time.Sleep(mtimeLag)
		synctest.Wait()
		if !moved() {
			t.Fatalf("the mtime did not move within %v of a write", mtimeLag)
		}
		setPast()
		write(b)
		if err := b.Flush(); err != nil || !moved() {
			t.Fatalf("a flush after a write left the mtime (err %v)", err)
		}
		setPast()
		write(b)
		if err := b.Close(); err != nil || !moved() {
			t.Fatalf("a close after a write left the mtime (err %v)", err)
		}
		// A stamp that comes due after the close is not made: its
		// descriptor is closed, and its number likely taken again —
		// here by the same file, where a stamp would show.
		setPast()
		for range 4 { // until one has the backend's number
			again, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer again.Close()
			if int(again.Fd()) == b.nw.fd {
				break
			}
		}
		b.mp.stamp.pending.Store(true)
		b.mp.stamp.timer.Reset(mtimeLag)
		time.Sleep(2 * mtimeLag)
		synctest.Wait()
		if moved() {
			t.Fatal("the mtime moved after the close")
		}
	})
}
