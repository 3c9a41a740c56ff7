package mirror

import (
	"encoding/binary"
	"fmt"
	"sync"
	"time"
)

// BitmapBlock is the unit the bitmap is written in: 4 KiB, 32,768
// regions.
const (
	BitmapBlock     = 4096
	regionsPerBlock = BitmapBlock * 8
	wordsPerBlock   = BitmapBlock / 8
)

// Bitmap is a mirror's dirty-region bitmap (docs/replication.md, "The
// bitmap"): a set bit says its region may differ between legs. A write
// sets the bits of its regions before it goes out (StartWrite), and may
// go out only once every bitmap block it changed is on the legs
// (Written); its regions become clean again, in memory, when their
// block has had no write in flight for a while and every leg is in sync
// (Clean), and on the legs lazily after that. Counting writes in flight
// per block, not per region, keeps the memory at a few bytes per
// 32,768 regions; a block's regions are cleaned together.
//
// It is safe for concurrent use.
type Bitmap struct {
	shift   uint8
	size    int64 // bytes of data
	regions uint64
	nblocks int // len(blocks), fixed

	mu sync.Mutex
	// +checklocks:mu
	words []uint64
	// +checklocks:mu
	blocks []bitmapBlock
}

type bitmapBlock struct {
	inflight int32
	// quiet is when the last write of the block ended (the clock of
	// the caller).
	quiet time.Time
	// changed counts the changes of the block's bits in memory; stored
	// is the change a completed write of the block to the legs carried.
	changed, stored uint64
}

// NewBitmap is a clean bitmap for dataSize bytes in regions of
// 1<<shift bytes.
func NewBitmap(dataSize uint64, shift uint8) (*Bitmap, error) {
	if shift < minRegionShift || shift > maxRegionShift {
		return nil, fmt.Errorf("mirror: region size 2^%d", shift)
	}
	regions := (dataSize + 1<<shift - 1) >> shift
	if regions == 0 || regions > BitmapMax*8 {
		return nil, fmt.Errorf("mirror: %d regions (1 to %d)", regions, BitmapMax*8)
	}
	nb := (regions + regionsPerBlock - 1) / regionsPerBlock
	if dataSize > 1<<60 {
		return nil, fmt.Errorf("mirror: data size %d", dataSize)
	}
	return &Bitmap{shift: shift, size: int64(dataSize), regions: regions, nblocks: int(nb), words: make([]uint64, nb*wordsPerBlock), blocks: make([]bitmapBlock, nb)}, nil
}

// Blocks is the number of bitmap blocks: its bytes on a leg are
// Blocks()*BitmapBlock from BitmapOff.
func (b *Bitmap) Blocks() int { return b.nblocks }

// Regions is the number of regions.
func (b *Bitmap) Regions() uint64 { return b.regions }

// RegionSize is the bytes of a region.
func (b *Bitmap) RegionSize() int64 { return 1 << b.shift }

// span is the regions [first, last] bytes [off, off+n) touch; n > 0.
func (b *Bitmap) span(off, n int64) (first, last uint64) {
	return uint64(off) >> b.shift, uint64(off+n-1) >> b.shift
}

// Need is what a write must wait for before it goes out: every block in
// [First, Last] stored at least at its change in Changes (a block not
// needing a write has 0). Written reports progress.
type Need struct {
	First, Last int
	// Changes[i] is the change of block First+i to wait for; 0: none.
	Changes [2]uint64
	// More is set when the write spans more than two blocks (over
	// 2 GiB with 64 KiB regions): Pending then tells, block by block.
	More bool
}

// StartWrite sets the bits of the regions [off, off+n) touches and
// counts the write in flight on their blocks. The write may go out when
// Pending(need) is false: until then the caller writes the blocks
// Pending names (Snapshot, then Written).
func (b *Bitmap) StartWrite(off, n int64) Need {
	if n <= 0 || off < 0 || off+n > b.size {
		panic(fmt.Sprintf("mirror: bitmap: a write of [%d, +%d) outside the data", off, n))
	}
	first, last := b.span(off, n)
	need := Need{First: int(first / regionsPerBlock), Last: int(last / regionsPerBlock)}
	need.More = need.Last-need.First >= len(need.Changes)
	b.mu.Lock()
	defer b.mu.Unlock()
	for r := first; r <= last; {
		w, bit := r/64, r%64
		// The bits of this word the range covers.
		span := min(64-bit, last-r+1)
		mask := ^uint64(0) >> (64 - span) << bit
		blk := int(r / regionsPerBlock)
		if b.words[w]&mask != mask {
			b.words[w] |= mask
			b.blocks[blk].changed++
		}
		r += span
	}
	for blk := need.First; blk <= need.Last; blk++ {
		bb := &b.blocks[blk]
		bb.inflight++
		if i := blk - need.First; i < len(need.Changes) && bb.stored < bb.changed {
			need.Changes[i] = bb.changed
		}
	}
	return need
}

// Pending is the first block need still waits for, or -1 when the
// write may go out.
func (b *Bitmap) Pending(need Need) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	for blk := need.First; blk <= need.Last; blk++ {
		bb := &b.blocks[blk]
		want := bb.changed
		if i := blk - need.First; i < len(need.Changes) {
			want = need.Changes[i]
		}
		if bb.stored < want {
			return blk
		}
	}
	return -1
}

// EndWrite counts the write of [off, off+n) done (on every leg, or
// given up), at now.
func (b *Bitmap) EndWrite(off, n int64, now time.Time) {
	first, last := b.span(off, n)
	b.mu.Lock()
	defer b.mu.Unlock()
	for blk := first / regionsPerBlock; blk <= last/regionsPerBlock; blk++ {
		bb := &b.blocks[blk]
		if bb.inflight <= 0 {
			panic("mirror: bitmap: a write ended that did not start")
		}
		bb.inflight--
		bb.quiet = now
	}
}

// Snapshot copies block blk into p (BitmapBlock bytes, as on a leg) and
// returns the change it carries, for Written once the legs have it.
func (b *Bitmap) Snapshot(blk int, p []byte) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, w := range b.words[blk*wordsPerBlock : (blk+1)*wordsPerBlock] {
		binary.LittleEndian.PutUint64(p[8*i:], w)
	}
	return b.blocks[blk].changed
}

// Written records that every leg that must have block blk has its copy
// of change (Snapshot's).
func (b *Bitmap) Written(blk int, change uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if bb := &b.blocks[blk]; change > bb.stored {
		bb.stored = change
	}
}

// Clean clears, in memory, the bits of each block with no write in
// flight since quiet or earlier, and returns the blocks it changed: the
// caller writes them lazily (Snapshot, Written). Only while every leg is
// in sync and nothing is left to reconcile after a crash: the bits of a
// leg away are what it missed, those loaded at assembly what may differ.
func (b *Bitmap) Clean(quiet time.Time) []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	var changed []int
	for blk := range b.blocks {
		bb := &b.blocks[blk]
		if bb.inflight > 0 || bb.quiet.After(quiet) {
			continue
		}
		ws := b.words[blk*wordsPerBlock : (blk+1)*wordsPerBlock]
		if allZeroWords(ws) {
			continue
		}
		clear(ws)
		bb.changed++
		changed = append(changed, blk)
	}
	return changed
}

// Load ORs block blk as read from a leg (p: BitmapBlock bytes) into the
// bitmap: at assembly, the union of the legs' bitmaps is what may
// differ. Bits past the last region are refused: a leg's bitmap is
// input like any other.
func (b *Bitmap) Load(blk int, p []byte) error {
	if blk < 0 || blk >= b.nblocks || len(p) < BitmapBlock {
		return fmt.Errorf("mirror: bitmap block %d of %d (%d bytes)", blk, b.nblocks, len(p))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	base := uint64(blk) * regionsPerBlock
	for i := range wordsPerBlock {
		w := binary.LittleEndian.Uint64(p[8*i:])
		if w == 0 {
			continue
		}
		if end := base + uint64(i)*64; end+64 > b.regions {
			valid := uint64(0)
			if b.regions > end {
				valid = ^uint64(0) >> (64 - (b.regions - end))
			}
			if w&^valid != 0 {
				return fmt.Errorf("mirror: bitmap block %d marks regions past the last (%d)", blk, b.regions)
			}
		}
		old := b.words[blk*wordsPerBlock+i]
		if old|w != old {
			b.words[blk*wordsPerBlock+i] = old | w
			b.blocks[blk].changed++
		}
	}
	return nil
}

// Dirty calls f with each run of set bits, as a byte range of the data
// [off, off+n), in order, from region from on; f returning false stops
// it. It is the resync's list of what to copy.
func (b *Bitmap) Dirty(from uint64, f func(off, n int64) bool) {
	for r := from; r < b.regions; {
		b.mu.Lock()
		for r < b.regions && b.words[r/64]&(1<<(r%64)) == 0 {
			if r%64 == 0 && b.words[r/64] == 0 {
				r += 64
				continue
			}
			r++
		}
		r = min(r, b.regions)
		start := r
		for r < b.regions && b.words[r/64]&(1<<(r%64)) != 0 {
			if r%64 == 0 && b.words[r/64] == ^uint64(0) {
				r += 64
				continue
			}
			r++
		}
		r = min(r, b.regions)
		b.mu.Unlock()
		if r == start {
			return
		}
		off := int64(start) << b.shift
		if !f(off, min(int64(r)<<b.shift, b.size)-off) {
			return
		}
	}
}

// Runs is Dirty's runs from region from on, as [off, n] pairs.
func (b *Bitmap) Runs(from uint64) [][2]int64 {
	var rs [][2]int64
	b.Dirty(from, func(off, n int64) bool {
		rs = append(rs, [2]int64{off, n})
		return true
	})
	return rs
}

// IsDirty says whether the region of byte off is marked.
func (b *Bitmap) IsDirty(off int64) bool {
	r := uint64(off) >> b.shift
	b.mu.Lock()
	defer b.mu.Unlock()
	return r < b.regions && b.words[r/64]&(1<<(r%64)) != 0
}

func allZeroWords(ws []uint64) bool {
	for _, w := range ws {
		if w != 0 {
			return false
		}
	}
	return true
}
