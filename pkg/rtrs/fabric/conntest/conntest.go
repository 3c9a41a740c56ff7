// Package conntest helps test implementations of the fabric contract: a
// handler that records what a connection delivers, a connected pair, and
// the tests every fabric must pass alike (Contract).
package conntest

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Recorder is a fabric.Handler for tests of a fabric: it keeps the
// connection it is attached to, queues every completion, and reports the
// connection's end. C, WCs and Dead are its state. It may be used from
// the fabric's goroutines and the test's at once: C is set by Attached,
// which comes before every other call and before Dial or Accept return;
// WCs and Dead are channels, N a counter.
type Recorder struct {
	C    fabric.Conn
	WCs  chan fabric.WC
	Dead chan error
	N    atomic.Int64 // completions seen
}

// NewRecorder returns a Recorder with room for 4096 completions.
func NewRecorder() *Recorder {
	return &Recorder{WCs: make(chan fabric.WC, 4096), Dead: make(chan error, 1)}
}

func (r *Recorder) Attached(c fabric.Conn) { r.C = c }

func (r *Recorder) Completion(wc *fabric.WC) {
	r.N.Add(1)
	r.WCs <- *wc
}

func (r *Recorder) Disconnected(err error) { r.Dead <- err }

// Next returns the next completion; the test fails if the connection
// ends first or none comes within 10 s.
func (r *Recorder) Next(t testing.TB) fabric.WC {
	t.Helper()
	select {
	case wc := <-r.WCs:
		return wc
	case err := <-r.Dead:
		t.Fatalf("disconnected: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no completion")
	}
	panic("unreachable")
}

// Ended returns why the connection ended; the test fails if it does not
// within 20 s.
func (r *Recorder) Ended(t testing.TB) error {
	t.Helper()
	select {
	case err := <-r.Dead:
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("connection not killed")
	}
	return nil
}

// Pair is a client and a server connection of one fabric, each in its
// own PD with a 64 KiB registered region. Its fields are set by NewPair
// and only read after, so it may be shared between goroutines.
type Pair struct {
	Fab        fabric.Fabric
	Dev        fabric.Device // the client's, resolved from src
	L          fabric.Listener
	Cli, Srv   *Recorder
	CPD, SPD   fabric.PD
	CMem, SMem fabric.Memory
	CMR, SMR   fabric.MR
	Priv, Rsp  []byte // the private data each side received
}

// NewPair listens on src's address (any port) and connects to it from
// src, the server side taking recvs. The private data sent ("hello",
// "welcome") must arrive; a CM may pad it. Everything is closed when the
// test ends.
func NewPair(t testing.TB, fab fabric.Fabric, src netip.AddrPort, recvs []fabric.RecvWR) *Pair {
	t.Helper()
	p := &Pair{Fab: fab, Cli: NewRecorder(), Srv: NewRecorder()}
	var err error
	if p.L, err = fab.Listen(netip.AddrPortFrom(src.Addr(), 0)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.L.Close() })
	if p.L.Addr().Port() == 0 {
		t.Fatalf("listener without a port: %v", p.L.Addr())
	}
	dev, err := fab.Resolve(context.Background(), src, p.L.Addr())
	if err != nil {
		t.Fatal(err)
	}
	p.Dev = dev
	region := func() (fabric.PD, fabric.Memory, fabric.MR) {
		pd, err := dev.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		m, err := fab.AllocMemory(65536)
		if err != nil {
			t.Fatal(err)
		}
		mr, err := pd.RegisterMR(m.Bytes(), fabric.AccessLocalWrite|fabric.AccessRemoteWrite)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			mr.Close()
			pd.Close()
			m.Free()
		})
		return pd, m, mr
	}
	p.CPD, p.CMem, p.CMR = region()
	p.SPD, p.SMem, p.SMR = region()
	accepted := make(chan error, 1)
	go func() {
		r, err := p.L.Accept(context.Background())
		if err != nil {
			accepted <- err
			return
		}
		p.Priv = r.PrivateData()
		_, err = r.Accept(p.SPD, fabric.ConnAttr{Handler: p.Srv, MaxSendWR: 64, MaxRecvWR: 64, Recvs: recvs}, []byte("welcome"))
		accepted <- err
	}()
	_, p.Rsp, err = dev.Dial(context.Background(), fabric.DialParams{
		Src: src, Dst: p.L.Addr(), PD: p.CPD, PrivateData: []byte("hello"),
		Attr: fabric.ConnAttr{Handler: p.Cli, MaxSendWR: 64, MaxRecvWR: 64},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-accepted; err != nil {
		t.Fatal(err)
	}
	// Registered after the regions': runs before them.
	t.Cleanup(func() {
		p.Cli.C.Close()
		p.Srv.C.Close()
	})
	if !bytes.HasPrefix(p.Rsp, []byte("welcome")) || !bytes.HasPrefix(p.Priv, []byte("hello")) {
		t.Fatalf("private data %q %q", p.Rsp, p.Priv)
	}
	return p
}

// Write returns a signaled work request of op with one SGE (none for an
// empty buf).
func Write(buf []byte, lkey uint32, addr uint64, rkey uint32, op fabric.Opcode, imm uint32) *fabric.SendWR {
	wr := &fabric.SendWR{Op: op, RemoteAddr: addr, RKey: rkey, Imm: imm, Signaled: true}
	if len(buf) > 0 {
		wr.SG[0], wr.NumSGE = fabric.SGE{Buf: buf, LKey: lkey}, 1
	}
	return wr
}

// Contract is what every fabric must do alike; Run checks it.
type Contract struct {
	// NewPair connects a Pair on the fabric under test.
	NewPair func(t testing.TB, recvs []fabric.RecvWR) *Pair
	// PeerGone, if set, is what the peer of a closed connection must
	// be told (errors.Is).
	PeerGone error
	// SendByteLen: the fabric reports the length of a write in its send
	// completion (verbs leaves it undefined).
	SendByteLen bool
}

// Run runs the contract's tests as subtests of t.
func (c Contract) Run(t *testing.T) {
	t.Run("WriteWithImm", c.writeWithImm)
	t.Run("RNRWait", c.rnrWait)
	t.Run("CloseDrains", c.closeDrains)
	t.Run("MoreThenFlush", c.moreThenFlush)
}

// moreThenFlush: on a Flusher, work requests posted with More arrive,
// in order, once Flush is called or a request without More follows;
// more than one post's worth (ibverbs.MaxChain is 16) included.
func (c Contract) moreThenFlush(t *testing.T) {
	const n = 20
	var recvs []fabric.RecvWR
	for i := 0; i < n+2; i++ {
		recvs = append(recvs, fabric.RecvWR{ID: uint64(100 + i)})
	}
	p := c.NewPair(t, recvs)
	f, ok := p.Cli.C.(fabric.Flusher)
	if !ok {
		t.Skip("not a Flusher")
	}
	post := func(imm uint32, more bool) {
		t.Helper()
		wr := Write(nil, 0, 0, 0, fabric.OpWriteImm, imm)
		wr.Signaled, wr.More = false, more
		if err := p.Cli.C.PostSend(wr); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < n; i++ {
		post(uint32(i), true)
	}
	f.Flush()
	recv := func(from, to int) {
		t.Helper()
		for i := from; i < to; i++ {
			if wc := p.Srv.Next(t); wc.ID != uint64(100+i) || wc.Imm != uint32(i) {
				t.Fatalf("receive %d: %+v", i, wc)
			}
		}
	}
	recv(0, n)
	post(n, true)
	post(n+1, false) // takes what is held with it
	recv(n, n+2)
}

// writeWithImm: the data of two SGEs lands back to back and the
// immediate consumes a receive, also with no data at all (the RTRS
// heartbeat and IO response).
func (c Contract) writeWithImm(t *testing.T) {
	p := c.NewPair(t, []fabric.RecvWR{{ID: 7}, {ID: 8}})
	data := p.CMem.Bytes()[:4000]
	copy(data, bytes.Repeat([]byte("abcd"), 1000))
	wr := Write(data[:1000], p.CMR.LKey(), p.SMR.Addr()+100, p.SMR.RKey(), fabric.OpWriteImm, 0x12345678)
	wr.SG[1], wr.NumSGE = fabric.SGE{Buf: data[1000:], LKey: p.CMR.LKey()}, 2
	if err := p.Cli.C.PostSend(wr); err != nil {
		t.Fatal(err)
	}
	if wc := p.Cli.Next(t); wc.Opcode != fabric.WCWrite || c.SendByteLen && wc.ByteLen != 4000 {
		t.Fatalf("send completion %+v", wc)
	}
	wc := p.Srv.Next(t)
	if wc.ID != 7 || wc.Opcode != fabric.WCRecvRDMAWithImm || wc.Imm != 0x12345678 || wc.ByteLen != 4000 || wc.Flags != fabric.WCWithImm {
		t.Fatalf("receive completion %+v", wc)
	}
	if !bytes.Equal(p.SMem.Bytes()[100:4100], data) {
		t.Fatal("data did not land")
	}
	if err := p.Cli.C.PostSend(Write(nil, 0, 0, 0, fabric.OpWriteImm, 9)); err != nil {
		t.Fatal(err)
	}
	if wc := p.Srv.Next(t); wc.ID != 8 || wc.ByteLen != 0 || wc.Imm != 9 {
		t.Fatalf("zero-length: %+v", wc)
	}
}

// rnrWait: an immediate with no receive posted waits for one (receiver
// not ready) instead of failing.
func (c Contract) rnrWait(t *testing.T) {
	p := c.NewPair(t, nil)
	if err := p.Cli.C.PostSend(Write(nil, 0, 0, 0, fabric.OpWriteImm, 1)); err != nil {
		t.Fatal(err)
	}
	select {
	case wc := <-p.Srv.WCs:
		t.Fatalf("completion without a receive: %+v", wc)
	case <-time.After(200 * time.Millisecond):
	}
	if err := p.Srv.C.PostRecv(&fabric.RecvWR{ID: 3}); err != nil {
		t.Fatal(err)
	}
	if wc := p.Srv.Next(t); wc.ID != 3 || wc.Imm != 1 {
		t.Fatalf("after the receive was posted: %+v", wc)
	}
}

// closeDrains: after Close returns there are no completions and no
// Disconnected, posting fails with ErrClosed, and the peer hears of it
// promptly.
func (c Contract) closeDrains(t *testing.T) {
	p := c.NewPair(t, nil)
	for i := 0; i < 64; i++ {
		p.Srv.C.PostRecv(&fabric.RecvWR{ID: uint64(i)})
	}
	for i := 0; i < 32; i++ {
		p.Cli.C.PostSend(Write(nil, 0, 0, 0, fabric.OpWriteImm, uint32(i)))
	}
	p.Srv.C.Close()
	n := p.Srv.N.Load()
	time.Sleep(100 * time.Millisecond) // a completion that comes late would show
	if p.Srv.N.Load() != n {
		t.Fatal("completions after Close returned")
	}
	select {
	case err := <-p.Srv.Dead:
		t.Fatalf("Disconnected after Close: %v", err)
	default:
	}
	if err := p.Srv.C.PostSend(Write(nil, 0, 0, 0, fabric.OpWriteImm, 0)); !errors.Is(err, fabric.ErrClosed) {
		t.Fatalf("post after close: %v", err)
	}
	t0 := time.Now()
	err := p.Cli.Ended(t)
	if c.PeerGone != nil && !errors.Is(err, c.PeerGone) {
		t.Fatalf("peer: %v, want %v", err, c.PeerGone)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Fatalf("the peer took %v to see the close", d)
	}
}
