package rnbd

import (
	"bytes"
	"github.com/rnbd/rnbd/test/kit"
	"strings"
	"testing"
)

func seed(f *testing.F, name string) {
	b, err := kit.GoldenHex(name)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
}

func TestGolden(t *testing.T) {
	buf := make([]byte, 512)
	check := func(name string, got []byte) {
		t.Helper()
		if want := kit.Golden(t, name); !bytes.Equal(got, want) {
			t.Errorf("%s:\n got %x\nwant %x", name, got, want)
		}
	}
	check("sess_info", (&SessInfo{Ver: 2}).Encode(buf, MsgSessInfo))
	check("open", (&Open{AccessMode: AccessRW, DevName: "vol1"}).Encode(buf))
	rsp := OpenRsp{DeviceID: 7, NSectors: 2097152, MaxHWSectors: 248, MaxWriteZeroesSectors: 2097152,
		MaxDiscardSectors: 2097152, DiscardGranularity: 4096, PhysicalBlockSize: 4096, LogicalBlockSize: 512,
		MaxSegments: 256, CachePolicy: CacheWriteback | CacheFUA}
	check("open_rsp", rsp.Encode(buf))
	check("close", (&Close{DeviceID: 0x01020304}).Encode(buf))
	io := IO{DeviceID: 7, Sector: 8, RW: uint32(OpWrite) | FFUA, Size: 4096, Prio: 3}
	check("io", io.Encode(buf))

	var o Open
	if err := o.Decode(kit.Golden(t, "open")); err != nil || o.DevName != "vol1" || o.AccessMode != AccessRW {
		t.Fatalf("open decode %+v %v", o, err)
	}
	var r OpenRsp
	if err := r.Decode(kit.Golden(t, "open_rsp")); err != nil || r != rsp {
		t.Fatalf("open_rsp decode %+v %v", r, err)
	}
	var m IO
	if err := m.Decode(kit.Golden(t, "io")); err != nil || m != io || m.Op() != OpWrite || m.Flags() != FFUA {
		t.Fatalf("io decode %+v %v", m, err)
	}
	// A peer without prio sends 24 bytes.
	if err := m.Decode(kit.Golden(t, "io")[:24]); err != nil || m.Prio != 0 || m.Size != 4096 {
		t.Fatalf("24-byte io %+v %v", m, err)
	}
}

func TestSizes(t *testing.T) {
	buf := make([]byte, 512)
	for _, c := range []struct {
		name      string
		got, want int
	}{
		{"rnbd_msg_sess_info", len((&SessInfo{}).Encode(buf, MsgSessInfo)), 36},
		{"rnbd_msg_open", len((&Open{DevName: "x"}).Encode(buf)), 264},
		{"rnbd_msg_open_rsp", len((&OpenRsp{}).Encode(buf)), 56},
		{"rnbd_msg_close", len((&Close{}).Encode(buf)), 8},
		{"rnbd_msg_io", len((&IO{}).Encode(buf)), 32},
	} {
		if c.got != c.want {
			t.Errorf("%s: %d bytes, want %d", c.name, c.got, c.want)
		}
	}
}

func TestCheckRW(t *testing.T) {
	for _, rw := range []uint32{0, 1 | FFUA, 1 | FPreflush | FFUA, 2, 3, 4, 5 | FNoUnmap, 1 | FSync} {
		if err := CheckRW(rw); err != nil {
			t.Errorf("%#x refused: %v", rw, err)
		}
	}
	for _, rw := range []uint32{6, 0xff, 1 | 1<<12, 1 << 31} {
		if err := CheckRW(rw); err == nil {
			t.Errorf("%#x accepted", rw)
		}
	}
}

func TestOpenName(t *testing.T) {
	b := (&Open{DevName: "x"}).Encode(make([]byte, OpenSize))
	b[6] = 0 // empty name
	var o Open
	if err := o.Decode(b); err == nil {
		t.Fatal("empty name accepted")
	}
	for i := 6; i < 6+255; i++ {
		b[i] = 'a' // no terminating NUL
	}
	if err := o.Decode(b); err == nil {
		t.Fatal("unterminated name accepted")
	}
}

// Fuzz targets: decoders never panic; an error leaves the zero value; what
// decodes re-encodes to the same meaning.

func FuzzOpen(f *testing.F) {
	seed(f, "open")
	f.Fuzz(func(t *testing.T, b []byte) {
		var m Open
		if err := m.Decode(b); err != nil {
			if m != (Open{}) {
				t.Fatal("error with a value")
			}
			return
		}
		if len(m.DevName) == 0 || len(m.DevName) > 254 || strings.IndexByte(m.DevName, 0) >= 0 {
			t.Fatalf("name %q", m.DevName)
		}
		var m2 Open
		if err := m2.Decode(m.Encode(make([]byte, OpenSize))); err != nil || m2 != m {
			t.Fatalf("round trip %+v %+v", m, m2)
		}
	})
}

func FuzzMessages(f *testing.F) {
	for _, n := range []string{"sess_info", "open_rsp", "close", "io", "kclt_flush", "kclt21_flush", "kclt_discard_end"} {
		seed(f, n)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var s SessInfo
		if err := s.Decode(b, MsgSessInfo); err == nil {
			var s2 SessInfo
			if s2.Decode(s.Encode(make([]byte, SessInfoSize), MsgSessInfo), MsgSessInfo) != nil || s2 != s {
				t.Fatal("sess_info round trip")
			}
		} else if s != (SessInfo{}) {
			t.Fatal("sess_info: error with a value")
		}
		var r OpenRsp
		if err := r.Decode(b); err == nil {
			var r2 OpenRsp
			if r2.Decode(r.Encode(make([]byte, OpenRspSize))) != nil || r2 != r {
				t.Fatal("open_rsp round trip")
			}
		} else if r != (OpenRsp{}) {
			t.Fatal("open_rsp: error with a value")
		}
		var c Close
		if err := c.Decode(b); err == nil {
			var c2 Close
			if c2.Decode(c.Encode(make([]byte, CloseSize))) != nil || c2 != c {
				t.Fatal("close round trip")
			}
		} else if c != (Close{}) {
			t.Fatal("close: error with a value")
		}
		var m IO
		if err := m.Decode(b); err == nil {
			var m2 IO
			if m2.Decode(m.Encode(make([]byte, IOSize))) != nil || m2 != m {
				t.Fatal("io round trip")
			}
			_ = CheckRW(m.RW)
		} else if m != (IO{}) {
			t.Fatal("io: error with a value")
		}
	})
}
