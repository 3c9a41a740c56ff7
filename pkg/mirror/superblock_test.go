package mirror

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

var testMirror = [16]byte{0x6d, 0x69, 0x72, 0x72, 0x6f, 0x72, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}

func legUUID(i int) [16]byte {
	return [16]byte{0x4c, byte(i), 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee, 0xee}
}

// sbOf is a valid superblock of voter index at epoch n (id n*100), after
// epochs n-1, n-2, ... 1, the legs in states.
func sbOf(index uint8, n uint32, states ...LegState) *Superblock {
	sb := &Superblock{Mirror: testMirror, Seq: uint64(n), Index: index, NLegs: uint8(len(states)),
		RegionShift: 16, DataSize: 1 << 30, Gen: Gen{Epoch: n, ID: uint64(n) * 100}}
	for i := uint32(1); i < n && i <= HistoryLen; i++ {
		sb.History[i-1] = Gen{Epoch: n - i, ID: uint64(n-i) * 100}
	}
	for i, s := range states {
		sb.Legs[i] = Leg{UUID: legUUID(i), State: s}
	}
	return sb
}

func encode(t testing.TB, sb *Superblock) []byte {
	t.Helper()
	b := make([]byte, SlotSize)
	if err := sb.Encode(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestSuperblockRoundTrip(t *testing.T) {
	sb := sbOf(1, 12, LegInSync, LegResyncing, LegOutdated)
	sb.Flags = FlagWitness | FlagForced
	sb.Legs[1].Cursor = 77
	sb.ForcedAt, sb.ForcedBy = 1796200000, "ops@example: müller"
	b := encode(t, sb)
	got, err := Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	if got != *sb {
		t.Fatalf("decoded\n%+v\nwant\n%+v", got, *sb)
	}
	if !bytes.Equal(b[:8], []byte("RNBDMIR1")) || b[offNLegs] != 3 || b[offLegs+legEntry+16] != uint8(LegResyncing) {
		t.Fatalf("layout differs from docs/replication.md: % x", b[:64])
	}
}

func TestSuperblockChecks(t *testing.T) {
	for _, c := range []struct {
		name string
		mod  func(*Superblock)
		want string
	}{
		{"no mirror id", func(sb *Superblock) { sb.Mirror = [16]byte{} }, "no mirror id"},
		{"one leg", func(sb *Superblock) { sb.NLegs = 1 }, "1 legs"},
		{"four legs", func(sb *Superblock) { sb.NLegs = 4 }, "4 legs"},
		{"index past legs", func(sb *Superblock) { sb.Index = 2 }, "leg 2 of 2"},
		{"witness without one", func(sb *Superblock) { sb.Index = WitnessIndex }, "without one"},
		{"unknown flag", func(sb *Superblock) { sb.Flags = 0x80 }, "unknown flags"},
		{"small region", func(sb *Superblock) { sb.RegionShift = 15 }, "region size"},
		{"huge region", func(sb *Superblock) { sb.RegionShift = 31 }, "region size"},
		{"odd size", func(sb *Superblock) { sb.DataSize = 4097 }, "data size"},
		{"zero size", func(sb *Superblock) { sb.DataSize = 0 }, "data size"},
		{"bitmap too small", func(sb *Superblock) { sb.DataSize = 1 << 42 }, "more than the bitmap"},
		{"epoch 0", func(sb *Superblock) { sb.Gen = Gen{Seq: 3} }, "epoch 0"},
		{"history not older", func(sb *Superblock) { sb.History[0].Epoch = sb.Gen.Epoch }, "not older"},
		{"history epoch 0", func(sb *Superblock) { sb.History[0] = Gen{Seq: 1} }, "not older"},
		{"history gap", func(sb *Superblock) { sb.History[2] = Gen{}; sb.History[3] = Gen{Epoch: 1, ID: 1} }, "after its end"},
		{"leg without id", func(sb *Superblock) { sb.Legs[1].UUID = [16]byte{} }, "no id"},
		{"leg beyond", func(sb *Superblock) { sb.Legs[2] = Leg{UUID: legUUID(2), State: LegInSync} }, "beyond"},
		{"bad state", func(sb *Superblock) { sb.Legs[1].State = 9 }, "state 9"},
		{"none state", func(sb *Superblock) { sb.Legs[1].State = LegNone }, "state 0"},
		{"cursor of outdated", func(sb *Superblock) { sb.Legs[1].State, sb.Legs[1].Cursor = LegOutdated, 3 }, "with a resync cursor"},
		{"cursor past end", func(sb *Superblock) { sb.Legs[1].State, sb.Legs[1].Cursor = LegResyncing, 1<<14+1 }, "past the"},
		{"none in sync", func(sb *Superblock) { sb.Legs[0].State, sb.Legs[1].State = LegOutdated, LegResyncing }, "no leg in sync"},
		{"forced-by NUL", func(sb *Superblock) { sb.ForcedBy = "a\x00b" }, "forced-by"},
		{"forced-by long", func(sb *Superblock) { sb.ForcedBy = strings.Repeat("x", 65) }, "forced-by"},
		{"forced-by not UTF-8", func(sb *Superblock) { sb.ForcedBy = "\xff" }, "forced-by"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sb := sbOf(0, 10, LegInSync, LegInSync)
			c.mod(sb)
			err := sb.Check()
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Check: %v, want an error with %q", err, c.want)
			}
			if sb.Encode(make([]byte, SlotSize)) == nil {
				t.Fatal("Encode wrote an invalid superblock")
			}
		})
	}
}

func TestDecodeRefuses(t *testing.T) {
	good := encode(t, sbOf(0, 3, LegInSync, LegInSync))
	if _, err := Decode(make([]byte, SlotSize)); !errors.Is(err, ErrNoSuperblock) {
		t.Fatalf("zeroes: %v, want ErrNoSuperblock", err)
	}
	if _, err := Decode(good[:100]); err == nil {
		t.Fatal("a short buffer decoded")
	}
	for _, c := range []struct {
		name string
		off  int
		want string
	}{
		{"version", offVersion, "format"},
		{"checksum", offCRC, "checksum"},
		{"a data byte", offDataSize + 2, "checksum"},
		{"the last byte", SlotSize - 1, "checksum"},
	} {
		b := bytes.Clone(good)
		b[c.off] ^= 0x10
		if _, err := Decode(b); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s flipped: %v, want %q", c.name, err, c.want)
		}
	}
	// Reserved bytes with a checksum that matches them: still refused.
	for _, off := range []int{offReserved, offLegs + 20, offEnd + 5} {
		b := bytes.Clone(good)
		b[off] = 1
		resum(b)
		if _, err := Decode(b); err == nil || !strings.Contains(err.Error(), "reserved") {
			t.Errorf("reserved byte %d set: %v", off, err)
		}
	}
	b := bytes.Clone(good)
	copy(b[offForcedBy:], "ab\x00c")
	resum(b)
	if _, err := Decode(b); err == nil || !strings.Contains(err.Error(), "forced-by") {
		t.Errorf("forced-by with a byte after its end: %v", err)
	}
}

// resum sets b's checksum to match its bytes.
func resum(b []byte) {
	clear(b[offCRC : offCRC+4])
	h := crcOf(b)
	b[offCRC], b[offCRC+1], b[offCRC+2], b[offCRC+3] = byte(h), byte(h>>8), byte(h>>16), byte(h>>24)
}

func TestReadSlots(t *testing.T) {
	older := encode(t, sbOf(0, 4, LegInSync, LegInSync))
	newer := encode(t, sbOf(0, 5, LegInSync, LegOutdated))
	torn := bytes.Clone(newer)
	clear(torn[100:]) // the write stopped part way
	empty := make([]byte, SlotSize)
	adopted := sbOf(0, 5, LegInSync, LegOutdated)
	adopted.Mirror[0] ^= 1
	for _, c := range []struct {
		name     string
		s0, s1   []byte
		slot     int
		gen      uint32
		wantErr  error
		errMatch string
	}{
		{"newer in 1", older, newer, 1, 5, nil, ""},
		{"newer in 0", newer, older, 0, 5, nil, ""},
		{"torn newer: the older", older, torn, 0, 4, nil, ""},
		{"one slot never written", empty, older, 1, 4, nil, ""},
		{"a new device", empty, empty, 0, 0, ErrNoSuperblock, ""},
		{"both damaged", torn, torn, 0, 0, nil, "no valid superblock"},
		{"other leg's slot", older, encode(t, sbOf(1, 5, LegInSync, LegInSync)), 0, 0, nil, "different mirrors or legs"},
		{"adopted: the newer slot another mirror's", older, encode(t, adopted), 1, 5, nil, ""},
	} {
		sb, slot, err := ReadSlots(c.s0, c.s1)
		switch {
		case c.wantErr != nil || c.errMatch != "":
			if c.wantErr != nil && !errors.Is(err, c.wantErr) || c.errMatch != "" && (err == nil || !strings.Contains(err.Error(), c.errMatch)) {
				t.Errorf("%s: %v", c.name, err)
			}
		case err != nil:
			t.Errorf("%s: %v", c.name, err)
		case slot != c.slot || sb.Gen.Epoch != c.gen:
			t.Errorf("%s: slot %d epoch %d, want %d %d", c.name, slot, sb.Gen.Epoch, c.slot, c.gen)
		}
	}
}

func TestRegionShiftFor(t *testing.T) {
	for _, c := range []struct {
		size  uint64
		shift uint8
	}{{1 << 20, 22}, {128 << 40, 22}, {128<<40 + 4096, 23}, {1 << 50, 25}} {
		if got := RegionShiftFor(c.size); got != c.shift {
			t.Errorf("RegionShiftFor(%d) = %d, want %d", c.size, got, c.shift)
		}
		sb := sbOf(0, 1, LegInSync, LegInSync)
		sb.DataSize, sb.RegionShift = c.size, RegionShiftFor(c.size)
		if err := sb.Check(); err != nil {
			t.Errorf("size %d: %v", c.size, err)
		}
	}
}

// FuzzDecodeSuperblock: whatever a device holds, Decode returns an error
// or a superblock that passes Check and encodes back to the same bytes.
func FuzzDecodeSuperblock(f *testing.F) {
	for _, sb := range []*Superblock{sbOf(0, 1, LegInSync, LegInSync), sbOf(2, 30, LegOutdated, LegResyncing, LegInSync)} {
		f.Add(encode(f, sb))
	}
	f.Add(make([]byte, SlotSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) < SlotSize {
			b = append(b, make([]byte, SlotSize-len(b))...)
			copy(b, magic[:])
			resum(b)
		}
		sb, err := Decode(b)
		if err != nil {
			return
		}
		if err := sb.Check(); err != nil {
			t.Fatalf("Decode passed what Check refuses: %v", err)
		}
		out := make([]byte, SlotSize)
		if err := sb.Encode(out); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, b[:SlotSize]) {
			t.Fatal("a decoded superblock encodes to other bytes")
		}
	})
}
