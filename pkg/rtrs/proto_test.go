package rtrs

import (
	"bytes"
	"github.com/rnbd/rnbd/test/kit"
	"reflect"
	"strings"
	"syscall"
	"testing"
)

func seq(from byte) (u [16]byte) {
	for i := range u {
		u[i] = from + byte(i)
	}
	return u
}

func TestGoldenConnReq(t *testing.T) {
	want := kit.Golden(t, "conn_req")
	m := ConnReq{Magic: Magic, Version: ProtoVer, CID: 3, CIDNum: 5, ReconCnt: 7,
		SessUUID: seq(0), PathsUUID: seq(0x10), FirstConn: true}
	if got := m.Encode(make([]byte, 64)); !bytes.Equal(got, want) {
		t.Fatalf("encode:\n got %x\nwant %x", got, want)
	}
	var d ConnReq
	if err := d.Decode(want); err != nil || d != m {
		t.Fatalf("decode: %+v, %v", d, err)
	}
	// The CM overwrites the first bytes for AF_IB and delivers more
	// than was sent: neither matters.
	long := append(append([]byte{}, want...), make([]byte, 140)...)
	long[0], long[1] = 0x40, 0x40
	if err := d.Decode(long); err != nil || d != m {
		t.Fatalf("decode of CM-mangled private data: %+v, %v", d, err)
	}
}

func TestGoldenConnRsp(t *testing.T) {
	want := kit.Golden(t, "conn_rsp_kernel")
	m := ConnRsp{Magic: Magic, Version: ProtoVer, QueueDepth: 512, MaxIOSize: 126976, MaxHdrSize: 4096, Flags: MsgNewRkeyF}
	if got := m.Encode(make([]byte, ConnRspSize)); !bytes.Equal(got, want) {
		t.Fatalf("encode:\n got %x\nwant %x", got, want)
	}
	// A kernel's accept arrives with 196 bytes of private data.
	var d ConnRsp
	if err := d.Decode(append(want, make([]byte, 140)...)); err != nil || d != m {
		t.Fatalf("decode: %+v, %v", d, err)
	}
	rej := kit.Golden(t, "conn_rsp_reject")
	r := ConnRsp{Magic: Magic, Version: ProtoVer, Errno: syscall.ECONNRESET}
	if got := r.Encode(make([]byte, ConnRspSize)); !bytes.Equal(got, rej) {
		t.Fatalf("encode reject:\n got %x\nwant %x", got, rej)
	}
	if err := d.Decode(rej); err != nil || d.Errno != syscall.ECONNRESET {
		t.Fatalf("decode reject: %+v, %v", d, err)
	}
}

func TestGoldenInfo(t *testing.T) {
	want := kit.Golden(t, "info_req")
	req := InfoReq{Pathname: "sess1"}
	if got := req.Encode(make([]byte, InfoReqSize)); !bytes.Equal(got, want) {
		t.Fatalf("info_req encode:\n got %x\nwant %x", got, want)
	}
	var dreq InfoReq
	if err := dreq.Decode(want); err != nil || dreq != req {
		t.Fatalf("info_req decode: %+v %v", dreq, err)
	}
	want = kit.Golden(t, "info_rsp")
	rsp := InfoRsp{Desc: []SGDesc{{0x1000, 0x44332211, 128 << 10}, {0x8000000000010000, 1, 128 << 10}}}
	if got := rsp.Encode(make([]byte, InfoRspSize(2))); !bytes.Equal(got, want) {
		t.Fatalf("info_rsp encode:\n got %x\nwant %x", got, want)
	}
	var drsp InfoRsp
	if err := drsp.Decode(want); err != nil || !reflect.DeepEqual(drsp, rsp) {
		t.Fatalf("info_rsp decode: %+v %v", drsp, err)
	}
}

func TestGoldenIOMessages(t *testing.T) {
	want := kit.Golden(t, "rkey_rsp")
	rk := RkeyRsp{BufID: 511, RKey: 0xdeadbeef}
	if got := rk.Encode(make([]byte, 8)); !bytes.Equal(got, want) {
		t.Fatalf("rkey_rsp:\n got %x\nwant %x", got, want)
	}
	var drk RkeyRsp
	if err := drk.Decode(want); err != nil || drk != rk {
		t.Fatalf("rkey_rsp decode: %+v %v", drk, err)
	}
	want = kit.Golden(t, "rdma_read")
	rd := RDMARead{UsrLen: 32, Flags: MsgNeedInvalF, SGCnt: 1, Desc: SGDesc{0x10000000, 0x12345678, 4096}}
	if got := rd.Encode(make([]byte, 32)); !bytes.Equal(got, want) {
		t.Fatalf("rdma_read:\n got %x\nwant %x", got, want)
	}
	var drd RDMARead
	if err := drd.Decode(want); err != nil || drd != rd {
		t.Fatalf("rdma_read decode: %+v %v", drd, err)
	}
	want = kit.Golden(t, "rdma_read_nodata")
	rd = RDMARead{UsrLen: 32}
	if got := rd.Encode(make([]byte, 32)); !bytes.Equal(got, want) {
		t.Fatalf("rdma_read_nodata:\n got %x\nwant %x", got, want)
	}
	if err := drd.Decode(want); err != nil || drd != rd {
		t.Fatalf("rdma_read_nodata decode: %+v %v", drd, err)
	}
	want = kit.Golden(t, "rdma_write")
	wr := RDMAWrite{UsrLen: 32}
	if got := wr.Encode(make([]byte, 4)); !bytes.Equal(got, want) {
		t.Fatalf("rdma_write:\n got %x\nwant %x", got, want)
	}
	var dwr RDMAWrite
	if err := dwr.Decode(want); err != nil || dwr != wr {
		t.Fatalf("rdma_write decode: %+v %v", dwr, err)
	}
}

// TestSizes asserts the kernel's structure sizes (its BUILD_BUG_ONs and
// the 56-byte private data limit).
func TestSizes(t *testing.T) {
	for _, c := range []struct {
		name string
		got  int
		want int
	}{
		{"rtrs_msg_conn_req", len((&ConnReq{}).Encode(make([]byte, 100))), 56},
		{"rtrs_msg_conn_rsp", len((&ConnRsp{}).Encode(make([]byte, 100))), 56},
		{"rtrs_msg_info_req", len((&InfoReq{}).Encode(make([]byte, 300))), 272},
		{"rtrs_msg_info_rsp", InfoRspSize(0), 8},
		{"rtrs_sg_desc", SGDescSize, 16},
		{"rtrs_msg_rkey_rsp", len((&RkeyRsp{}).Encode(make([]byte, 8))), 8},
		{"rtrs_msg_rdma_read", len((&RDMARead{}).Encode(make([]byte, 8))), 8},
		{"rtrs_msg_rdma_read+desc", len((&RDMARead{SGCnt: 1}).Encode(make([]byte, 24))), 24},
		{"rtrs_msg_rdma_write", len((&RDMAWrite{}).Encode(make([]byte, 4))), 4},
	} {
		if c.got != c.want {
			t.Errorf("%s: %d bytes, want %d", c.name, c.got, c.want)
		}
	}
}

func TestImm(t *testing.T) {
	// IO_RSP of msg 5 with EIO: type 1, errno 5 in bits 19..27.
	if got, want := IORspImm(5, syscall.EIO, false), uint32(1<<28|5<<19|5); got != want {
		t.Fatalf("IORspImm = %#x, want %#x", got, want)
	}
	if got, want := IORspImm(0x7ffff, 0x1ff, true), uint32(2<<28|0x1ff<<19|0x7ffff); got != want {
		t.Fatalf("IORspImm W_INV = %#x, want %#x", got, want)
	}
	typ, payload := FromImm(IORspImm(300, syscall.ENOSPC, false))
	id, e := FromIORspImm(payload)
	if typ != ImmIORsp || id != 300 || e != syscall.ENOSPC {
		t.Fatalf("round trip: type %d id %d errno %v", typ, id, e)
	}
	// The errno keeps 9 bits; msg_id keeps 19.
	_, payload = FromImm(IORspImm(1<<19|7, 0x200|3, false))
	if id, e := FromIORspImm(payload); id != 7 || e != 3 {
		t.Fatalf("truncation: id %d errno %d", id, e)
	}
	if ToImm(ImmHBMsg, 0) != 0x80000000 || ToImm(ImmHBAck, 0) != 0x90000000 {
		t.Fatalf("heartbeat immediates %#x %#x", ToImm(ImmHBMsg, 0), ToImm(ImmHBAck, 0))
	}
	// IO_REQ: buf_id in the high bits above mem_bits, offset below.
	qd := uint32(512)
	mb := MemBits(qd)
	if mb != 19 {
		t.Fatalf("mem bits for 512 chunks = %d, want 19", mb)
	}
	imm := ToImm(ImmIOReq, 37<<mb|4096+32)
	typ, payload = FromImm(imm)
	if typ != ImmIOReq || payload>>mb != 37 || payload&(1<<mb-1) != 4128 {
		t.Fatalf("IO_REQ decode: type %d id %d off %d", typ, payload>>mb, payload&(1<<mb-1))
	}
}

func TestImmBudget(t *testing.T) {
	for _, c := range []struct {
		qd, chunk uint32
		ok        bool
	}{
		{512, 128 << 10, true},    // the kernel's defaults: 9 + 17 = 26
		{4096, 64 << 10, true},    // 12 + 16 = 28
		{4097, 64 << 10, false},   // 13 + 16 = 29
		{65535, 128 << 10, false}, // 16 + 17 = 33
		{65535, 4096, true},       // 16 + 12 = 28
		{1, 1 << 28, true},        // 0 + 28
	} {
		if err := CheckImmBudget(c.qd, c.chunk); (err == nil) != c.ok {
			t.Errorf("CheckImmBudget(%d, %d) = %v, want ok=%v", c.qd, c.chunk, err, c.ok)
		}
	}
	if BitsFor(1) != 0 || BitsFor(2) != 1 || BitsFor(512) != 9 || BitsFor(513) != 10 {
		t.Fatal("BitsFor is not ilog2(n-1)+1")
	}
}

func TestSessName(t *testing.T) {
	for name, ok := range map[string]bool{
		"client1@server1": true, "a": true, "": false, "a/b": false,
		"host.example": false, "x\x00y": false, strings.Repeat("n", 254): true, strings.Repeat("n", 255): false,
	} {
		if err := ValidSessName(name); (err == nil) != ok {
			t.Errorf("ValidSessName(%q) = %v", name, err)
		}
	}
}

// The fuzz targets check every decoder's contract: it never panics, an
// error leaves the zero value, and what decodes re-encodes to the same
// meaning.

func FuzzConnReq(f *testing.F) {
	f.Add(make([]byte, 56))
	f.Add(make([]byte, 55))
	f.Fuzz(func(t *testing.T, b []byte) {
		var m ConnReq
		if err := m.Decode(b); err != nil {
			if m != (ConnReq{}) {
				t.Fatal("error with a non-zero value")
			}
			return
		}
		var m2 ConnReq
		if err := m2.Decode(m.Encode(make([]byte, ConnReqSize))); err != nil || m2 != m {
			t.Fatalf("round trip: %+v != %+v", m2, m)
		}
	})
}

func FuzzConnRsp(f *testing.F) {
	f.Add(make([]byte, 56))
	f.Add([]byte{0xbd, 0x1b, 0, 2, 0x98, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m ConnRsp
		if err := m.Decode(b); err != nil {
			if m != (ConnRsp{}) {
				t.Fatal("error with a non-zero value")
			}
			return
		}
		if m.Errno > 0x8000 {
			t.Fatalf("errno %d out of range", m.Errno)
		}
		var m2 ConnRsp
		if err := m2.Decode(m.Encode(make([]byte, ConnRspSize))); err != nil || m2 != m {
			t.Fatalf("round trip: %+v != %+v", m2, m)
		}
	})
}

func FuzzInfoReq(f *testing.F) {
	f.Add(append([]byte{0, 0, 'a'}, make([]byte, 269)...))
	f.Fuzz(func(t *testing.T, b []byte) {
		var m InfoReq
		if err := m.Decode(b); err != nil {
			if m != (InfoReq{}) {
				t.Fatal("error with a non-zero value")
			}
			return
		}
		if len(m.Pathname) > 255 || strings.IndexByte(m.Pathname, 0) >= 0 {
			t.Fatalf("pathname %q", m.Pathname)
		}
		if ValidSessName(m.Pathname) == nil {
			var m2 InfoReq
			if err := m2.Decode(m.Encode(make([]byte, InfoReqSize))); err != nil || m2 != m {
				t.Fatalf("round trip: %+v != %+v", m2, m)
			}
		}
	})
}

func FuzzInfoRsp(f *testing.F) {
	f.Add([]byte{1, 0, 1, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8})
	f.Add([]byte{1, 0, 0xff, 0xff, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m InfoRsp
		if err := m.Decode(b); err != nil {
			if len(m.Desc) != 0 {
				t.Fatal("error with descriptors")
			}
			return
		}
		if InfoRspSize(len(m.Desc)) > len(b) {
			t.Fatalf("%d descriptors from %d bytes", len(m.Desc), len(b))
		}
		var m2 InfoRsp
		if err := m2.Decode(m.Encode(make([]byte, InfoRspSize(len(m.Desc))))); err != nil || !reflect.DeepEqual(m.Desc, m2.Desc) {
			t.Fatal("round trip")
		}
	})
}

func FuzzIOMessages(f *testing.F) {
	f.Add([]byte{3, 0, 32, 0, 1, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8})
	f.Add([]byte{2, 0, 32, 0})
	f.Add([]byte{4, 0, 1, 0, 1, 2, 3, 4})
	f.Add([]byte{3, 0, 0, 0, 0, 0, 2, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		var rd RDMARead
		if err := rd.Decode(b); err != nil {
			if rd != (RDMARead{}) {
				t.Fatal("read: error with a non-zero value")
			}
		} else {
			if rd.SGCnt > 1 || rd.Size() > len(b) {
				t.Fatalf("read: sg_cnt %d from %d bytes", rd.SGCnt, len(b))
			}
			var rd2 RDMARead
			if err := rd2.Decode(rd.Encode(make([]byte, rd.Size()))); err != nil || rd2 != rd {
				t.Fatal("read: round trip")
			}
		}
		var wr RDMAWrite
		if err := wr.Decode(b); err != nil {
			if wr != (RDMAWrite{}) {
				t.Fatal("write: error with a non-zero value")
			}
		} else {
			var wr2 RDMAWrite
			if err := wr2.Decode(wr.Encode(make([]byte, 4))); err != nil || wr2 != wr {
				t.Fatal("write: round trip")
			}
		}
		var rk RkeyRsp
		if err := rk.Decode(b); err != nil {
			if rk != (RkeyRsp{}) {
				t.Fatal("rkey: error with a non-zero value")
			}
		} else {
			var rk2 RkeyRsp
			if err := rk2.Decode(rk.Encode(make([]byte, 8))); err != nil || rk2 != rk {
				t.Fatal("rkey: round trip")
			}
		}
	})
}

func FuzzImm(f *testing.F) {
	f.Add(uint32(0x10000005))
	f.Add(uint32(0xffffffff))
	f.Fuzz(func(t *testing.T, imm uint32) {
		typ, payload := FromImm(imm)
		if ToImm(typ, payload) != imm {
			t.Fatalf("%#x does not round trip", imm)
		}
		id, e := FromIORspImm(payload)
		if id > 0x7ffff || e > 0x1ff {
			t.Fatalf("io rsp fields out of range: %d %d", id, e)
		}
		if IORspImm(id, e, typ == ImmIORspWInv)&0x0fffffff != payload {
			t.Fatalf("io rsp payload %#x does not round trip", payload)
		}
	})
}

func FuzzParsePathAddr(f *testing.F) {
	for _, s := range []string{"ip:1.2.3.4", "ip:1.2.3.4@ip:5.6.7.8", "ip:fe80::1%eth0,ip:fe80::2", "gid:fe80::2", "x", "@", "ip:@ip:"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParsePathAddr(s, 1234)
		if err != nil {
			if p != (PathAddr{}) {
				t.Fatal("error with a non-zero value")
			}
			return
		}
		if !p.Dst.IsValid() || p.Dst.Port() != 1234 {
			t.Fatalf("%q: destination %v", s, p.Dst)
		}
		_ = p.String()
	})
}
