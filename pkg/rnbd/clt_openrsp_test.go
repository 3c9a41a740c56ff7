package rnbd

import (
	"context"
	"errors"
	"github.com/rnbd/rnbd/test/kit"
	"math"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs"
)

// forgedOpenRsp is an RNBD server that answers OPENs with an OPEN_RSP of
// its own making once forge is set (the first one may go to the real
// server, so that the device exists there); everything else is the real
// server's.
type forgedOpenRsp struct {
	*Server
	forge  atomic.Pointer[OpenRsp]
	forged atomic.Int32 // OPENs answered with it
}

func (h *forgedOpenRsp) HandleIO(op *rtrs.SrvOp) error {
	if t, err := MsgType(op.Usr()); err == nil && t == MsgOpen {
		if rsp := h.forge.Load(); rsp != nil {
			rsp.Encode(op.Data())
			h.forged.Add(1)
			op.Respond(nil)
			return nil
		}
	}
	return h.Server.sessionIO(op)
}

// goodOpenRsp is an answer the client takes: 1 MiB of 4 KiB blocks.
func goodOpenRsp() OpenRsp {
	return OpenRsp{DeviceID: 1, NSectors: 2048, MaxHWSectors: 256, LogicalBlockSize: 4096, PhysicalBlockSize: 4096,
		MaxSegments: 128, MaxDiscardSectors: 2048, MaxWriteZeroesSectors: 2048}
}

// The client refuses at OPEN an answer describing a device it cannot
// serve, with one error naming the field and its value: it used to take
// a size of 2^64-1 sectors (shown as -512 bytes) and max_hw_sectors 0,
// after which every IO failed with EOPNOTSUPP.
func TestCltRefusesUnusableOpenRsp(t *testing.T) {
	h := &forgedOpenRsp{}
	r := newSrigWith(t, SrvConfig{}, func(s *Server) rtrs.SrvHandler { h.Server = s; return h })
	c := r.cltSession("s", 0)
	for _, tc := range []struct {
		name   string
		mutate func(*OpenRsp)
		want   string // field and value in the error
	}{
		{"the issue's server", func(m *OpenRsp) { m.NSectors, m.MaxHWSectors = math.MaxUint64, 0 }, "nsectors 18446744073709551615"},
		{"a size past int64", func(m *OpenRsp) { m.NSectors = math.MaxInt64/512 + 1 }, "nsectors 18014398509481984"},
		{"a size not of whole blocks", func(m *OpenRsp) { m.NSectors = 2049 }, "nsectors 2049"},
		{"no read or write fits", func(m *OpenRsp) { m.MaxHWSectors = 0 }, "max_hw_sectors 0"},
		{"less than a block per request", func(m *OpenRsp) { m.MaxHWSectors = 7 }, "max_hw_sectors 7"},
		{"a logical block of 1000", func(m *OpenRsp) { m.LogicalBlockSize = 1000 }, "logical_block_size 1000"},
		{"a logical block of 0", func(m *OpenRsp) { m.LogicalBlockSize = 0 }, "logical_block_size 0"},
		{"a physical block of 256", func(m *OpenRsp) { m.PhysicalBlockSize = 256 }, "physical_block_size 256"},
		{"discards of less than a block", func(m *OpenRsp) { m.MaxDiscardSectors = 1 }, "max_discard_sectors 1"},
		{"write-zeroes of less than a block", func(m *OpenRsp) { m.MaxWriteZeroesSectors = 4 }, "max_write_zeroes_sectors 4"},
		{"secure erase without discards", func(m *OpenRsp) { m.MaxDiscardSectors, m.SecureDiscard = 0, 1 }, "secure_discard 1"},
	} {
		rsp := goodOpenRsp()
		tc.mutate(&rsp)
		h.forge.Store(&rsp)
		d, err := c.Map(context.Background(), "x", AccessRW)
		if err == nil {
			t.Errorf("%s: mapped, size %d", tc.name, d.Size())
			d.Unmap(context.Background())
			continue
		}
		if !errors.Is(err, ErrBadOpenRsp) || !errors.Is(err, syscall.EPROTO) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want ErrBadOpenRsp naming %q", tc.name, err, tc.want)
		}
	}
	// A session whose requests carry less than one block.
	if rsp := goodOpenRsp(); !errors.Is(rsp.Check(2048), ErrBadOpenRsp) ||
		!strings.Contains(rsp.Check(2048).Error(), "logical_block_size 4096: larger than the session's max_io_size 2048") {
		t.Errorf("a block larger than max_io_size: %v", rsp.Check(2048))
	}
	if len(c.Devices()) != 0 {
		t.Fatalf("devices after refused opens: %d", len(c.Devices()))
	}
	// What is not used is not judged: no segments, odd discard fields,
	// an empty device, unknown cache policy bits.
	rsp := goodOpenRsp()
	rsp.MaxSegments, rsp.DiscardGranularity, rsp.DiscardAlignment, rsp.CachePolicy = 0, 3, 5, 0xfc
	h.forge.Store(&rsp)
	d, err := c.Map(context.Background(), "x", AccessRW)
	if err != nil || d.Size() != 1<<20 {
		t.Fatalf("a usable answer: %v", err)
	}
	d.Unmap(context.Background())
	rsp = goodOpenRsp()
	rsp.NSectors = 0
	h.forge.Store(&rsp)
	if d, err = c.Map(context.Background(), "x", AccessRW); err != nil || d.Size() != 0 {
		t.Fatalf("an empty device: %v", err)
	}
	d.Unmap(context.Background())
}

// A size poll answered with an unusable OPEN_RSP changes nothing: the
// device keeps its size and goes on serving IO.
func TestCltSizePollRefusesUnusableOpenRsp(t *testing.T) {
	h := &forgedOpenRsp{}
	r := newSrigWith(t, SrvConfig{}, func(s *Server) rtrs.SrvHandler { h.Server = s; return h })
	r.file("a", 1<<20)
	c := r.cltSession("s", 0)
	d, err := c.Map(context.Background(), "a", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	resized := make(chan int64, 4)
	c.OnResize(func(d *CltDev) { resized <- d.Size() })
	bad := d.Info()
	bad.NSectors = math.MaxUint64
	h.forge.Store(&bad)
	c.SetSizePoll(10 * time.Millisecond)
	kit.WaitFor(t, 20*time.Second, "polls answered", func() bool { return h.forged.Load() >= 3 })
	c.SetSizePoll(0)
	if d.Size() != 1<<20 || d.State() != DevOpen {
		t.Fatalf("after polls answered with nsectors 2^64-1: size %d, state %v", d.Size(), d.State())
	}
	select {
	case n := <-resized:
		t.Fatalf("resized to %d", n)
	default:
	}
	buf, _ := c.Session().AllocBuffer(4096)
	if err := syncIO(d, OpWrite, 0, 0, 4096, buf); err != nil {
		t.Fatalf("IO after the polls: %v", err)
	}
}

// FuzzOpenRspCheck: whatever OPEN_RSP the client accepts describes a
// device it can serve: a size in bytes that fits and is whole blocks,
// and a read, a write and (where announced) a discard and a
// write-zeroes of one block each fit in one request.
func FuzzOpenRspCheck(f *testing.F) {
	g, err := kit.GoldenHex("open_rsp")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(g, 128<<10)
	good := goodOpenRsp()
	f.Add(good.Encode(make([]byte, OpenRspSize)), 128<<10)
	bad := goodOpenRsp()
	bad.NSectors, bad.MaxHWSectors = math.MaxUint64, 0
	f.Add(bad.Encode(make([]byte, OpenRspSize)), 128<<10)
	f.Fuzz(func(t *testing.T, b []byte, maxIO int) {
		var m OpenRsp
		if m.Decode(b) != nil {
			return
		}
		err := m.Check(maxIO)
		if err != nil {
			if !errors.Is(err, ErrBadOpenRsp) {
				t.Fatalf("refused without ErrBadOpenRsp: %v", err)
			}
			return
		}
		d := &CltDev{s: &CltSession{}, info: m}
		d.remoteSectors.Store(m.NSectors)
		lbs := int64(m.LogicalBlockSize)
		if d.Size() < 0 || d.Size()%lbs != 0 || uint64(d.Size()) != m.NSectors*512 {
			t.Fatalf("accepted %+v: size %d", m, d.Size())
		}
		rw := min(int(m.MaxHWSectors)*512, maxIO) &^ (int(lbs) - 1)
		if rw < int(lbs) {
			t.Fatalf("accepted %+v with max_io_size %d: a read or write carries %d", m, maxIO, rw)
		}
		for _, n := range []uint32{m.MaxDiscardSectors, m.MaxWriteZeroesSectors} {
			if n != 0 && int64(min(uint64(n)*512, 1<<30))&^(lbs-1) < lbs {
				t.Fatalf("accepted %+v: a discard or write-zeroes carries less than a block", m)
			}
		}
	})
}
