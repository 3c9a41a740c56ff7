package mirror

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"unicode/utf8"
)

// The metadata area at the start of every leg (docs/replication.md, "The
// metadata"). A witness has only the two superblock slots.
const (
	SlotSize   = 4096    // one superblock
	Slot0Off   = 4096    // superblock slot 0
	Slot1Off   = 8192    // superblock slot 1
	BitmapOff  = 1 << 20 // the dirty-region bitmap
	BitmapMax  = 4 << 20 // its most bytes
	DataOff    = 8 << 20 // where a leg's data starts
	WitnessEnd = 3 * 4096

	MaxLegs      = 3
	WitnessIndex = 3 // a superblock's Index when it is the witness's
	HistoryLen   = 8

	minRegionShift     = 16 // 64 KiB
	maxRegionShift     = 30 // 1 GiB
	defaultRegionShift = 22 // 4 MiB
	version            = 1
)

var magic = [8]byte{'R', 'N', 'B', 'D', 'M', 'I', 'R', '1'}

// Field offsets within a superblock.
const (
	offMagic    = 0
	offVersion  = 8
	offCRC      = 12
	offMirror   = 16
	offSeq      = 32
	offIndex    = 40
	offNLegs    = 41
	offFlags    = 42
	offShift    = 43
	offReserved = 44
	offDataSize = 48
	offGen      = 56
	offHistory  = 72
	offLegs     = offHistory + HistoryLen*16 // 200
	legEntry    = 32
	offForcedAt = offLegs + MaxLegs*legEntry // 296
	offForcedBy = offForcedAt + 8            // 304
	forcedByLen = 64
	offEnd      = offForcedBy + forcedByLen // 368: zero from here
)

// Flags of a superblock.
const (
	FlagWitness uint8 = 1 << 0 // the mirror has a witness
	FlagForced  uint8 = 1 << 1 // its last assembly was forced
	flagsKnown        = FlagWitness | FlagForced
)

// LegState is a leg's state in a generation.
type LegState uint8

const (
	LegNone      LegState = iota // no leg in this slot (never in a valid table)
	LegInSync                    // holds every acknowledged write; serves reads
	LegOutdated                  // missed writes; neither reads nor writes
	LegResyncing                 // being copied to: writes, no reads
)

func (s LegState) String() string {
	switch s {
	case LegNone:
		return "none"
	case LegInSync:
		return "in sync"
	case LegOutdated:
		return "outdated"
	case LegResyncing:
		return "resyncing"
	}
	return fmt.Sprintf("LegState(%d)", uint8(s))
}

// Gen is a generation. Epoch is bumped by every assembly, to one past
// the newest it read from a read quorum; Seq by every change of the
// legs' states the running mirror makes after it (a leg taken out, a
// leg in sync again). Generations are ordered by (Epoch, Seq); ID, random,
// tells apart two of one number that went separate ways (an assembly
// that crashed before its commit, and the next one, which could not see
// it).
type Gen struct {
	Epoch uint32
	Seq   uint32
	ID    uint64
}

func (g Gen) String() string { return fmt.Sprintf("%d.%d/%016x", g.Epoch, g.Seq, g.ID) }

// Before says whether g is ordered before h.
func (g Gen) Before(h Gen) bool {
	return g.Epoch < h.Epoch || g.Epoch == h.Epoch && g.Seq < h.Seq
}

// SameNumber says whether g and h have one (Epoch, Seq).
func (g Gen) SameNumber(h Gen) bool { return g.Epoch == h.Epoch && g.Seq == h.Seq }

// Derive is the superblock of the next generation the running mirror
// makes from sb (its Seq bumped, sb's generation pushed onto the
// history), for the caller to change the legs' states in and commit.
func (sb *Superblock) Derive(id uint64) Superblock {
	next := *sb
	next.pushHistory(sb)
	next.Gen = Gen{Epoch: sb.Gen.Epoch, Seq: sb.Gen.Seq + 1, ID: id}
	return next
}

// pushHistory makes sb's history base's generation, then base's history.
func (sb *Superblock) pushHistory(base *Superblock) {
	h := base.History
	sb.History[0] = base.Gen
	copy(sb.History[1:], h[:HistoryLen-1])
}

// Leg is a leg's entry in a superblock's table.
type Leg struct {
	UUID  [16]byte // the leg device's own id, written when it joined
	State LegState
	// Cursor is, for a resyncing leg, the regions copied to it so far
	// (from the start); 0 otherwise.
	Cursor uint64
}

// Superblock is one voter's record of the mirror.
type Superblock struct {
	Mirror      [16]byte
	Seq         uint64 // this voter's superblock writes: the newer slot wins
	Index       uint8  // 0..NLegs-1 a leg, WitnessIndex the witness
	NLegs       uint8
	Flags       uint8
	RegionShift uint8
	DataSize    uint64 // bytes of data on every leg, after DataOff
	Gen         Gen
	History     [HistoryLen]Gen // the generations before Gen, newest first; zero-padded
	Legs        [MaxLegs]Leg
	ForcedAt    int64 // Unix seconds of the last forced assembly; 0 never
	ForcedBy    string
}

// Regions is the number of regions of the data (bits of the bitmap).
func (sb *Superblock) Regions() uint64 {
	return (sb.DataSize + 1<<sb.RegionShift - 1) >> sb.RegionShift
}

// IsWitness says whether the superblock is the witness's.
func (sb *Superblock) IsWitness() bool { return sb.Index == WitnessIndex }

// InHistory says whether g is sb's generation or one of those before it.
func (sb *Superblock) InHistory(g Gen) bool {
	if g == sb.Gen {
		return true
	}
	for _, h := range sb.History {
		if h == g {
			return true
		}
	}
	return false
}

// historyCovers says whether the history reaches back to g: when it is
// full, a generation older than its oldest entry can be neither
// confirmed nor ruled out.
func (sb *Superblock) historyCovers(g Gen) bool {
	last := sb.History[HistoryLen-1]
	return last == (Gen{}) || !g.Before(last)
}

// RegionShiftFor is the log2 of the region size for a data size: 4 MiB,
// or the smallest power of two that keeps the bitmap within BitmapMax
// (docs/replication.md, "The bitmap", says why 4 MiB).
func RegionShiftFor(dataSize uint64) uint8 {
	return regionShiftFrom(dataSize, defaultRegionShift)
}

// regionShiftFrom is the smallest region shift from s up that keeps the
// bitmap of dataSize within BitmapMax.
func regionShiftFrom(dataSize uint64, s uint8) uint8 {
	for s < maxRegionShift && (dataSize+1<<s-1)>>s > BitmapMax*8 {
		s++
	}
	return s
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Encode writes sb into b[:SlotSize], checksum included. sb must be
// valid (Check); an invalid one is an error and b is left alone.
func (sb *Superblock) Encode(b []byte) error {
	if len(b) < SlotSize {
		return fmt.Errorf("mirror: superblock buffer of %d bytes, want %d", len(b), SlotSize)
	}
	if err := sb.Check(); err != nil {
		return err
	}
	b = b[:SlotSize]
	clear(b)
	le := binary.LittleEndian
	copy(b[offMagic:], magic[:])
	le.PutUint32(b[offVersion:], version)
	copy(b[offMirror:], sb.Mirror[:])
	le.PutUint64(b[offSeq:], sb.Seq)
	b[offIndex], b[offNLegs], b[offFlags], b[offShift] = sb.Index, sb.NLegs, sb.Flags, sb.RegionShift
	le.PutUint64(b[offDataSize:], sb.DataSize)
	putGen(b[offGen:], sb.Gen)
	for i, h := range sb.History {
		putGen(b[offHistory+16*i:], h)
	}
	for i, l := range sb.Legs {
		e := b[offLegs+legEntry*i:]
		copy(e, l.UUID[:])
		e[16] = uint8(l.State)
		le.PutUint64(e[24:], l.Cursor)
	}
	le.PutUint64(b[offForcedAt:], uint64(sb.ForcedAt))
	copy(b[offForcedBy:offForcedBy+forcedByLen], sb.ForcedBy)
	le.PutUint32(b[offCRC:], crcOf(b))
	return nil
}

// crcOf is the checksum of the superblock in b[:SlotSize], computed with
// its own field as zero.
func crcOf(b []byte) uint32 {
	var zero [4]byte
	h := crc32.Update(0, castagnoli, b[:offCRC])
	h = crc32.Update(h, castagnoli, zero[:])
	return crc32.Update(h, castagnoli, b[offCRC+4:SlotSize])
}

func putGen(b []byte, g Gen) {
	binary.LittleEndian.PutUint32(b, g.Epoch)
	binary.LittleEndian.PutUint32(b[4:], g.Seq)
	binary.LittleEndian.PutUint64(b[8:], g.ID)
}

func getGen(b []byte) Gen {
	le := binary.LittleEndian
	return Gen{Epoch: le.Uint32(b), Seq: le.Uint32(b[4:]), ID: le.Uint64(b[8:])}
}

// Errors of Decode that say the slot holds no superblock at all (as a
// new device, or one never part of a mirror), rather than a damaged one.
var ErrNoSuperblock = errors.New("mirror: no superblock (not part of a mirror)")

// Decode reads and checks the superblock in b[:SlotSize]. Every field is
// checked: a peer's device is input like any other.
func Decode(b []byte) (Superblock, error) {
	var sb Superblock
	if len(b) < SlotSize {
		return sb, fmt.Errorf("mirror: superblock of %d bytes, want %d", len(b), SlotSize)
	}
	b = b[:SlotSize]
	if !bytes.Equal(b[offMagic:offMagic+8], magic[:]) {
		return sb, ErrNoSuperblock
	}
	le := binary.LittleEndian
	if v := le.Uint32(b[offVersion:]); v != version {
		return sb, fmt.Errorf("mirror: superblock format %d, this build knows %d", v, version)
	}
	if want, h := le.Uint32(b[offCRC:]), crcOf(b); h != want {
		return sb, fmt.Errorf("mirror: superblock checksum %08x, computed %08x", want, h)
	}
	copy(sb.Mirror[:], b[offMirror:])
	sb.Seq = le.Uint64(b[offSeq:])
	sb.Index, sb.NLegs, sb.Flags, sb.RegionShift = b[offIndex], b[offNLegs], b[offFlags], b[offShift]
	sb.DataSize = le.Uint64(b[offDataSize:])
	sb.Gen = getGen(b[offGen:])
	for i := range sb.History {
		sb.History[i] = getGen(b[offHistory+16*i:])
	}
	for i := range sb.Legs {
		e := b[offLegs+legEntry*i:]
		copy(sb.Legs[i].UUID[:], e)
		sb.Legs[i].State = LegState(e[16])
		if !allZero(e[17:24]) {
			return sb, fmt.Errorf("mirror: superblock: leg %d: reserved bytes not zero", i)
		}
		sb.Legs[i].Cursor = le.Uint64(e[24:])
	}
	sb.ForcedAt = int64(le.Uint64(b[offForcedAt:]))
	by := b[offForcedBy : offForcedBy+forcedByLen]
	n := bytes.IndexByte(by, 0)
	if n < 0 {
		n = len(by)
	}
	if !allZero(by[n:]) {
		return sb, errors.New("mirror: superblock: forced-by has bytes after its end")
	}
	sb.ForcedBy = string(by[:n])
	if !allZero(b[offReserved:offDataSize]) || !allZero(b[offEnd:]) {
		return sb, errors.New("mirror: superblock: reserved bytes not zero")
	}
	return sb, sb.Check()
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// Check says what is wrong with sb, or nil: the rules of
// docs/replication.md, "The metadata".
func (sb *Superblock) Check() error {
	bad := func(f string, a ...any) error { return fmt.Errorf("mirror: superblock: "+f, a...) }
	switch {
	case sb.Mirror == [16]byte{}:
		return bad("no mirror id")
	case sb.NLegs < 2 || sb.NLegs > MaxLegs:
		return bad("%d legs (2 or 3)", sb.NLegs)
	case sb.Flags&^flagsKnown != 0:
		return bad("unknown flags %#x", sb.Flags&^flagsKnown)
	case sb.Index == WitnessIndex && sb.Flags&FlagWitness == 0:
		return bad("a witness's, in a mirror without one")
	case sb.Index != WitnessIndex && sb.Index >= sb.NLegs:
		return bad("leg %d of %d", sb.Index, sb.NLegs)
	case sb.RegionShift < minRegionShift || sb.RegionShift > maxRegionShift:
		return bad("region size 2^%d (2^%d to 2^%d)", sb.RegionShift, minRegionShift, maxRegionShift)
	case sb.DataSize == 0 || sb.DataSize%4096 != 0 || sb.DataSize > 1<<60:
		return bad("data size %d (a multiple of 4096, not 0)", sb.DataSize)
	case sb.Regions() > BitmapMax*8:
		return bad("%d regions, more than the bitmap holds (%d)", sb.Regions(), BitmapMax*8)
	case sb.Gen.Epoch == 0:
		return bad("epoch 0")
	case sb.ForcedAt < 0:
		return bad("forced at %d", sb.ForcedAt)
	case len(sb.ForcedBy) > forcedByLen || !utf8.ValidString(sb.ForcedBy) || bytes.IndexByte([]byte(sb.ForcedBy), 0) >= 0:
		return bad("forced-by is not up to %d bytes of UTF-8 without NUL", forcedByLen)
	}
	prev := sb.Gen
	for i, h := range sb.History {
		if h == (Gen{}) {
			if !allZeroGens(sb.History[i:]) {
				return bad("history entry %d after its end", i)
			}
			break
		}
		if h.Epoch == 0 || !h.Before(prev) {
			return bad("history entry %d (%v) not older than the one before (%v)", i, h, prev)
		}
		prev = h
	}
	inSync := 0
	for i, l := range sb.Legs {
		if i >= int(sb.NLegs) {
			if l != (Leg{}) {
				return bad("leg %d beyond the %d legs", i, sb.NLegs)
			}
			continue
		}
		if l.UUID == [16]byte{} {
			return bad("leg %d has no id", i)
		}
		switch l.State {
		case LegInSync:
			inSync++
		case LegOutdated:
		case LegResyncing:
			if l.Cursor > sb.Regions() {
				return bad("leg %d resync cursor %d past the %d regions", i, l.Cursor, sb.Regions())
			}
			continue
		default:
			return bad("leg %d state %d", i, l.State)
		}
		if l.Cursor != 0 {
			return bad("leg %d is %s with a resync cursor", i, l.State)
		}
	}
	if inSync == 0 {
		return bad("no leg in sync")
	}
	return nil
}

func allZeroGens(gs []Gen) bool {
	for _, g := range gs {
		if g != (Gen{}) {
			return false
		}
	}
	return true
}

// ReadSlots chooses between a device's two superblock slots (the bytes
// at Slot0Off and Slot1Off): the valid one with the higher Seq. It
// returns the slot chosen, so the next write goes to the other. A device
// with neither slot valid is an error: ErrNoSuperblock when both hold
// none at all, else what is wrong with each.
func ReadSlots(s0, s1 []byte) (Superblock, int, error) {
	a, ea := Decode(s0)
	b, eb := Decode(s1)
	switch {
	case ea == nil && eb == nil:
		// Of two mirrors at two seqs: a voter adopted (Layout.Adopt),
		// whose older slot keeps the identity it was copied with.
		if a.Index != b.Index || (a.Mirror != b.Mirror && a.Seq == b.Seq) {
			return Superblock{}, 0, errors.New("mirror: the two superblock slots are of different mirrors or legs")
		}
		if a.Seq == b.Seq {
			if a != b {
				return Superblock{}, 0, fmt.Errorf("mirror: the two superblock slots differ at one seq %d", a.Seq)
			}
			return a, 0, nil
		}
		if b.Seq > a.Seq {
			return b, 1, nil
		}
		return a, 0, nil
	case ea == nil:
		return a, 0, nil
	case eb == nil:
		return b, 1, nil
	case errors.Is(ea, ErrNoSuperblock) && errors.Is(eb, ErrNoSuperblock):
		return Superblock{}, 0, ErrNoSuperblock
	}
	return Superblock{}, 0, fmt.Errorf("mirror: no valid superblock: slot 0: %v; slot 1: %v", ea, eb)
}
