package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/conntest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// pair connects a client and a server connection, each in its own PD
// with a 64 KiB region.
type pair struct {
	fab        *Fabric
	l          fabric.Listener
	cli, srv   *conntest.Recorder
	cpd, spd   fabric.PD
	cmem, smem []byte
	cmr, smr   fabric.MR
	priv       []byte
}

func newPair(t *testing.T, recvs []fabric.RecvWR) *pair {
	t.Helper()
	p := &pair{fab: New(Options{}), cli: conntest.NewRecorder(), srv: conntest.NewRecorder()}
	var err error
	p.l, err = p.fab.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	dev, _ := p.fab.Resolve(context.Background(), netip.AddrPort{}, p.l.Addr())
	p.cpd, _ = dev.AllocPD()
	p.spd, _ = dev.AllocPD()
	p.cmem, p.smem = make([]byte, 65536), make([]byte, 65536)
	p.cmr, _ = p.cpd.RegisterMR(p.cmem, fabric.AccessLocalWrite|fabric.AccessRemoteWrite)
	p.smr, _ = p.spd.RegisterMR(p.smem, fabric.AccessLocalWrite|fabric.AccessRemoteWrite)
	accepted := make(chan error, 1)
	go func() {
		r, err := p.l.Accept(context.Background())
		if err != nil {
			accepted <- err
			return
		}
		p.priv = r.PrivateData()
		_, err = r.Accept(p.spd, fabric.ConnAttr{Handler: p.srv, MaxSendWR: 64, MaxRecvWR: 64, Recvs: recvs}, []byte("welcome"))
		accepted <- err
	}()
	_, rsp, err := dev.Dial(context.Background(), fabric.DialParams{
		Dst: p.l.Addr(), PD: p.cpd, PrivateData: []byte("hello"),
		Attr: fabric.ConnAttr{Handler: p.cli, MaxSendWR: 64, MaxRecvWR: 64},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-accepted; err != nil {
		t.Fatal(err)
	}
	if string(rsp) != "welcome" || string(p.priv) != "hello" {
		t.Fatalf("private data %q %q", rsp, p.priv)
	}
	t.Cleanup(func() {
		p.cli.C.Close()
		p.srv.C.Close()
		p.l.Close()
	})
	return p
}

func write(buf []byte, addr uint64, rkey uint32, op fabric.Opcode, imm uint32) *fabric.SendWR {
	wr := &fabric.SendWR{Op: op, RemoteAddr: addr, RKey: rkey, Imm: imm, Signaled: true}
	if len(buf) > 0 {
		wr.SG[0].Buf, wr.NumSGE = buf, 1
	}
	return wr
}

func TestWriteWithImm(t *testing.T) {
	p := newPair(t, []fabric.RecvWR{{ID: 7}, {ID: 8}})
	data := bytes.Repeat([]byte("abcd"), 1000)
	// Two SGEs land back to back.
	wr := write(data[:1000], p.smr.Addr()+100, p.smr.RKey(), fabric.OpWriteImm, 0x12345678)
	wr.SG[1].Buf, wr.NumSGE = data[1000:], 2
	if err := p.cli.C.PostSend(wr); err != nil {
		t.Fatal(err)
	}
	if wc := p.cli.Next(t); wc.Opcode != fabric.WCWrite || wc.ByteLen != 4000 {
		t.Fatalf("send completion %+v", wc)
	}
	wc := p.srv.Next(t)
	if wc.ID != 7 || wc.Opcode != fabric.WCRecvRDMAWithImm || wc.Imm != 0x12345678 || wc.ByteLen != 4000 || wc.Flags != fabric.WCWithImm {
		t.Fatalf("receive completion %+v", wc)
	}
	if !bytes.Equal(p.smem[100:4100], data) {
		t.Fatal("data did not land")
	}
	// A zero-length write with immediate consumes a receive too.
	if err := p.cli.C.PostSend(write(nil, 0, 0, fabric.OpWriteImm, 9)); err != nil {
		t.Fatal(err)
	}
	if wc := p.srv.Next(t); wc.ID != 8 || wc.ByteLen != 0 || wc.Imm != 9 {
		t.Fatalf("zero-length: %+v", wc)
	}
}

func TestRNRWait(t *testing.T) {
	p := newPair(t, nil)
	if err := p.cli.C.PostSend(write(nil, 0, 0, fabric.OpWriteImm, 1)); err != nil {
		t.Fatal(err)
	}
	select {
	case wc := <-p.srv.WCs:
		t.Fatalf("completion without a receive: %+v", wc)
	case <-time.After(100 * time.Millisecond):
	}
	if err := p.srv.C.PostRecv(&fabric.RecvWR{ID: 3}); err != nil {
		t.Fatal(err)
	}
	if wc := p.srv.Next(t); wc.ID != 3 || wc.Imm != 1 {
		t.Fatalf("after the receive was posted: %+v", wc)
	}
}

func TestSend(t *testing.T) {
	buf := make([]byte, 16)
	p := newPair(t, []fabric.RecvWR{{ID: 1, Buf: buf}, {ID: 2, Buf: make([]byte, 4)}})
	if err := p.cli.C.PostSend(write([]byte("hello"), 0, 0, fabric.OpSendImm, 42)); err != nil {
		t.Fatal(err)
	}
	if wc := p.srv.Next(t); wc.ID != 1 || wc.Opcode != fabric.WCRecv || wc.ByteLen != 5 || wc.Imm != 42 || string(buf[:5]) != "hello" {
		t.Fatalf("send: %+v %q", wc, buf)
	}
	// A send longer than the receive buffer is a local length error.
	if err := p.cli.C.PostSend(write([]byte("too long"), 0, 0, fabric.OpSend, 0)); err != nil {
		t.Fatal(err)
	}
	p.srv.Ended(t)
}

func TestSendWithInvalidate(t *testing.T) {
	p := newPair(t, nil)
	rkey := p.cmr.RKey()
	p.cli.C.PostRecv(&fabric.RecvWR{ID: 1})
	if err := p.srv.C.PostSend(&fabric.SendWR{Op: fabric.OpSendInv, InvRKey: rkey}); err != nil {
		t.Fatal(err)
	}
	if wc := p.cli.Next(t); wc.Flags != fabric.WCWithInv || wc.InvRKey != rkey {
		t.Fatalf("completion %+v", wc)
	}
	// The key is gone: a write with it kills the connection.
	p.srv.C.PostSend(write([]byte("x"), p.cmr.Addr(), rkey, fabric.OpWrite, 0))
	p.cli.Ended(t)
}

func TestRemoteAccessChecks(t *testing.T) {
	for _, c := range []struct {
		name string
		wr   func(p *pair) *fabric.SendWR
		want error
	}{
		{"past the end", func(p *pair) *fabric.SendWR {
			return write(make([]byte, 16), p.smr.Addr()+65536-8, p.smr.RKey(), fabric.OpWrite, 0)
		}, errOutOfMR},
		{"before the start", func(p *pair) *fabric.SendWR {
			return write(make([]byte, 16), p.smr.Addr()-1, p.smr.RKey(), fabric.OpWrite, 0)
		}, errOutOfMR},
		{"address wrap", func(p *pair) *fabric.SendWR {
			return write(make([]byte, 16), ^uint64(0)-4, p.smr.RKey(), fabric.OpWrite, 0)
		}, errOutOfMR},
		{"stale key", func(p *pair) *fabric.SendWR {
			return write(make([]byte, 16), p.smr.Addr(), p.smr.RKey()^1, fabric.OpWrite, 0)
		}, errBadRKey},
		{"unknown index", func(p *pair) *fabric.SendWR {
			return write(make([]byte, 16), p.smr.Addr(), 0xfffff000, fabric.OpWrite, 0)
		}, errBadRKey},
		{"region of another PD", func(p *pair) *fabric.SendWR {
			return write(make([]byte, 16), p.cmr.Addr(), p.cmr.RKey(), fabric.OpWrite, 0)
		}, errWrongPD},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPair(t, nil)
			before := append([]byte(nil), p.smem...)
			if err := p.cli.C.PostSend(c.wr(p)); err != nil {
				t.Fatal(err)
			}
			if err := p.srv.Ended(t); !errors.Is(err, c.want) {
				t.Fatalf("killed with %v, want %v", err, c.want)
			}
			p.cli.Ended(t)
			if !bytes.Equal(before, p.smem) {
				t.Fatal("a refused write changed memory")
			}
		})
	}
}

func TestInvalidateReregister(t *testing.T) {
	p := newPair(t, []fabric.RecvWR{{ID: 1}, {ID: 2}})
	k0 := p.smr.RKey()
	if err := p.smr.Invalidate(); err != nil {
		t.Fatal(err)
	}
	k1, err := p.smr.Reregister()
	if err != nil || k1 == k0 || k1>>8 != k0>>8 || p.smr.RKey() != k1 {
		t.Fatalf("reregister: %#x -> %#x, %v", k0, k1, err)
	}
	p.cli.C.PostSend(write([]byte("new"), p.smr.Addr(), k1, fabric.OpWriteImm, 0))
	p.srv.Next(t)
	if string(p.smem[:3]) != "new" {
		t.Fatal("write with the new key did not land")
	}
	// 256 rotations come back to the same key byte: an rkey is 24 bits of
	// index and 8 of key, as on an HCA.
	for i := 0; i < 256; i++ {
		p.smr.Reregister()
	}
	if p.smr.RKey() != k1 {
		t.Fatal("the key byte does not wrap")
	}
	p.smr.Invalidate()
	p.cli.C.PostSend(write([]byte("old"), p.smr.Addr(), k1, fabric.OpWrite, 0))
	if err := p.srv.Ended(t); !errors.Is(err, errBadRKey) {
		t.Fatalf("write to an invalidated region: %v", err)
	}
	p.cli.Ended(t)
}

func TestCloseDrains(t *testing.T) {
	p := newPair(t, nil)
	for i := 0; i < 64; i++ {
		p.srv.C.PostRecv(&fabric.RecvWR{ID: uint64(i)})
	}
	for i := 0; i < 32; i++ {
		p.cli.C.PostSend(write(nil, 0, 0, fabric.OpWriteImm, uint32(i)))
	}
	p.srv.C.Close()
	n := p.srv.N.Load()
	time.Sleep(50 * time.Millisecond)
	if p.srv.N.Load() != n {
		t.Fatal("completions after Close returned")
	}
	select {
	case err := <-p.srv.Dead:
		t.Fatalf("Disconnected after Close: %v", err)
	default:
	}
	if err := p.srv.C.PostSend(write(nil, 0, 0, fabric.OpWriteImm, 0)); !errors.Is(err, fabric.ErrClosed) {
		t.Fatalf("post after close: %v", err)
	}
	p.cli.Ended(t) // the peer sees the connection go
}

func TestQueueFull(t *testing.T) {
	p := newPair(t, nil)
	for i := 0; i < 64; i++ {
		p.srv.C.PostRecv(&fabric.RecvWR{ID: uint64(i)})
	}
	if err := p.srv.C.PostRecv(&fabric.RecvWR{}); !errors.Is(err, fabric.ErrQueueFull) {
		t.Fatalf("65th receive: %v", err)
	}
	chain := make([]fabric.SendWR, 65)
	for i := range chain {
		chain[i] = fabric.SendWR{Op: fabric.OpWriteImm}
		if i > 0 {
			chain[i-1].Next = &chain[i]
		}
	}
	if err := p.cli.C.PostSend(&chain[0]); !errors.Is(err, fabric.ErrQueueFull) {
		t.Fatalf("chain of 65: %v", err)
	}
}

func TestReject(t *testing.T) {
	fab := New(Options{})
	l, err := fab.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		r, err := l.Accept(context.Background())
		if err == nil {
			r.Reject([]byte("no"))
		}
	}()
	dev, _ := fab.Resolve(context.Background(), netip.AddrPort{}, l.Addr())
	pd, _ := dev.AllocPD()
	_, _, err = dev.Dial(context.Background(), fabric.DialParams{Dst: l.Addr(), PD: pd, Attr: fabric.ConnAttr{Handler: conntest.NewRecorder()}})
	var rej *fabric.RejectError
	if !errors.As(err, &rej) || string(rej.PrivateData) != "no" {
		t.Fatalf("dial: %v", err)
	}
}

func TestHandshakeGarbage(t *testing.T) {
	fab := New(Options{HandshakeTimeout: 200 * time.Millisecond})
	l, err := fab.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for _, garbage := range [][]byte{
		[]byte("GET / HTTP/1.0\r\n\r\n"),
		append([]byte("RTRSTCP\x01\x01\x00"), 0xff, 0xff), // private data too long
		nil, // nothing at all: the timeout closes it
	} {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.Write(garbage)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := c.Read(make([]byte, 64)); err == nil {
			t.Fatalf("server answered %d bytes to garbage %q", n, garbage)
		}
		c.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if r, err := l.Accept(ctx); err == nil {
		t.Fatalf("garbage became a request: %q", r.PrivateData())
	}
}

// FuzzReader feeds arbitrary bytes to a connection's reader after a
// valid handshake: it must kill the connection or deliver completions,
// never panic or write outside a region.
func FuzzReader(f *testing.F) {
	hdr := func(op byte, n, imm, rkey uint32, addr uint64, payload []byte) []byte {
		b := make([]byte, frameHdrSize)
		b[0] = op
		binary.LittleEndian.PutUint32(b[4:], n)
		binary.LittleEndian.PutUint32(b[8:], imm)
		binary.LittleEndian.PutUint32(b[12:], rkey)
		binary.LittleEndian.PutUint64(b[16:], addr)
		return append(b, payload...)
	}
	f.Add(hdr(byte(fabric.OpWriteImm), 0, 1, 0, 0, nil))
	f.Add(hdr(byte(fabric.OpWrite), 4, 0, 0x100, 1<<32, []byte("data")))
	f.Add(hdr(byte(fabric.OpSend), 3, 0, 0, 0, []byte("abc")))
	f.Add(hdr(byte(fabric.OpSendInv), 0, 0, 0x100, 0, nil))
	f.Add(hdr(99, 0, 0, 0, 0, nil))
	f.Fuzz(func(t *testing.T, stream []byte) {
		fab := New(Options{})
		dev := fab.dev
		pdv, _ := dev.AllocPD()
		mem := make([]byte, 4096)
		guard := append([]byte(nil), make([]byte, 64)...)
		mr, _ := pdv.RegisterMR(mem[:4032], fabric.AccessLocalWrite|fabric.AccessRemoteWrite)
		defer mr.Close()
		a, b := net.Pipe()
		h := &reposter{Recorder: conntest.NewRecorder()}
		c, err := newConn(a, dev, pdv.(*pd), fabric.ConnAttr{Handler: h, MaxRecvWR: 8,
			Recvs: []fabric.RecvWR{{ID: 1, Buf: make([]byte, 8)}, {ID: 2}}})
		if err != nil {
			t.Fatal(err)
		}
		c.start()
		go func() {
			b.Write(stream)
			b.Close()
		}()
		<-h.Dead // every stream ends: the pipe closes
		c.Close()
		if !bytes.Equal(mem[4032:], guard) {
			t.Fatal("a write landed outside the region")
		}
	})
}

// reposter posts a new receive for every one consumed, as the engine does.
type reposter struct{ *conntest.Recorder }

func (r *reposter) Completion(wc *fabric.WC) {
	r.C.PostRecv(&fabric.RecvWR{ID: wc.ID, Buf: make([]byte, 8)})
}
