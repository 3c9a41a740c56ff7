package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/conntest"
)

// The tests need an address on an RDMA device (soft-RoCE in the VM tier):
// RNBD_RDMA_ADDR=10.78.0.1. Without it they skip; the no-device checks
// run everywhere.

func TestMain(m *testing.M) {
	code := m.Run()
	if err := ibverbs.LeakError(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

func rdmaAddr(t testing.TB) netip.Addr {
	t.Helper()
	s := os.Getenv("RNBD_RDMA_ADDR")
	if s == "" {
		t.Skip("set RNBD_RDMA_ADDR to an address on an RDMA device (the VM tier runs these on rdma_rxe)")
	}
	return netip.MustParseAddr(s)
}

func newFabric(t testing.TB) *Fabric {
	t.Helper()
	f, err := New(Options{ResolveTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// Without a device (or without cgo) the fabric says it cannot, wrapping
// fabric.ErrNotSupported, and leaks nothing.
func TestNoDevice(t *testing.T) {
	if os.Getenv("RNBD_RDMA_ADDR") != "" {
		t.Skip("this machine has an RDMA device")
	}
	f, err := New(Options{})
	if err != nil {
		if !errors.Is(err, fabric.ErrNotSupported) {
			t.Fatalf("New: %v", err)
		}
		return
	}
	_, err = f.Resolve(context.Background(), netip.AddrPort{}, netip.MustParseAddrPort("127.0.0.1:1234"))
	if !errors.Is(err, fabric.ErrNotSupported) {
		t.Fatalf("Resolve without a device: %v, want ErrNotSupported", err)
	}
	if _, err := f.Listen(netip.MustParseAddrPort("127.0.0.1:0")); !errors.Is(err, fabric.ErrNotSupported) {
		t.Fatalf("Listen without a device: %v, want ErrNotSupported", err)
	}
}

// pair connects a client and a server connection over the device, each
// in its own PD with a 64 KiB region.
type pair struct {
	fab        *Fabric
	l          fabric.Listener
	cli, srv   *conntest.Recorder
	cpd, spd   fabric.PD
	cmem, smem fabric.Memory
	cmr, smr   fabric.MR
	priv       []byte
}

func newPair(t testing.TB, recvs []fabric.RecvWR) *pair {
	t.Helper()
	addr := rdmaAddr(t)
	p := &pair{fab: newFabric(t), cli: conntest.NewRecorder(), srv: conntest.NewRecorder()}
	var err error
	p.l, err = p.fab.Listen(netip.AddrPortFrom(addr, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.l.Close() })
	if p.l.Addr().Port() == 0 {
		t.Fatalf("listener without a port: %v", p.l.Addr())
	}
	dev, err := p.fab.Resolve(context.Background(), netip.AddrPortFrom(addr, 0), p.l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if dev.Name() == "" || dev.Port() < 1 {
		t.Fatalf("device %q port %d", dev.Name(), dev.Port())
	}
	mustPD := func() fabric.PD {
		pd, err := dev.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		return pd
	}
	p.cpd, p.spd = mustPD(), mustPD()
	region := func(pd fabric.PD) (fabric.Memory, fabric.MR) {
		m, err := p.fab.AllocMemory(65536)
		if err != nil {
			t.Fatal(err)
		}
		mr, err := pd.RegisterMR(m.Bytes(), fabric.AccessLocalWrite|fabric.AccessRemoteWrite)
		if err != nil {
			t.Fatal(err)
		}
		return m, mr
	}
	p.cmem, p.cmr = region(p.cpd)
	p.smem, p.smr = region(p.spd)
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
		Src: netip.AddrPortFrom(addr, 0), Dst: p.l.Addr(), PD: p.cpd, PrivateData: []byte("hello"),
		Attr: fabric.ConnAttr{Handler: p.cli, MaxSendWR: 64, MaxRecvWR: 64},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-accepted; err != nil {
		t.Fatal(err)
	}
	// The CM carries more than was sent (an IB CM REP has 196 bytes of
	// private data): what was sent comes first.
	if !bytes.HasPrefix(rsp, []byte("welcome")) || !bytes.HasPrefix(p.priv, []byte("hello")) {
		t.Fatalf("private data %q %q", rsp, p.priv)
	}
	t.Cleanup(func() {
		p.cli.C.Close()
		p.srv.C.Close()
		p.cmr.Close()
		p.smr.Close()
		p.cpd.Close()
		p.spd.Close()
		p.cmem.Free()
		p.smem.Free()
	})
	return p
}

func write(buf []byte, lkey uint32, addr uint64, rkey uint32, op fabric.Opcode, imm uint32) *fabric.SendWR {
	wr := &fabric.SendWR{Op: op, RemoteAddr: addr, RKey: rkey, Imm: imm, Signaled: true}
	if len(buf) > 0 {
		wr.SG[0], wr.NumSGE = fabric.SGE{Buf: buf, LKey: lkey}, 1
	}
	return wr
}

func TestWriteWithImm(t *testing.T) {
	p := newPair(t, []fabric.RecvWR{{ID: 7}, {ID: 8}})
	data := p.cmem.Bytes()[:4000]
	copy(data, bytes.Repeat([]byte("abcd"), 1000))
	// Two SGEs land back to back.
	wr := write(data[:1000], p.cmr.LKey(), p.smr.Addr()+100, p.smr.RKey(), fabric.OpWriteImm, 0x12345678)
	wr.SG[1], wr.NumSGE = fabric.SGE{Buf: data[1000:], LKey: p.cmr.LKey()}, 2
	if err := p.cli.C.PostSend(wr); err != nil {
		t.Fatal(err)
	}
	if wc := p.cli.Next(t); wc.Opcode != fabric.WCWrite {
		t.Fatalf("send completion %+v", wc)
	}
	wc := p.srv.Next(t)
	if wc.ID != 7 || wc.Opcode != fabric.WCRecvRDMAWithImm || wc.Imm != 0x12345678 || wc.ByteLen != 4000 || wc.Flags != fabric.WCWithImm {
		t.Fatalf("receive completion %+v", wc)
	}
	if !bytes.Equal(p.smem.Bytes()[100:4100], data) {
		t.Fatal("data did not land")
	}
	// A zero-length write with immediate consumes a receive too: the
	// RTRS heartbeat and IO response.
	if err := p.cli.C.PostSend(write(nil, 0, 0, 0, fabric.OpWriteImm, 9)); err != nil {
		t.Fatal(err)
	}
	if wc := p.srv.Next(t); wc.ID != 8 || wc.ByteLen != 0 || wc.Imm != 9 {
		t.Fatalf("zero-length: %+v", wc)
	}
}

func TestRNRWait(t *testing.T) {
	p := newPair(t, nil)
	if err := p.cli.C.PostSend(write(nil, 0, 0, 0, fabric.OpWriteImm, 1)); err != nil {
		t.Fatal(err)
	}
	select {
	case wc := <-p.srv.WCs:
		t.Fatalf("completion without a receive: %+v", wc)
	case <-time.After(200 * time.Millisecond):
	}
	if err := p.srv.C.PostRecv(&fabric.RecvWR{ID: 3}); err != nil {
		t.Fatal(err)
	}
	if wc := p.srv.Next(t); wc.ID != 3 || wc.Imm != 1 {
		t.Fatalf("after the receive was posted: %+v", wc)
	}
}

func TestSend(t *testing.T) {
	p := newPair(t, nil)
	recvBuf, err := p.fab.AllocMemory(4096)
	if err != nil {
		t.Fatal(err)
	}
	rmr, err := p.spd.RegisterMR(recvBuf.Bytes(), fabric.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer rmr.Close()
	defer recvBuf.Free()
	b := recvBuf.Bytes()
	if err := p.srv.C.PostRecv(&fabric.RecvWR{ID: 1, Buf: b[:16], LKey: rmr.LKey(),
		Next: &fabric.RecvWR{ID: 2, Buf: b[16:20], LKey: rmr.LKey()}}); err != nil {
		t.Fatal(err)
	}
	msg := p.cmem.Bytes()[:8]
	copy(msg, "hello!!!")
	if err := p.cli.C.PostSend(write(msg[:5], p.cmr.LKey(), 0, 0, fabric.OpSendImm, 42)); err != nil {
		t.Fatal(err)
	}
	if wc := p.srv.Next(t); wc.ID != 1 || wc.Opcode != fabric.WCRecv || wc.ByteLen != 5 || wc.Imm != 42 ||
		wc.Flags != fabric.WCWithImm || string(b[:5]) != "hello" {
		t.Fatalf("send: %+v %q", wc, b[:5])
	}
	// A send longer than the receive buffer kills the receiving
	// connection (a local length error; rxe reports a local QP operation
	// error).
	if err := p.cli.C.PostSend(write(msg, p.cmr.LKey(), 0, 0, fabric.OpSend, 0)); err != nil {
		t.Fatal(err)
	}
	var wcErr *WCError
	if err := p.srv.Ended(t); !errors.As(err, &wcErr) {
		t.Fatalf("long send killed the receiver with %v, want a work request error", err)
	}
}

// The device itself refuses writes outside what was granted: the writer's
// connection gets a remote access error and nothing lands.
func TestRemoteAccessChecks(t *testing.T) {
	for _, c := range []struct {
		name string
		wr   func(p *pair) *fabric.SendWR
	}{
		{"past the end", func(p *pair) *fabric.SendWR {
			return write(p.cmem.Bytes()[:16], p.cmr.LKey(), p.smr.Addr()+65536-8, p.smr.RKey(), fabric.OpWrite, 0)
		}},
		{"before the start", func(p *pair) *fabric.SendWR {
			return write(p.cmem.Bytes()[:16], p.cmr.LKey(), p.smr.Addr()-4096, p.smr.RKey(), fabric.OpWrite, 0)
		}},
		{"stale key", func(p *pair) *fabric.SendWR {
			return write(p.cmem.Bytes()[:16], p.cmr.LKey(), p.smr.Addr(), p.smr.RKey()^0x80, fabric.OpWrite, 0)
		}},
		{"region of another PD", func(p *pair) *fabric.SendWR {
			return write(p.cmem.Bytes()[:16], p.cmr.LKey(), p.cmr.Addr(), p.cmr.RKey(), fabric.OpWrite, 0)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPair(t, nil)
			copy(p.cmem.Bytes()[:16], "0123456789abcdef")
			before := append([]byte(nil), p.smem.Bytes()...)
			if err := p.cli.C.PostSend(c.wr(p)); err != nil {
				t.Fatal(err)
			}
			if err := p.cli.Ended(t); !errors.Is(err, syscall.EACCES) {
				t.Fatalf("writer killed with %v, want a remote access error", err)
			}
			if !bytes.Equal(before, p.smem.Bytes()) {
				t.Fatal("a refused write changed memory")
			}
		})
	}
}

// always_invalidate on verbs: an invalidated region refuses its old rkey,
// a re-registered one takes its new rkey, and local access keeps working
// throughout.
func TestInvalidateReregister(t *testing.T) {
	p := newPair(t, []fabric.RecvWR{{ID: 1}, {ID: 2}})
	k0 := p.smr.RKey()
	if err := p.smr.Invalidate(); err != nil {
		t.Fatal(err)
	}
	k1, err := p.smr.Reregister()
	if err != nil || k1 == k0 || p.smr.RKey() != k1 {
		t.Fatalf("reregister: %#x -> %#x, %v", k0, k1, err)
	}
	src := p.cmem.Bytes()[:3]
	copy(src, "new")
	p.cli.C.PostSend(write(src, p.cmr.LKey(), p.smr.Addr(), k1, fabric.OpWriteImm, 0))
	p.cli.Next(t) // the write's own completion
	p.srv.Next(t)
	if string(p.smem.Bytes()[:3]) != "new" {
		t.Fatal("write with the new key did not land")
	}
	// The server side sends from the invalidated region: its lkey holds.
	if err := p.smr.Invalidate(); err != nil {
		t.Fatal(err)
	}
	p.cli.C.PostRecv(&fabric.RecvWR{ID: 5})
	out := write(p.smem.Bytes()[:3], p.smr.LKey(), p.cmr.Addr()+10, p.cmr.RKey(), fabric.OpWrite, 0)
	out.Next = write(nil, 0, 0, 0, fabric.OpWriteImm, 77)
	if err := p.srv.C.PostSend(out); err != nil {
		t.Fatal(err)
	}
	if wc := p.cli.Next(t); wc.Imm != 77 || string(p.cmem.Bytes()[10:13]) != "new" {
		t.Fatalf("write from an invalidated region: %+v %q", wc, p.cmem.Bytes()[10:13])
	}
	copy(src, "old")
	p.cli.C.PostSend(write(src, p.cmr.LKey(), p.smr.Addr(), k1, fabric.OpWrite, 0))
	if err := p.cli.Ended(t); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("write to an invalidated region: %v", err)
	}
	if string(p.smem.Bytes()[:3]) != "new" {
		t.Fatal("the refused write landed")
	}
}

func TestCloseDrains(t *testing.T) {
	p := newPair(t, nil)
	for i := 0; i < 64; i++ {
		p.srv.C.PostRecv(&fabric.RecvWR{ID: uint64(i)})
	}
	for i := 0; i < 32; i++ {
		p.cli.C.PostSend(write(nil, 0, 0, 0, fabric.OpWriteImm, uint32(i)))
	}
	p.srv.C.Close()
	n := p.srv.N.Load()
	time.Sleep(100 * time.Millisecond)
	if p.srv.N.Load() != n {
		t.Fatal("completions after Close returned")
	}
	select {
	case err := <-p.srv.Dead:
		t.Fatalf("Disconnected after Close: %v", err)
	default:
	}
	if err := p.srv.C.PostSend(write(nil, 0, 0, 0, fabric.OpWriteImm, 0)); !errors.Is(err, fabric.ErrClosed) {
		t.Fatalf("post after close: %v", err)
	}
	// The peer hears of it from the CM at once, not from a timeout.
	t0 := time.Now()
	if err := p.cli.Ended(t); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("peer: %v", err)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Fatalf("the peer took %v to see the disconnect", d)
	}
}

func TestQueueFull(t *testing.T) {
	p := newPair(t, nil)
	var err error
	for i := 0; i < 100000 && err == nil; i++ {
		err = p.srv.C.PostRecv(&fabric.RecvWR{ID: uint64(i)})
	}
	if !errors.Is(err, fabric.ErrQueueFull) {
		t.Fatalf("receives until full: %v", err)
	}
}

func TestReject(t *testing.T) {
	addr := rdmaAddr(t)
	f := newFabric(t)
	l, err := f.Listen(netip.AddrPortFrom(addr, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		r, err := l.Accept(context.Background())
		if err == nil {
			r.Reject([]byte("go away"))
		}
	}()
	dev, err := f.Resolve(context.Background(), netip.AddrPort{}, l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	_, _, err = dev.Dial(context.Background(), fabric.DialParams{Dst: l.Addr(), PD: pd, PrivateData: []byte("hi"),
		Attr: fabric.ConnAttr{Handler: conntest.NewRecorder(), MaxSendWR: 4, MaxRecvWR: 4}})
	var rej *fabric.RejectError
	if !errors.As(err, &rej) || !bytes.HasPrefix(rej.PrivateData, []byte("go away")) {
		t.Fatalf("dial: %v", err)
	}
	// Nobody listening: refused, not hung.
	l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, _, err := dev.Dial(ctx, fabric.DialParams{Dst: l.Addr(), PD: pd,
		Attr: fabric.ConnAttr{Handler: conntest.NewRecorder(), MaxSendWR: 4, MaxRecvWR: 4}}); err == nil || ctx.Err() != nil {
		t.Fatalf("dial to a closed listener: %v (ctx %v)", err, ctx.Err())
	}
}

// BenchmarkWriteImm is the fabric's hot path: a 4 KiB RDMA write with
// immediate posted, its receive completion delivered and the receive
// posted again (allocs/op is the point; time is the device's).
func BenchmarkWriteImm(b *testing.B) {
	p := newPair(b, nil)
	for i := 0; i < 32; i++ {
		p.srv.C.PostRecv(&fabric.RecvWR{ID: uint64(i)})
	}
	src := p.cmem.Bytes()[:4096]
	wr := write(src, p.cmr.LKey(), p.smr.Addr(), p.smr.RKey(), fabric.OpWriteImm, 1)
	wr.Signaled = false
	rwr := &fabric.RecvWR{}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		wr.Signaled = i%16 == 15
		if err := p.cli.C.PostSend(wr); err != nil {
			b.Fatal(err)
		}
		<-p.srv.WCs
		if err := p.srv.C.PostRecv(rwr); err != nil {
			b.Fatal(err)
		}
		if wr.Signaled {
			<-p.cli.WCs
		}
	}
}
