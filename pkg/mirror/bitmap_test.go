package mirror

import (
	"bytes"
	"slices"
	"strings"
	"testing"
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

// TestBitmapClean: a pass (Settle, then Clean) clears the regions not
// written since the pass before, region by region, while others in the
// same block are written all along; never a region with a write in
// flight, nor one written between Settle and Clean, nor any of a block
// with a write in flight from before the last pass.
func TestBitmapClean(t *testing.T) {
	b := newTestBitmap(t, 4<<30)
	const hot, cold, blk1 = 0, 1 << 20, regionsPerBlock << 16
	end := func(off int64, need Need) { b.EndWrite(off, 4*kib, need.Pass) }
	write := func(off int64) { end(off, b.StartWrite(off, 4*kib)) }
	write(cold)
	write(hot)
	need1 := b.StartWrite(blk1, 4*kib) // block 1: in flight until the end
	if got, _ := b.Clean(b.Settle()); len(got) != 0 {
		t.Fatalf("cleaned %v in the period the regions were written", got)
	}
	// Writes to the hot region all along, always one in flight: each
	// pass finds one that started before it and ends soon after, when
	// the next has started. The cold region is cleaned at each pass
	// after one it was not written in, the hot one never.
	inflight := b.StartWrite(hot, 4*kib)
	pass := func() []int {
		got, _ := b.Clean(b.Settle())
		next := b.StartWrite(hot, 4*kib)
		end(hot, inflight)
		inflight = next
		if !b.IsDirty(hot) {
			t.Fatal("the region written all along was cleaned")
		}
		return got
	}
	for i, want := range []struct {
		changed []int
		dirty   bool // the cold region, after
	}{{[]int{0}, false}, {nil, false}, {nil, true}, {[]int{0}, false}} {
		if i == 2 {
			write(cold)
		}
		if got := pass(); !slices.Equal(got, want.changed) || b.IsDirty(cold) != want.dirty {
			t.Fatalf("pass %d: blocks changed %v, the cold region marked %v; want %v, %v", i, got, b.IsDirty(cold), want.changed, want.dirty)
		}
	}
	if !b.IsDirty(blk1) {
		t.Fatalf("dirty %v: want the hot region and block 1's", dirtyRuns(b, 0))
	}
	end(hot, inflight)
	// A region written between Settle and Clean stays marked.
	write(cold)
	b.Settle()
	q := b.Settle()
	write(cold)
	if b.Clean(q); !b.IsDirty(cold) {
		t.Fatal("a region written after Settle was cleaned")
	}
	// Block 1's write started two passes ago and is still in flight:
	// nothing of block 1 is cleaned, even a region it does not touch.
	write(blk1 + 1<<20)
	b.Settle()
	if b.Clean(b.Settle()); !b.IsDirty(blk1) || !b.IsDirty(blk1+1<<20) {
		t.Fatal("block 1 cleaned under a write in flight since before the last pass")
	}
	// The clean region goes to the legs like any change: a write to it
	// waits for its bit.
	b.Settle()
	b.Clean(b.Settle())
	if b.IsDirty(cold) {
		t.Fatal("the cold region is still marked")
	}
	need := b.StartWrite(cold, 4*kib)
	if b.Pending(need) != 0 {
		t.Fatal("a write after a clean does not wait for its bit")
	}
	end(cold, need)
	end(blk1, need1)
	b.Settle()
	marked := 0
	for _, r := range dirtyRuns(b, 0) {
		marked += int(r.n / b.RegionSize())
	}
	if got, n := b.Clean(b.Settle()); !slices.Equal(got, []int{0, 1}) || n != marked || len(dirtyRuns(b, 0)) != 0 {
		t.Fatalf("cleaned blocks %v, %d regions of %d; left %v", got, n, marked, dirtyRuns(b, 0))
	}
	defer func() {
		if recover() == nil {
			t.Fatal("an EndWrite without a StartWrite passed")
		}
	}()
	end(hot, need)
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

// TestBitmapGrow: the regions and blocks added are clean and take
// writes; the marks of before stay; a smaller size or one past what the
// bitmap holds at its region size is refused, and changes nothing.
func TestBitmapGrow(t *testing.T) {
	b, err := NewBitmap(3<<16, minRegionShift) // three regions of 64 KiB
	if err != nil {
		t.Fatal(err)
	}
	need := b.StartWrite(2<<16, 4096)
	b.EndWrite(2<<16, 4096, need.Pass)
	if err := b.Grow(3 << 16); err == nil {
		t.Fatal("grown to the size it has")
	}
	if err := b.Grow(BitmapMax*8<<minRegionShift + 1<<16); err == nil {
		t.Fatal("grown past what the bitmap holds")
	}
	if b.Blocks() != 1 || b.Regions() != 3 {
		t.Fatalf("refused grows changed it: %d blocks, %d regions", b.Blocks(), b.Regions())
	}
	size := uint64(regionsPerBlock+1) << minRegionShift
	if err := b.Grow(size); err != nil {
		t.Fatal(err)
	}
	if b.Blocks() != 2 || bitmapBlocks(size, minRegionShift) != 2 || b.Regions() != regionsPerBlock+1 {
		t.Fatalf("%d blocks, %d regions", b.Blocks(), b.Regions())
	}
	if got := b.Runs(0); len(got) != 1 || got[0] != [2]int64{2 << 16, 1 << 16} {
		t.Fatalf("marked %v, want region 2 alone", got)
	}
	off := int64(regionsPerBlock) << minRegionShift
	need = b.StartWrite(off, 4096)
	if need.First != 1 || b.Pending(need) != 1 {
		t.Fatalf("a write to the block added: %+v, pending %d", need, b.Pending(need))
	}
	b.EndWrite(off, 4096, need.Pass)
	if !b.IsDirty(off) || b.IsDirty(off-1<<16) {
		t.Fatal("the write to the block added marked the wrong region")
	}
}
