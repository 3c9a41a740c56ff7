// Tests of the handshake: option haggling (LIST, INFO, GO, EXPORT_NAME),
// unknown and default exports, and clients that misbehave before
// transmission.

package nbd

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"testing"
)

func TestHandshakeList(t *testing.T) {
	_, addr := startServer(t, Options{},
		&Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)},
		&Export{Name: "bb", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	reps := c.option(optList, nil)
	if final(reps) != repAck {
		t.Fatalf("OPT_LIST ended with %#x", final(reps))
	}
	var names []string
	for _, r := range reps[:len(reps)-1] {
		if r.typ != repServer || len(r.data) < 4 || int(binary.BigEndian.Uint32(r.data)) != len(r.data)-4 {
			t.Fatalf("bad REP_SERVER %#x %x", r.typ, r.data)
		}
		names = append(names, string(r.data[4:]))
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"a", "bb"}) {
		t.Fatalf("listed %q", names)
	}
	if reps := c.option(optList, []byte{0}); len(reps) != 1 || reps[0].typ != repErrInvalid {
		t.Fatalf("OPT_LIST with data: %+v", reps)
	}
	c.optGo("bb")
	if !bytes.Equal(c.mustRead(4096, 100), pattern(4096, 100)) {
		t.Fatal("read after OPT_LIST: wrong data")
	}
}

func TestHandshakeInfo(t *testing.T) {
	all := tflagHasFlags | tflagSendFlush | tflagSendFUA | tflagCanMulti
	for _, tc := range []struct {
		name  string
		exp   Export
		flags uint16
		block [3]uint32
	}{
		{"rw", Export{Flush: true, FUA: true, Trim: true, WriteZeroes: true, MultiConn: true},
			uint16(all | tflagSendTrim | tflagSendZeroes), [3]uint32{1, 4096, 32 << 20}},
		{"ro", Export{ReadOnly: true, Flush: true, FUA: true, Trim: true, WriteZeroes: true, MultiConn: true},
			uint16(all | tflagReadOnly), [3]uint32{1, 4096, 32 << 20}},
		{"fua-without-flush", Export{FUA: true}, tflagHasFlags, [3]uint32{1, 4096, 32 << 20}},
		{"plain", Export{MinBlock: 512, PrefBlock: 65536, MaxPayload: 1 << 20}, tflagHasFlags,
			[3]uint32{512, 65536, 1 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := tc.exp
			e.Name, e.Description, e.Size, e.Backend = tc.name, "the "+tc.name+" export", 3<<20, newStore(3<<20)
			_, addr := startServer(t, Options{}, &e)
			c := dial(t, addr)
			c.greet(cflagFixedNew | cflagNoZeroes)
			check := func(what string, reps []optRep) map[uint16][]byte {
				t.Helper()
				if final(reps) != repAck {
					t.Fatalf("%s: reply %#x", what, final(reps))
				}
				m := c.infos(reps)
				if c.size != 3<<20 || c.flags != tc.flags {
					t.Errorf("%s: size %d flags %#x, want %d %#x", what, c.size, c.flags, 3<<20, tc.flags)
				}
				if got := [3]uint32{c.minBlock, c.prefBlock, c.maxPayload}; got != tc.block {
					t.Errorf("%s: block sizes %v, want %v", what, got, tc.block)
				}
				return m
			}
			m := check("OPT_INFO", c.option(optInfo, goData(tc.name, infoName, infoDescription, infoBlockSize, 0x7777)))
			if string(m[infoName]) != tc.name || string(m[infoDescription]) != e.Description || len(m) != 4 {
				t.Errorf("OPT_INFO infos: %v", m)
			}
			// OPT_INFO stays in negotiation; OPT_GO then enters transmission.
			check("OPT_GO", c.option(optGo, goData(tc.name, infoBlockSize)))
			if !bytes.Equal(c.mustRead(1<<20, 4096), pattern(1<<20, 4096)) {
				t.Fatal("wrong data")
			}
		})
	}
}

func TestHandshakeDefaultExport(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "only", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := connect(t, addr, "")
	if c.size != 1<<20 {
		t.Fatalf("size %d", c.size)
	}
	c.mustRead(0, 512)
}

func TestHandshakeUnknownExport(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)},
		&Export{Name: "b", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	for _, opt := range []uint32{optInfo, optGo} {
		if reps := c.option(opt, goData("nope", infoBlockSize)); len(reps) != 1 || reps[0].typ != repErrUnknown {
			t.Fatalf("option %d of an unknown export: %+v", opt, reps)
		}
	}
	// Two exports: no default.
	if reps := c.option(optGo, goData("")); len(reps) != 1 || reps[0].typ != repErrUnknown {
		t.Fatalf("OPT_GO \"\" with two exports: %+v", reps)
	}
	c.optGo("a")
	c.mustRead(0, 512)

	c = dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	c.sendOpt(optExportName, []byte("nope"))
	c.expectClosed()
}

func TestHandshakeBadOptions(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	for _, tc := range []struct {
		name string
		opt  uint32
		data []byte
		want uint32
	}{
		{"short", optGo, []byte{0, 0, 0, 1, 0}, repErrInvalid},
		{"name-overflow", optInfo, goData("a")[:5], repErrInvalid},
		{"name-too-long", optGo, append(binary.BigEndian.AppendUint32(nil, 0xffffffff), 0, 0), repErrInvalid},
		{"infos-mismatch", optGo, append(goData("a", infoBlockSize), 0), repErrInvalid},
		{"structured-reply", 8, nil, repErrUnsup},
		{"unknown", 0x12345, []byte("xyz"), repErrUnsup},
	} {
		if reps := c.option(tc.opt, tc.data); len(reps) != 1 || reps[0].typ != tc.want {
			t.Fatalf("%s: %+v, want one reply %#x", tc.name, reps, tc.want)
		}
	}
	c.optGo("a")
	c.mustRead(0, 512)
}

func TestHandshakeAbort(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	if reps := c.option(optAbort, nil); len(reps) != 1 || reps[0].typ != repAck || len(reps[0].data) != 0 {
		t.Fatalf("OPT_ABORT: %+v", reps)
	}
	c.expectClosed()
}

func TestHandshakeExportName(t *testing.T) {
	for _, noZeroes := range []bool{true, false} {
		t.Run(fmt.Sprint("noZeroes=", noZeroes), func(t *testing.T) {
			_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, ReadOnly: true, Backend: newStore(1 << 20)})
			c := dial(t, addr)
			cflags := cflagFixedNew
			if noZeroes {
				cflags |= cflagNoZeroes
			}
			c.greet(cflags)
			c.sendOpt(optExportName, []byte("a"))
			b := c.readFull(10)
			if size, flags := binary.BigEndian.Uint64(b), binary.BigEndian.Uint16(b[8:]); size != 1<<20 ||
				flags != tflagHasFlags|tflagReadOnly {
				t.Fatalf("size %d flags %#x", size, flags)
			}
			if !noZeroes {
				if z := c.readFull(124); !bytes.Equal(z, make([]byte, 124)) {
					t.Fatalf("padding %x", z)
				}
			}
			if !bytes.Equal(c.mustRead(100, 1000), pattern(100, 1000)) {
				t.Fatal("wrong data")
			}
		})
	}
}

func TestHandshakeHostile(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	optHdr := func(magic uint64, opt, n uint32) []byte {
		b := binary.BigEndian.AppendUint64(nil, magic)
		b = binary.BigEndian.AppendUint32(b, opt)
		return binary.BigEndian.AppendUint32(b, n)
	}
	for _, tc := range []struct {
		name   string
		cflags uint32
		send   []byte
	}{
		{"client-flags", 1 << 7, nil},
		{"option-magic", cflagFixedNew, optHdr(0x1122334455667788, optGo, 0)},
		{"option-length", cflagFixedNew, optHdr(magicOpt, optGo, maxOptionLen+1)},
		{"option-length-huge", cflagFixedNew, optHdr(magicOpt, optList, 0xffffffff)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := dial(t, addr)
			c.greet(tc.cflags)
			if tc.send != nil {
				c.write(tc.send)
			}
			c.expectClosed()
		})
	}
	// The server still serves.
	connect(t, addr, "a").mustRead(0, 512)
}

func TestHandshakeTooManyOptions(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	for i := 0; i < maxOptions; i++ {
		if reps := c.option(0x999, nil); final(reps) != repErrUnsup {
			t.Fatalf("option %d: %+v", i, reps)
		}
	}
	c.expectClosed()
}
