// Tests of the mapping's page bookkeeping: the page bits, and populate,
// which makes the page tables of the pages both allocated and in memory.

package blockdev

import (
	"bytes"
	"math"
	"os"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

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
