package mirror

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"sync"
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
// (Written).
//
// Regions become clean again, in memory, region by region, when every
// leg is in sync: a cleaning pass (Settle, a flush of every leg, Clean)
// clears the regions no write has touched since the pass before and no
// write still in flight may touch; on the legs lazily after that. Which
// regions a write touched since the last pass is a second bitmap; what
// is in flight is counted per block, split by whether the write started
// before the last pass or after it, so the memory stays at two bits per
// region and a few bytes per 32,768 regions.
//
// It is safe for concurrent use.
type Bitmap struct {
	shift uint8

	mu sync.Mutex
	// size is the bytes of data, regions theirs: they grow with the
	// mirror (Grow), and the blocks with them.
	// +checklocks:mu
	size int64
	// +checklocks:mu
	regions uint64
	// +checklocks:mu
	words []uint64
	// recent marks the regions of the writes started since the last
	// Settle.
	// +checklocks:mu
	recent []uint64
	// +checklocks:mu
	blocks []bitmapBlock
	// pass counts the Settles.
	// +checklocks:mu
	pass uint64
}

type bitmapBlock struct {
	// young counts writes in flight on the block that started after
	// the last Settle, old those that started before it.
	young, old int32
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
	return &Bitmap{shift: shift, size: int64(dataSize), regions: regions, words: make([]uint64, nb*wordsPerBlock), recent: make([]uint64, nb*wordsPerBlock), blocks: make([]bitmapBlock, nb)}, nil
}

// bitmapBlocks is the number of bitmap blocks of dataSize bytes in
// regions of 1<<shift.
func bitmapBlocks(dataSize uint64, shift uint8) int {
	regions := (dataSize + 1<<shift - 1) >> shift
	return int((regions + regionsPerBlock - 1) / regionsPerBlock)
}

// Grow makes the bitmap one of dataSize bytes (more than it has): the
// regions and blocks added are clean (the caller stores those blocks on
// the legs, bitmapBlocks, before a write can reach them). The region
// size stays: a size whose bitmap would not fit is an error.
func (b *Bitmap) Grow(dataSize uint64) error {
	regions := (dataSize + 1<<b.shift - 1) >> b.shift
	if regions > BitmapMax*8 || dataSize > 1<<60 {
		return fmt.Errorf("mirror: %d bytes in regions of %d: more than the bitmap holds (%d regions)", dataSize, uint64(1)<<b.shift, BitmapMax*8)
	}
	nb := bitmapBlocks(dataSize, b.shift)
	b.mu.Lock()
	defer b.mu.Unlock()
	if int64(dataSize) <= b.size {
		return fmt.Errorf("mirror: the bitmap grows only (%d bytes, asked %d)", b.size, dataSize)
	}
	b.words = append(b.words, make([]uint64, (nb-len(b.blocks))*wordsPerBlock)...)
	b.recent = append(b.recent, make([]uint64, (nb-len(b.blocks))*wordsPerBlock)...)
	b.blocks = append(b.blocks, make([]bitmapBlock, nb-len(b.blocks))...)
	b.size, b.regions = int64(dataSize), regions
	return nil
}

// Blocks is the number of bitmap blocks: its bytes on a leg are
// Blocks()*BitmapBlock from BitmapOff.
func (b *Bitmap) Blocks() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.blocks)
}

// Regions is the number of regions.
func (b *Bitmap) Regions() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.regions
}

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
	// Pass is the cleaning pass the write started in, for EndWrite.
	Pass uint64
}

// StartWrite sets the bits of the regions [off, off+n) touches and
// counts the write in flight on their blocks. The write may go out when
// Pending(need) is false: until then the caller writes the blocks
// Pending names (Snapshot, then Written).
func (b *Bitmap) StartWrite(off, n int64) Need {
	first, last := b.span(off, n)
	need := Need{First: int(first / regionsPerBlock), Last: int(last / regionsPerBlock)}
	need.More = need.Last-need.First >= len(need.Changes)
	b.mu.Lock()
	defer b.mu.Unlock()
	if n <= 0 || off < 0 || off+n > b.size {
		panic(fmt.Sprintf("mirror: bitmap: a write of [%d, +%d) outside the data", off, n))
	}
	need.Pass = b.pass
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
		b.recent[w] |= mask
		r += span
	}
	for blk := need.First; blk <= need.Last; blk++ {
		bb := &b.blocks[blk]
		bb.young++
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
// given up); pass is its StartWrite's Need.Pass.
func (b *Bitmap) EndWrite(off, n int64, pass uint64) {
	first, last := b.span(off, n)
	b.mu.Lock()
	defer b.mu.Unlock()
	for blk := first / regionsPerBlock; blk <= last/regionsPerBlock; blk++ {
		c := &b.blocks[blk].old
		if pass == b.pass {
			c = &b.blocks[blk].young
		}
		if *c <= 0 {
			panic("mirror: bitmap: a write ended that did not start")
		}
		*c--
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

// Quiet is what a Settle found may be cleaned, for Clean.
type Quiet struct {
	blocks []int
	words  []uint64 // wordsPerBlock for each of blocks
}

// Settle begins a cleaning pass: it returns the marked regions that no
// write has touched since the last Settle, in blocks with no write in
// flight that started before it, and starts the next period. Every
// write to a region it returns has ended: once every leg has been
// flushed after Settle, Clean may clear them.
func (b *Bitmap) Settle() Quiet {
	b.mu.Lock()
	defer b.mu.Unlock()
	var q Quiet
	for blk := range b.blocks {
		bb := &b.blocks[blk]
		ws := b.words[blk*wordsPerBlock : (blk+1)*wordsPerBlock]
		rs := b.recent[blk*wordsPerBlock : (blk+1)*wordsPerBlock]
		if bb.old == 0 && !allZeroWords(ws) {
			n := len(q.words)
			some := false
			for i, w := range ws {
				c := w &^ rs[i]
				some = some || c != 0
				q.words = append(q.words, c)
			}
			if some {
				q.blocks = append(q.blocks, blk)
			} else {
				q.words = q.words[:n]
			}
		}
		bb.old += bb.young
		bb.young = 0
		clear(rs)
	}
	b.pass++
	return q
}

// Clean clears, in memory, the regions of q (Settle's) that no write
// has touched since, and returns the blocks it changed: the caller
// writes them lazily (Snapshot, Written). Only while every leg is in
// sync and nothing is left to reconcile after a crash (the bits of a leg
// away are what it missed, those loaded at assembly what may differ),
// and only after every leg was flushed since Settle (what was written to
// a region is durable on every leg before its bit goes). regions is how
// many it cleared.
func (b *Bitmap) Clean(q Quiet) (changed []int, regions int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for k, blk := range q.blocks {
		ws := b.words[blk*wordsPerBlock : (blk+1)*wordsPerBlock]
		rs := b.recent[blk*wordsPerBlock : (blk+1)*wordsPerBlock]
		cs := q.words[k*wordsPerBlock : (k+1)*wordsPerBlock]
		was := false
		for i := range ws {
			if c := cs[i] &^ rs[i] & ws[i]; c != 0 {
				ws[i] &^= c
				regions += bits.OnesCount64(c)
				was = true
			}
		}
		if was {
			b.blocks[blk].changed++
			changed = append(changed, blk)
		}
	}
	return changed, regions
}

// Load ORs block blk as read from a leg (p: BitmapBlock bytes) into the
// bitmap: at assembly, the union of the legs' bitmaps is what may
// differ. Bits past the last region are refused: a leg's bitmap is
// input like any other.
func (b *Bitmap) Load(blk int, p []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if blk < 0 || blk >= len(b.blocks) || len(p) < BitmapBlock {
		return fmt.Errorf("mirror: bitmap block %d of %d (%d bytes)", blk, len(b.blocks), len(p))
	}
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
	for r := from; ; {
		b.mu.Lock()
		regions, size := b.regions, b.size
		for r < regions && b.words[r/64]&(1<<(r%64)) == 0 {
			if r%64 == 0 && b.words[r/64] == 0 {
				r += 64
				continue
			}
			r++
		}
		r = min(r, regions)
		start := r
		for r < regions && b.words[r/64]&(1<<(r%64)) != 0 {
			if r%64 == 0 && b.words[r/64] == ^uint64(0) {
				r += 64
				continue
			}
			r++
		}
		r = min(r, regions)
		b.mu.Unlock()
		if r == start {
			return
		}
		off := int64(start) << b.shift
		if !f(off, min(int64(r)<<b.shift, size)-off) {
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
