package mirror

import (
	"bytes"
	"slices"
	"strings"
	"testing"
	"time"
)

const kib = 1 << 10

func newTestBitmap(t *testing.T, size uint64) *Bitmap {
	t.Helper()
	b, err := NewBitmap(size, 16)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type run struct{ off, n int64 }

func dirtyRuns(b *Bitmap, from uint64) []run {
	var rs []run
	b.Dirty(from, func(off, n int64) bool { rs = append(rs, run{off, n}); return true })
	return rs
}

func TestBitmapWriteWaitsForItsBlock(t *testing.T) {
	b := newTestBitmap(t, 4<<30) // 65,536 regions: two blocks
	if b.Blocks() != 2 {
		t.Fatalf("%d blocks", b.Blocks())
	}
	// A write in a clean region waits for its block.
	need := b.StartWrite(100*kib, 4*kib)
	if got := b.Pending(need); got != 0 {
		t.Fatalf("pending %d, want block 0", got)
	}
	p := make([]byte, BitmapBlock)
	ch := b.Snapshot(0, p)
	if p[0] != 0b10 { // region 1 (64-128 KiB)
		t.Fatalf("block 0 on a leg: % x", p[:8])
	}
	// A second write sets a new bit after the snapshot: it waits for a
	// later write of the block, the first one's need is met by this one.
	need2 := b.StartWrite(1<<20, 4*kib)
	b.Written(0, ch)
	if b.Pending(need) != -1 || b.Pending(need2) != 0 {
		t.Fatalf("after the first block write: pending %d, %d; want -1, 0", b.Pending(need), b.Pending(need2))
	}
	b.Written(0, b.Snapshot(0, p))
	if b.Pending(need2) != -1 {
		t.Fatal("the second write still waits")
	}
	// A write to a region already marked and stored waits for nothing.
	if need3 := b.StartWrite(100*kib, 8*kib); b.Pending(need3) != -1 || need3.Changes != [2]uint64{} {
		t.Fatalf("a write in a marked region waits: %+v", need3)
	}
	// A write across the two blocks waits for both.
	need4 := b.StartWrite(regionsPerBlock<<16-4*kib, 8*kib)
	if need4.First != 0 || need4.Last != 1 || b.Pending(need4) != 0 {
		t.Fatalf("across blocks: %+v pending %d", need4, b.Pending(need4))
	}
	b.Written(0, b.Snapshot(0, p))
	if b.Pending(need4) != 1 {
		t.Fatalf("pending %d, want block 1", b.Pending(need4))
	}
	b.Written(1, b.Snapshot(1, p))
	if b.Pending(need4) != -1 {
		t.Fatal("still pending")
	}
	want := []run{{64 * kib, 64 * kib}, {1 << 20, 64 * kib}, {regionsPerBlock<<16 - 64*kib, 128 * kib}}
	if got := dirtyRuns(b, 0); !slices.Equal(got, want) {
		t.Fatalf("dirty %v, want %v", got, want)
	}
}

func TestBitmapClean(t *testing.T) {
	b := newTestBitmap(t, 4<<30)
	t0 := time.Unix(1000, 0)
	b.StartWrite(0, 4*kib)                   // block 0, ends at t0
	b.StartWrite(regionsPerBlock<<16, 4*kib) // block 1, still in flight
	b.EndWrite(0, 4*kib, t0)
	if got := b.Clean(t0.Add(-time.Second)); len(got) != 0 {
		t.Fatalf("cleaned %v before the block was quiet", got)
	}
	if got := b.Clean(t0); !slices.Equal(got, []int{0}) {
		t.Fatalf("cleaned %v, want block 0 (block 1 has a write in flight)", got)
	}
	if b.IsDirty(0) || !b.IsDirty(regionsPerBlock<<16) {
		t.Fatal("wrong bits cleaned")
	}
	// The clean block goes to the legs like any change.
	need := b.StartWrite(0, 4*kib)
	if b.Pending(need) != 0 {
		t.Fatal("a write after a clean does not wait for its bit")
	}
	b.EndWrite(regionsPerBlock<<16, 4*kib, t0)
	b.EndWrite(0, 4*kib, t0)
	if got := b.Clean(t0); !slices.Equal(got, []int{0, 1}) || len(dirtyRuns(b, 0)) != 0 {
		t.Fatalf("cleaned %v, left %v", got, dirtyRuns(b, 0))
	}
	defer func() {
		if recover() == nil {
			t.Fatal("an EndWrite without a StartWrite passed")
		}
	}()
	b.EndWrite(0, 4*kib, t0)
}

func TestBitmapLoad(t *testing.T) {
	size := uint64(100<<16 + 4096) // 101 regions, the last partial
	b := newTestBitmap(t, size)
	p := make([]byte, BitmapBlock)
	p[0] = 0b1001    // regions 0, 3
	p[12] = 0b10000  // region 100 (word 1, bit 36)
	p[8+4] |= 0b1000 // region 99
	if err := b.Load(0, p); err != nil {
		t.Fatal(err)
	}
	want := []run{{0, 64 * kib}, {3 << 16, 64 * kib}, {99 << 16, 64*kib + 4096}}
	if got := dirtyRuns(b, 0); !slices.Equal(got, want) {
		t.Fatalf("dirty %v, want %v", got, want)
	}
	if got := dirtyRuns(b, 4); !slices.Equal(got, want[2:]) {
		t.Fatalf("dirty from region 4: %v", got)
	}
	// A loaded bit is a change the legs may not all have.
	if need := b.StartWrite(0, 512); b.Pending(need) != 0 {
		t.Fatal("loaded bits count as stored")
	}
	bad := make([]byte, BitmapBlock)
	bad[12] = 0b100000 // region 101: past the last
	if err := b.Load(0, bad); err == nil || !strings.Contains(err.Error(), "past the last") {
		t.Fatalf("a bit past the end: %v", err)
	}
	bad = make([]byte, BitmapBlock)
	bad[BitmapBlock-1] = 0x80
	if err := b.Load(0, bad); err == nil {
		t.Fatal("a bit in the block's last word, past the end, loaded")
	}
	if err := b.Load(1, p); err == nil {
		t.Fatal("block 1 of a one-block bitmap loaded")
	}
	// Snapshot gives the same bytes back.
	out := make([]byte, BitmapBlock)
	b.Snapshot(0, out)
	if !bytes.Equal(out, p) {
		t.Fatalf("snapshot % x, loaded % x", out[:16], p[:16])
	}
}

func TestBitmapBounds(t *testing.T) {
	if _, err := NewBitmap(1<<30, 15); err == nil {
		t.Fatal("32 KiB regions")
	}
	if _, err := NewBitmap(0, 16); err == nil {
		t.Fatal("no data")
	}
	if _, err := NewBitmap(BitmapMax*8<<16+1, 16); err == nil {
		t.Fatal("more regions than the bitmap holds")
	}
	b := newTestBitmap(t, 1<<20)
	for _, w := range []run{{-512, 512}, {0, 0}, {1<<20 - 512, 1024}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("a write of %v passed", w)
				}
			}()
			b.StartWrite(w.off, w.n)
		}()
	}
	// A full bitmap: the runs are found word by word.
	full, err := NewBitmap(BitmapMax*8<<16, 16)
	if err != nil {
		t.Fatal(err)
	}
	p := bytes.Repeat([]byte{0xff}, BitmapBlock)
	for blk := range full.Blocks() {
		if err := full.Load(blk, p); err != nil {
			t.Fatal(err)
		}
	}
	if got := dirtyRuns(full, 0); !slices.Equal(got, []run{{0, BitmapMax * 8 << 16}}) {
		t.Fatalf("full: %v", got)
	}
}
