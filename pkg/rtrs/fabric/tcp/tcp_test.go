package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/conntest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newPair(t testing.TB, recvs []fabric.RecvWR) *conntest.Pair {
	t.Helper()
	p := conntest.NewPair(t, New(Options{}), netip.MustParseAddrPort("127.0.0.1:0"), recvs)
	if string(p.Rsp) != "welcome" || string(p.Priv) != "hello" {
		t.Fatalf("private data %q %q: a stream carries it as sent", p.Rsp, p.Priv)
	}
	return p
}

func TestContract(t *testing.T) { conntest.Contract{NewPair: newPair, SendByteLen: true}.Run(t) }

// Without TLS both ends write with writev on the socket itself: nothing
// wraps it (the hot path).
func TestPlainConnIsRaw(t *testing.T) {
	p := newPair(t, nil)
	for _, c := range []*conn{p.Cli.C.(*conn), p.Srv.C.(*conn)} {
		if c.sio == nil || c.nc != c.raw {
			t.Fatalf("connection %v: %T, raw IO %v", c.local, c.nc, c.sio != nil)
		}
	}
}

func TestSend(t *testing.T) {
	buf := make([]byte, 16)
	p := newPair(t, []fabric.RecvWR{{ID: 1, Buf: buf}, {ID: 2, Buf: make([]byte, 4)}})
	if err := p.Cli.C.PostSend(conntest.Write([]byte("hello"), 0, 0, 0, fabric.OpSendImm, 42)); err != nil {
		t.Fatal(err)
	}
	if wc := p.Srv.Next(t); wc.ID != 1 || wc.Opcode != fabric.WCRecv || wc.ByteLen != 5 || wc.Imm != 42 || string(buf[:5]) != "hello" {
		t.Fatalf("send: %+v %q", wc, buf)
	}
	// A send longer than the receive buffer is a local length error.
	if err := p.Cli.C.PostSend(conntest.Write([]byte("too long"), 0, 0, 0, fabric.OpSend, 0)); err != nil {
		t.Fatal(err)
	}
	p.Srv.Ended(t)
}

func TestSendWithInvalidate(t *testing.T) {
	p := newPair(t, nil)
	rkey := p.CMR.RKey()
	p.Cli.C.PostRecv(&fabric.RecvWR{ID: 1})
	if err := p.Srv.C.PostSend(&fabric.SendWR{Op: fabric.OpSendInv, InvRKey: rkey}); err != nil {
		t.Fatal(err)
	}
	if wc := p.Cli.Next(t); wc.Flags != fabric.WCWithInv || wc.InvRKey != rkey {
		t.Fatalf("completion %+v", wc)
	}
	// The key is gone: a write with it kills the connection.
	p.Srv.C.PostSend(conntest.Write([]byte("x"), 0, p.CMR.Addr(), rkey, fabric.OpWrite, 0))
	p.Cli.Ended(t)
}

func TestRemoteAccessChecks(t *testing.T) {
	for _, c := range []struct {
		name string
		wr   func(p *conntest.Pair) *fabric.SendWR
		want error
	}{
		{"past the end", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(make([]byte, 16), 0, p.SMR.Addr()+65536-8, p.SMR.RKey(), fabric.OpWrite, 0)
		}, errOutOfMR},
		{"before the start", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(make([]byte, 16), 0, p.SMR.Addr()-1, p.SMR.RKey(), fabric.OpWrite, 0)
		}, errOutOfMR},
		{"address wrap", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(make([]byte, 16), 0, ^uint64(0)-4, p.SMR.RKey(), fabric.OpWrite, 0)
		}, errOutOfMR},
		{"stale key", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(make([]byte, 16), 0, p.SMR.Addr(), p.SMR.RKey()^1, fabric.OpWrite, 0)
		}, errBadRKey},
		{"unknown index", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(make([]byte, 16), 0, p.SMR.Addr(), 0xfffff000, fabric.OpWrite, 0)
		}, errBadRKey},
		{"region of another PD", func(p *conntest.Pair) *fabric.SendWR {
			return conntest.Write(make([]byte, 16), 0, p.CMR.Addr(), p.CMR.RKey(), fabric.OpWrite, 0)
		}, errWrongPD},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPair(t, nil)
			before := append([]byte(nil), p.SMem.Bytes()...)
			if err := p.Cli.C.PostSend(c.wr(p)); err != nil {
				t.Fatal(err)
			}
			if err := p.Srv.Ended(t); !errors.Is(err, c.want) {
				t.Fatalf("killed with %v, want %v", err, c.want)
			}
			p.Cli.Ended(t)
			if !bytes.Equal(before, p.SMem.Bytes()) {
				t.Fatal("a refused write changed memory")
			}
		})
	}
}

func TestInvalidateReregister(t *testing.T) {
	p := newPair(t, []fabric.RecvWR{{ID: 1}, {ID: 2}})
	k0 := p.SMR.RKey()
	if err := p.SMR.Invalidate(); err != nil {
		t.Fatal(err)
	}
	k1, err := p.SMR.Reregister()
	if err != nil || k1 == k0 || k1>>8 != k0>>8 || p.SMR.RKey() != k1 {
		t.Fatalf("reregister: %#x -> %#x, %v", k0, k1, err)
	}
	p.Cli.C.PostSend(conntest.Write([]byte("new"), 0, p.SMR.Addr(), k1, fabric.OpWriteImm, 0))
	p.Srv.Next(t)
	if string(p.SMem.Bytes()[:3]) != "new" {
		t.Fatal("write with the new key did not land")
	}
	// 256 rotations come back to the same key byte: an rkey is 24 bits of
	// index and 8 of key, as on an HCA.
	for i := 0; i < 256; i++ {
		p.SMR.Reregister()
	}
	if p.SMR.RKey() != k1 {
		t.Fatal("the key byte does not wrap")
	}
	p.SMR.Invalidate()
	p.Cli.C.PostSend(conntest.Write([]byte("old"), 0, p.SMR.Addr(), k1, fabric.OpWrite, 0))
	if err := p.Srv.Ended(t); !errors.Is(err, errBadRKey) {
		t.Fatalf("write to an invalidated region: %v", err)
	}
	p.Cli.Ended(t)
}

func TestQueueFull(t *testing.T) {
	p := newPair(t, nil)
	for i := 0; i < 64; i++ {
		p.Srv.C.PostRecv(&fabric.RecvWR{ID: uint64(i)})
	}
	if err := p.Srv.C.PostRecv(&fabric.RecvWR{}); !errors.Is(err, fabric.ErrQueueFull) {
		t.Fatalf("65th receive: %v", err)
	}
	chain := make([]fabric.SendWR, 65)
	for i := range chain {
		chain[i] = fabric.SendWR{Op: fabric.OpWriteImm}
		if i > 0 {
			chain[i-1].Next = &chain[i]
		}
	}
	if err := p.Cli.C.PostSend(&chain[0]); !errors.Is(err, fabric.ErrQueueFull) {
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
		c, err := newConn(a, a, dev, pdv.(*pd), fabric.ConnAttr{Handler: h, MaxRecvWR: 8,
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

// TestMoreHeldUntilFlush checks that work requests posted with More wait
// for Flush (or for a post without More), then go out in order.
func TestMoreHeldUntilFlush(t *testing.T) {
	bufs := [][]byte{make([]byte, 8), make([]byte, 8), make([]byte, 8), make([]byte, 8)}
	var recvs []fabric.RecvWR
	for i, b := range bufs {
		recvs = append(recvs, fabric.RecvWR{ID: uint64(i + 1), Buf: b})
	}
	p := newPair(t, recvs)
	c := p.Cli.C.(*conn)
	post := func(s string, more bool) {
		t.Helper()
		wr := conntest.Write([]byte(s), 0, 0, 0, fabric.OpSend, 0)
		wr.More = more
		if err := c.PostSend(wr); err != nil {
			t.Fatal(err)
		}
	}
	post("one", true)
	post("two", true)
	c.sqMu.Lock()
	queued, woken := c.sqLen, len(c.wake)
	c.sqMu.Unlock()
	if queued != 2 || woken != 0 {
		t.Fatalf("after two posts with More: %d queued, writer woken %d times; want 2 held", queued, woken)
	}
	c.Flush()
	c.sqMu.Lock()
	queued = c.sqLen
	c.sqMu.Unlock()
	if queued != 0 {
		t.Fatalf("%d still queued after Flush", queued)
	}
	post("three", true)
	post("four", false) // pushes what is held with it
	for i, want := range []string{"one", "two", "three", "four"} {
		wc := p.Srv.Next(t)
		if wc.ID != uint64(i+1) || string(bufs[i][:wc.ByteLen]) != want {
			t.Fatalf("receive %d: %+v %q, want %q", i, wc, bufs[i][:wc.ByteLen], want)
		}
	}
}

// Idle connections from one address take at most MaxHandshakesPerAddr
// handshake slots: the next one from there is closed at once. When two
// such floods take every slot (MaxHandshakes), a peer at a third address
// still completes its handshake: it takes the oldest slot of a flood.
func TestHandshakeSlotsPerAddress(t *testing.T) {
	fab := New(Options{HandshakeTimeout: 30 * time.Second, MaxHandshakesPerAddr: 4, MaxHandshakes: 8})
	l, err := fab.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	from := func(ip string) net.Conn {
		t.Helper()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
		c, err := d.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	counted := func(ip string) int {
		ll := l.(*listener)
		ll.perAddrMu.Lock()
		defer ll.perAddrMu.Unlock()
		return ll.perAddr[netip.MustParsePrefix(ip+"/32")]
	}
	var flood []net.Conn
	for i := 0; i < 4; i++ {
		flood = append(flood, from("127.0.0.3"))
	}
	kit.WaitFor(t, 10*time.Second, "the idle handshakes to be counted", func() bool { return counted("127.0.0.3") == 4 })
	c := from("127.0.0.3")
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("a fifth idle connection from one address: read %v, want EOF (closed)", err)
	}
	var flood5 []net.Conn
	for i := 0; i < 4; i++ {
		flood5 = append(flood5, from("127.0.0.5"))
	}
	kit.WaitFor(t, 10*time.Second, "the second flood to be counted", func() bool { return counted("127.0.0.5") == 4 })
	// Another address still gets through: every slot is taken, and the
	// oldest of a flood's gives way.
	dev, err := fab.Resolve(context.Background(), netip.MustParseAddrPort("127.0.0.4:0"), l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	pdv, _ := dev.AllocPD()
	dialed := make(chan error, 1)
	go func() {
		conn, _, err := dev.Dial(context.Background(), fabric.DialParams{Src: netip.MustParseAddrPort("127.0.0.4:0"), Dst: l.Addr(),
			PD: pdv, PrivateData: []byte("hi"), Attr: fabric.ConnAttr{Handler: conntest.NewRecorder(), MaxSendWR: 4, MaxRecvWR: 4}})
		if err == nil {
			conn.Close()
		}
		dialed <- err
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := l.Accept(ctx)
	if err != nil {
		t.Fatalf("a request from another address: %v", err)
	}
	r.Reject(nil)
	<-dialed
	if n := counted("127.0.0.3") + counted("127.0.0.5"); n != 7 {
		t.Fatalf("the floods hold %d slots after the third address came, want 7", n)
	}
	// Both floods hold as many: either may give way, with its oldest.
	gave := flood5
	if counted("127.0.0.3") == 3 {
		gave = flood
	}
	gave[0].SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := gave[0].Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("the oldest idle connection of the flood that gave way: read %v, want EOF (closed)", err)
	}
}

// TestEvictionByNetwork: when the handshake slots run short, a host that
// holds one from each of many addresses of its IPv6 /64 counts as one
// network and gives way to a peer of another network, oldest first; a
// peer of the same /64 takes nothing from it.
func TestEvictionByNetwork(t *testing.T) {
	l := &listener{shaking: map[net.Conn]shakingState{}, perAddr: map[netip.Prefix]int{}}
	var conns []net.Conn
	for i := 1; i <= 6; i++ {
		a, b := net.Pipe()
		t.Cleanup(func() { a.Close(); b.Close() })
		peer := fabric.PeerGroup(netip.MustParseAddr(fmt.Sprintf("2001:db8:1:2::%x", i)))
		l.shakeSeq++
		l.shaking[a] = shakingState{peer: peer, seq: l.shakeSeq}
		l.perAddr[peer]++
		conns = append(conns, b)
	}
	if l.evictLocked(fabric.PeerGroup(netip.MustParseAddr("2001:db8:1:2::99"))) { // +checklocksignore: l is the test's alone
		t.Fatal("a peer of the same /64 evicted one of its own network")
	}
	if !l.evictLocked(fabric.PeerGroup(netip.MustParseAddr("2001:db8:7::1"))) { // +checklocksignore: as above
		t.Fatal("a peer of another network found no room")
	}
	if len(l.shaking) != 5 {
		t.Fatalf("%d handshakes left, want 5", len(l.shaking))
	}
	conns[0].SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := conns[0].Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("the oldest handshake of the network: read %v, want EOF (closed)", err)
	}
}
