// Package history is a checker of a block device's reads against its
// writes: a workload records each write (the block, a value unique to
// it, when it began and how it ended) and each read (what it returned),
// and the checker says which reads no correct device could have given.
// It is what the mirror's fault tests judge by (docs/replication.md):
// fio's verify sees a lost block, not a stale one.
//
// Each block is a register. Time is a logical clock, a tick per event,
// so the checker needs no wall clock and a run replays exactly. A read
// of a block may return the value of a write that began before the read
// ended and that no later acknowledged write had replaced before the
// read began ("superseded": an acknowledged write that began after it
// ended, and ended before the read began). A write that failed ended
// when its error came back; one in flight at a crash ends at the crash
// (Crash): until then its value may or may not have landed. So a read
// may return an acknowledged write, one in flight, one that failed, or
// one whose fate a crash left open — never one older than the last
// acknowledged write before the read began (a stale read), nor a value
// no write had (a lost or corrupt block).
//
// One more rule makes flip-flops errors: once a read returned a write's
// value, no read that begins after it may return a write that ended
// before that write began (it was overwritten, and the device showed
// it).
//
// Only tests import it.
package history

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
)

// Outcome is how a write ended.
type Outcome uint8

const (
	Pending Outcome = iota // not yet ended
	Acked                  // acknowledged: the device promised it
	Failed                 // an error came back: it may or may not have landed
	Unknown                // in flight at a crash
)

func (o Outcome) String() string {
	return [...]string{"pending", "acked", "failed", "unknown"}[o]
}

// Write is one recorded write: its block and the value it writes, fixed;
// its times and outcome, under its history's lock (h.mu: checklocks
// cannot tell that lock from the History's own, so this is prose). Its
// methods are safe for concurrent use.
type Write struct {
	h       *History
	Block   int64
	Value   uint64
	begin   uint64
	end     uint64 // 0 while pending
	outcome Outcome
}

type read struct {
	block      int64
	value      uint64
	begin, end uint64
	w          *Write // the write whose value it returned
}

type blockHist struct {
	writes []*Write // in order of Begin
	byVal  map[uint64]*Write
}

// History records the operations of one device. It is safe for
// concurrent use.
type History struct {
	mu sync.Mutex
	// +checklocks:mu
	tick uint64
	// +checklocks:mu
	blocks map[int64]*blockHist
	// +checklocks:mu
	reads []read
	// +checklocks:mu
	nextVal uint64
	// +checklocks:mu
	initial uint64
}

// New is an empty history of a device whose every block starts with
// value initial (as the workload encodes it: zeroes, say).
func New(initial uint64) *History {
	return &History{blocks: map[int64]*blockHist{}, initial: initial, nextVal: initial + 1}
}

// +checklocks:h.mu
func (h *History) now() uint64 {
	h.tick++
	return h.tick
}

// +checklocks:h.mu
func (h *History) block(b int64) *blockHist {
	bh := h.blocks[b]
	if bh == nil {
		// The block's first value, as a write acknowledged at time 0.
		w := &Write{h: h, Block: b, Value: h.initial, outcome: Acked}
		bh = &blockHist{writes: []*Write{w}, byVal: map[uint64]*Write{h.initial: w}}
		h.blocks[b] = bh
	}
	return bh
}

// BeginWrite records the start of a write to block b and returns it,
// with the value to write: unique in the history.
func (h *History) BeginWrite(b int64) *Write {
	h.mu.Lock()
	defer h.mu.Unlock()
	bh := h.block(b)
	w := &Write{h: h, Block: b, Value: h.nextVal, begin: h.now()}
	h.nextVal++
	bh.writes = append(bh.writes, w)
	bh.byVal[w.Value] = w
	return w
}

// Outcome is how the write ended so far (Pending while it has not).
func (w *Write) Outcome() Outcome {
	w.h.mu.Lock()
	defer w.h.mu.Unlock()
	return w.outcome
}

// Done records how the write ended: acknowledged (err nil) or failed.
func (w *Write) Done(err error) {
	h := w.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if w.outcome != Pending {
		panic(fmt.Sprintf("history: write %d to block %d ended twice", w.Value, w.Block))
	}
	w.end = h.now()
	w.outcome = Acked
	if err != nil {
		w.outcome = Failed
	}
}

// Crash ends every write still pending as Unknown: the device's client
// died with them in flight.
func (h *History) Crash() {
	h.mu.Lock()
	defer h.mu.Unlock()
	t := h.now()
	for _, bh := range h.blocks {
		for _, w := range bh.writes {
			if w.outcome == Pending {
				w.outcome, w.end = Unknown, t
			}
		}
	}
}

// Read is a read under way.
type Read struct {
	h     *History
	block int64
	begin uint64
}

// BeginRead records the start of a read of block b.
func (h *History) BeginRead(b int64) Read {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.block(b)
	return Read{h: h, block: b, begin: h.now()}
}

// Done records the value the read returned. A value no write of the
// block had is an error at once (a lost or corrupt block); whether it
// was stale is Check's.
func (r Read) Done(value uint64) error {
	h := r.h
	h.mu.Lock()
	defer h.mu.Unlock()
	end := h.now()
	w := h.blocks[r.block].byVal[value]
	if w == nil {
		return fmt.Errorf("history: block %d read value %d, which no write of it had", r.block, value)
	}
	h.reads = append(h.reads, read{block: r.block, value: value, begin: r.begin, end: end, w: w})
	return nil
}

// Stats counts what a history holds.
type Stats struct {
	Writes  map[Outcome]int
	Reads   int
	Blocks  int
	Checked int
}

// Violation is a read no correct device could have returned.
type Violation struct {
	Block      int64
	Value      uint64
	Begin, End uint64
	Why        string
}

func (v Violation) String() string {
	return fmt.Sprintf("block %d: a read [%d, %d] returned value %d: %s", v.Block, v.Begin, v.End, v.Value, v.Why)
}

// Check judges every read recorded and returns those no correct device
// could have given, and what the history holds.
func (h *History) Check() ([]Violation, Stats) {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := Stats{Writes: map[Outcome]int{}, Reads: len(h.reads), Blocks: len(h.blocks)}
	for _, bh := range h.blocks {
		for _, w := range bh.writes[1:] {
			st.Writes[w.outcome]++
		}
	}
	reads := slices.Clone(h.reads)
	slices.SortFunc(reads, func(a, b read) int { return cmp.Compare(a.begin, b.begin) })
	// seen[b]: the reads of b judged so far: a later read must not
	// return a write that ended before theirs began.
	seen := map[int64][]read{}
	var bad []Violation
	for _, r := range reads {
		st.Checked++
		v := Violation{Block: r.block, Value: r.value, Begin: r.begin, End: r.end}
		w := r.w // began before the read ended: Done found it
		if by := supersededBy(h.blocks[r.block], w, r.begin); by != nil {
			v.Why = fmt.Sprintf("stale: write %d (acknowledged [%d, %d]) had replaced it (%s [%d, %d]) before the read began",
				by.Value, by.begin, by.end, w.outcome, w.begin, w.end)
			bad = append(bad, v)
			continue
		}
		for _, p := range seen[r.block] {
			if p.end < r.begin && w.outcome != Pending && w.end < p.w.begin {
				v.Why = fmt.Sprintf("flip-flop: a read that ended at %d returned write %d (began %d), which overwrote this one (ended %d)",
					p.end, p.w.Value, p.w.begin, w.end)
				bad = append(bad, v)
				break
			}
		}
		seen[r.block] = append(seen[r.block], r)
	}
	return bad, st
}

// supersededBy is an acknowledged write of bh that began after w ended
// and ended before t, or nil. A pending write never ends, so nothing
// supersedes it.
func supersededBy(bh *blockHist, w *Write, t uint64) *Write {
	if w.outcome == Pending {
		return nil
	}
	for _, x := range bh.writes {
		if x.outcome == Acked && x.begin > w.end && x.end < t {
			return x
		}
	}
	return nil
}

// Fill writes a block's content for a write of value to block blk: the
// value and the block's number, over and over, so that a read can tell
// a torn block or another block's content from the write's. Zeroes are
// value 0 (History's initial value in the tests).
func Fill(b []byte, blk int64, value uint64) {
	for i := 0; i+16 <= len(b); i += 16 {
		binary.LittleEndian.PutUint64(b[i:], value)
		binary.LittleEndian.PutUint64(b[i+8:], uint64(blk))
	}
}

// ValueOf is the value of block blk's content as Fill wrote it, or an
// error for a block no Fill of blk could have written.
func ValueOf(b []byte, blk int64) (uint64, error) {
	zero := true
	for _, c := range b {
		if c != 0 {
			zero = false
			break
		}
	}
	if zero {
		return 0, nil
	}
	v := binary.LittleEndian.Uint64(b)
	for i := 0; i+16 <= len(b); i += 16 {
		if binary.LittleEndian.Uint64(b[i:]) != v || binary.LittleEndian.Uint64(b[i+8:]) != uint64(blk) {
			return 0, fmt.Errorf("block %d holds a torn or foreign block (value %d, block %d; at byte %d: value %d, block %d)",
				blk, v, binary.LittleEndian.Uint64(b[8:]), i, binary.LittleEndian.Uint64(b[i:]), binary.LittleEndian.Uint64(b[i+8:]))
		}
	}
	return v, nil
}
