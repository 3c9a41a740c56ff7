package blockdev

import (
	"bytes"
	"crypto/rand"
	"errors"
	"math"
	"os"
	"runtime"
	"syscall"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

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

// TestPageBits: the pages a range touches, covers whole, or has known.
func TestPageBits(t *testing.T) {
	const pg = 1 << pageShift
	p := newPageBits(200 * pg) // words 0..3
	p.set(63*pg+1, 2*pg)       // touches pages 63, 64, 65
	for i, want := range map[int64]bool{62: false, 63: true, 64: true, 65: true, 66: false} {
		if got := p.all(i*pg, pg); got != want {
			t.Errorf("page %d known %v, want %v", i, got, want)
		}
	}
	if !p.all(63*pg+100, 2*pg) || p.all(62*pg, 2*pg) || !p.all(70*pg, 0) {
		t.Error("ranges over known pages")
	}
	p.clear(63*pg+1, 2*pg) // covers only page 64 whole
	if !p.all(63*pg, pg) || p.all(64*pg, pg) || !p.all(65*pg, pg) {
		t.Error("clear of a range covering one page whole")
	}
	p.set(0, 200*pg)
	p.clear(128*pg, math.MaxInt64) // to the end, past the bits
	if !p.all(0, 128*pg) || p.all(128*pg, pg) || p.all(199*pg, pg) {
		t.Error("clear to the end")
	}
	if p.all(300*pg, pg) {
		t.Error("a page past the bits is known")
	}
	p.set(300*pg, pg) // past the bits: nothing
	q := p.grown(400 * pg)
	if !q.all(0, 128*pg) || q.all(128*pg, pg) || q.all(300*pg, pg) || len(*q) <= len(*p) {
		t.Error("grown bits")
	}
	if p.grown(10*pg) != p {
		t.Error("bits grown to a smaller size are not the same")
	}
}

func TestPageBitsRuns(t *testing.T) {
	const pg = 1 << pageShift
	p := newPageBits(200 * pg)
	p.set(0, 2*pg)
	p.set(63*pg, 3*pg) // across a word's end
	p.set(199*pg, pg)  // the last page
	type run struct{ off, n int64 }
	collect := func(off, end int64) (rs []run) {
		for a, n := range p.runs(off, end) {
			rs = append(rs, run{a, n})
		}
		return rs
	}
	for _, c := range []struct {
		off, end int64
		want     []run
	}{
		{0, 200 * pg, []run{{0, 2 * pg}, {63 * pg, 3 * pg}, {199 * pg, pg}}},
		{pg + 10, 64 * pg, []run{{pg + 10, pg - 10}, {63 * pg, pg}}}, // clipped both ends
		{2 * pg, 63 * pg, nil},
		{199*pg + 100, 400 * pg, []run{{199*pg + 100, pg - 100}}}, // end past the bits: the pages past them are not known
		{5 * pg, 5 * pg, nil},
	} {
		got := collect(c.off, c.end)
		if len(got) != len(c.want) {
			t.Errorf("runs(%d, %d) = %v, want %v", c.off, c.end, got, c.want)
			continue
		}
		for i := range got {
			if got[i] != c.want[i] {
				t.Errorf("runs(%d, %d) = %v, want %v", c.off, c.end, got, c.want)
				break
			}
		}
	}
}

// TestMappedPopulate: the mapping of a tmpfs file gets the page tables
// of its data pages ahead of the IO, so that a write faults no page in;
// its holes stay holes and its mtime stays.
func TestMappedPopulate(t *testing.T) {
	onTmpfs(t)
	const size = 8 << 20
	path := sparseFile(t, "/dev/shm", size)
	data := bytes.Repeat([]byte{7}, 3<<20)
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err1 := f.WriteAt(data, 0)       // data, then a hole of 2 MiB,
	_, err2 := f.WriteAt(data, 5<<20-1) // data to the end (its first page partly)
	f.Close()
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	before := blocks(t, path)
	b := open(t, path, Options{})
	m := b.mp.m.Load()
	if m == nil || !b.mp.writable {
		t.Fatal("the file is not mapped for writes")
	}
	m.pop.Wait()
	if after := blocks(t, path); after != before {
		t.Fatalf("populate allocated the hole: %d blocks, then %d", before, after)
	}
	if err := unix.Madvise(cur(b)[:1<<pageShift], unix.MADV_POPULATE_READ); err == unix.EINVAL {
		t.Skip("the kernel has no MADV_POPULATE_READ (Linux 5.14)")
	}
	// 64 writes of a page each, through the mapping, across the data:
	// none faults a page in.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	w := bytes.Repeat([]byte{9}, 1<<pageShift)
	faults := func() int64 {
		var ru unix.Rusage
		if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
			t.Fatal(err)
		}
		return ru.Minflt + ru.Majflt
	}
	b.TryWriteAt(w, 0) // the code and stack of the path, warm
	n0 := faults()
	for i := int64(1); i <= 64; i++ {
		off := i * (size - 1<<pageShift) / 64 &^ (1<<pageShift - 1)
		if off >= 3<<20 && off < 5<<20 {
			off -= 2 << 20 // not into the hole
		}
		if done, err := b.TryWriteAt(w, off); !done || err != nil {
			t.Fatalf("write at %d: done %v err %v", off, done, err)
		}
	}
	// Unpopulated, most of them fault (48 of the 64 here); the race
	// detector's shadow memory takes a few of its own.
	if n := faults() - n0; n > 16 {
		t.Fatalf("64 writes to populated pages took %d page faults", n)
	}
	// The open's discard probe moves a tmpfs file's mtime; populate,
	// made again, must not.
	past := time.Now().Add(-time.Hour).Truncate(time.Second)
	if err := os.Chtimes(path, past, past); err != nil {
		t.Fatal(err)
	}
	m.pop.Add(1)
	m.populate(b.viewOf(), cur(b))
	if st, err := os.Stat(path); err != nil || !st.ModTime().Equal(past) {
		t.Fatalf("populate moved the mtime: %v (err %v), was %v", st.ModTime(), err, past)
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

// TestResidentRuns: populate makes only pages both allocated and in
// memory.
func TestResidentRuns(t *testing.T) {
	const pg = 1 << pageShift
	p := newPageBits(16 * pg)
	p.set(0, 6*pg)
	p.set(8*pg, 8*pg)
	vec := make([]byte, 16)
	for _, i := range []int{0, 1, 3, 4, 5, 6, 7, 8, 9, 15} {
		vec[i] = 1 // page 2 swapped out; 6, 7 holes; 10–14 swapped out
	}
	type run struct{ off, n int64 }
	var got []run
	for a, n := range residentRuns(0, 16*pg-100, p, vec) {
		got = append(got, run{a, n})
	}
	want := []run{{0, 2 * pg}, {3 * pg, 3 * pg}, {8 * pg, 2 * pg}, {15 * pg, pg - 100}}
	if len(got) != len(want) {
		t.Fatalf("runs %v, want %v", got, want)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("runs %v, want %v", got, want)
		}
	}
}

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
