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
	"github.com/rnbd/rnbd/test/kit"
)

// The tests need an address on an RDMA device (soft-RoCE in the VM tier):
// RNBD_RDMA_ADDR=10.78.0.1 (kit.RDMAAddr). Without it they skip; the
// no-device checks run everywhere.

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

// newPair connects a pair over the device at RNBD_RDMA_ADDR.
func newPair(t testing.TB, recvs []fabric.RecvWR) *conntest.Pair {
	t.Helper()
	src := netip.AddrPortFrom(kit.RDMAAddr(t), 0)
	p := conntest.NewPair(t, newFabric(t), src, recvs)
	if dev := p.Dev; dev.Name() == "" || dev.Port() < 1 {
		t.Fatalf("device %q port %d", dev.Name(), dev.Port())
	}
	return p
}

// TestContract: what every fabric does alike; the peer of a closed
// connection hears of it from the CM at once, not from a timeout.
func TestContract(t *testing.T) {
	conntest.Contract{NewPair: newPair, PeerGone: syscall.ECONNRESET}.Run(t)
}

func TestSend(t *testing.T) {
	p := newPair(t, nil)
	recvBuf, err := p.Fab.AllocMemory(4096)
	if err != nil {
		t.Fatal(err)
	}
	rmr, err := p.SPD.RegisterMR(recvBuf.Bytes(), fabric.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer rmr.Close()
	defer recvBuf.Free()
	b := recvBuf.Bytes()
	if err := p.Srv.C.PostRecv(&fabric.RecvWR{ID: 1, Buf: b[:16], LKey: rmr.LKey(),
		Next: &fabric.RecvWR{ID: 2, Buf: b[16:20], LKey: rmr.LKey()}}); err != nil {
		t.Fatal(err)
	}
	msg := p.CMem.Bytes()[:8]
	copy(msg, "hello!!!")
	if err := p.Cli.C.PostSend(conntest.Write(msg[:5], p.CMR.LKey(), 0, 0, fabric.OpSendImm, 42)); err != nil {
		t.Fatal(err)
	}
	if wc := p.Srv.Next(t); wc.ID != 1 || wc.Opcode != fabric.WCRecv || wc.ByteLen != 5 || wc.Imm != 42 ||
		wc.Flags != fabric.WCWithImm || string(b[:5]) != "hello" {
		t.Fatalf("send: %+v %q", wc, b[:5])
	}
	// A send longer than the receive buffer kills the receiving
	// connection (a local length error; rxe reports a local QP operation
	// error).
	if err := p.Cli.C.PostSend(conntest.Write(msg, p.CMR.LKey(), 0, 0, fabric.OpSend, 0)); err != nil {
		t.Fatal(err)
	}
	var wcErr *WCError
	if err := p.Srv.Ended(t); !errors.As(err, &wcErr) {
		t.Fatalf("long send killed the receiver with %v, want a work request error", err)
	}
}

// The device itself refuses writes outside what was granted: the writer's
// connection gets a remote access error and nothing lands.
func TestRemoteAccessChecks(t *testing.T) {
	for _, c := range []struct {
		name string
		wr   func(p *conntest.Pair) *fabric.SendWR
	}{
		{"past the end", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(p.CMem.Bytes()[:16], p.CMR.LKey(), p.SMR.Addr()+65536-8, p.SMR.RKey(), fabric.OpWrite, 0)
		}},
		{"before the start", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(p.CMem.Bytes()[:16], p.CMR.LKey(), p.SMR.Addr()-4096, p.SMR.RKey(), fabric.OpWrite, 0)
		}},
		{"stale key", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(p.CMem.Bytes()[:16], p.CMR.LKey(), p.SMR.Addr(), p.SMR.RKey()^0x80, fabric.OpWrite, 0)
		}},
		{"region of another PD", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(p.CMem.Bytes()[:16], p.CMR.LKey(), p.CMR.Addr(), p.CMR.RKey(), fabric.OpWrite, 0)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPair(t, nil)
			copy(p.CMem.Bytes()[:16], "0123456789abcdef")
			before := append([]byte(nil), p.SMem.Bytes()...)
			if err := p.Cli.C.PostSend(c.wr(p)); err != nil {
				t.Fatal(err)
			}
			if err := p.Cli.Ended(t); !errors.Is(err, syscall.EACCES) {
				t.Fatalf("writer killed with %v, want a remote access error", err)
			}
			if !bytes.Equal(before, p.SMem.Bytes()) {
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
	k0 := p.SMR.RKey()
	if err := p.SMR.Invalidate(); err != nil {
		t.Fatal(err)
	}
	k1, err := p.SMR.Reregister()
	if err != nil || k1 == k0 || p.SMR.RKey() != k1 {
		t.Fatalf("reregister: %#x -> %#x, %v", k0, k1, err)
	}
	src := p.CMem.Bytes()[:3]
	copy(src, "new")
	p.Cli.C.PostSend(conntest.Write(src, p.CMR.LKey(), p.SMR.Addr(), k1, fabric.OpWriteImm, 0))
	p.Cli.Next(t) // the write's own completion
	p.Srv.Next(t)
	if string(p.SMem.Bytes()[:3]) != "new" {
		t.Fatal("write with the new key did not land")
	}
	// The server side sends from the invalidated region: its lkey holds.
	if err := p.SMR.Invalidate(); err != nil {
		t.Fatal(err)
	}
	p.Cli.C.PostRecv(&fabric.RecvWR{ID: 5})
	out := conntest.Write(p.SMem.Bytes()[:3], p.SMR.LKey(), p.CMR.Addr()+10, p.CMR.RKey(), fabric.OpWrite, 0)
	out.Next = conntest.Write(nil, 0, 0, 0, fabric.OpWriteImm, 77)
	if err := p.Srv.C.PostSend(out); err != nil {
		t.Fatal(err)
	}
	if wc := p.Cli.Next(t); wc.Imm != 77 || string(p.CMem.Bytes()[10:13]) != "new" {
		t.Fatalf("write from an invalidated region: %+v %q", wc, p.CMem.Bytes()[10:13])
	}
	copy(src, "old")
	p.Cli.C.PostSend(conntest.Write(src, p.CMR.LKey(), p.SMR.Addr(), k1, fabric.OpWrite, 0))
	if err := p.Cli.Ended(t); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("write to an invalidated region: %v", err)
	}
	if string(p.SMem.Bytes()[:3]) != "new" {
		t.Fatal("the refused write landed")
	}
}

func TestQueueFull(t *testing.T) {
	p := newPair(t, nil)
	var err error
	for i := 0; i < 100000 && err == nil; i++ {
		err = p.Srv.C.PostRecv(&fabric.RecvWR{ID: uint64(i)})
	}
	if !errors.Is(err, fabric.ErrQueueFull) {
		t.Fatalf("receives until full: %v", err)
	}
}

func TestReject(t *testing.T) {
	addr := kit.RDMAAddr(t)
	f := newFabric(t)
	l, err := f.Listen(netip.AddrPortFrom(addr, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	rejected := make(chan struct{})
	go func() {
		defer close(rejected)
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
	// The request's ID is destroyed while the listener still takes its
	// events (rdma_destroy_id waits for them): only then close it.
	select {
	case <-rejected:
	case <-time.After(20 * time.Second):
		t.Fatal("the rejecting goroutine did not finish")
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
		p.Srv.C.PostRecv(&fabric.RecvWR{ID: uint64(i)})
	}
	src := p.CMem.Bytes()[:4096]
	wr := conntest.Write(src, p.CMR.LKey(), p.SMR.Addr(), p.SMR.RKey(), fabric.OpWriteImm, 1)
	wr.Signaled = false
	rwr := &fabric.RecvWR{}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		wr.Signaled = i%16 == 15
		if err := p.Cli.C.PostSend(wr); err != nil {
			b.Fatal(err)
		}
		<-p.Srv.WCs
		if err := p.Srv.C.PostRecv(rwr); err != nil {
			b.Fatal(err)
		}
		if wr.Signaled {
			<-p.Cli.WCs
		}
	}
}

// TestMoreHeld: what is posted with More stays off the QP until Flush.
func TestMoreHeld(t *testing.T) {
	p := newPair(t, []fabric.RecvWR{{ID: 1}, {ID: 2}})
	c := p.Cli.C.(*conn)
	for i := uint32(1); i <= 2; i++ {
		wr := conntest.Write(nil, 0, 0, 0, fabric.OpWriteImm, i)
		wr.More = true
		if err := c.PostSend(wr); err != nil {
			t.Fatal(err)
		}
	}
	c.heldMu.Lock()
	held := c.nHeld
	c.heldMu.Unlock()
	if held != 2 {
		t.Fatalf("%d held after two posts with More, want 2", held)
	}
	c.Flush()
	for i := uint32(1); i <= 2; i++ {
		if wc := p.Srv.Next(t); wc.Imm != i {
			t.Fatalf("receive %d: %+v", i, wc)
		}
	}
}
