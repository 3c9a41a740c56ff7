// Tests of closing: Server.Close and RemoveExport with requests in
// flight, during a handshake, and on the kernel's connections.

package nbd

import (
	"bufio"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/pkg/log"
)

// TestCloseInFlight: Server.Close waits for requests in flight, returns
// once the backend finishes them and leaves no goroutine behind.
func TestCloseInFlight(t *testing.T) {
	for _, tc := range []struct {
		name     string
		inflight int
		partial  bool // a write's payload is cut short
	}{
		{"held", 128, false},
		{"reader-waits-for-a-slot", 4, false},
		{"reader-in-payload", 128, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hb := newHold(1 << 20)
			s, addr := startServer(t, Options{MaxInflight: tc.inflight}, &Export{Name: "a", Size: 1 << 20, Backend: hb},
				&Export{Name: "b", Size: 1 << 20, Backend: newStore(1 << 20)})
			c := connect(t, addr, "a")
			other := connect(t, addr, "b")
			other.mustRead(0, 512)
			const n = 8
			var reqs []byte
			for i := range n {
				reqs = appendRequest(reqs, uint16(CmdRead), 0, uint64(i), uint64(i)*4096, 4096, nil)
			}
			if tc.partial {
				reqs = appendRequest(reqs, uint16(CmdWrite), 0, 99, 0, 8192, make([]byte, 100))
			}
			c.write(reqs)
			hs := hb.take(t, min(n, tc.inflight))
			if na, nb := s.Conns("a"), s.Conns("b"); na != 1 || nb != 1 {
				t.Fatalf("Conns: %d %d", na, nb)
			}

			closed := make(chan struct{})
			go func() {
				s.Close()
				close(closed)
			}()
			// The connections end at once (their requests are still held,
			// so no reply is on its way).
			c.expectClosed()
			other.expectClosed()
			select {
			case <-closed:
				t.Fatal("Close returned with requests in flight")
			default:
			}
			for _, h := range hs {
				hb.finish(h)
			}
			select {
			case <-closed:
			case <-time.After(testTimeout):
				t.Fatal("Close did not return")
			}
			if na, nb := s.Conns("a"), s.Conns("b"); na != 0 || nb != 0 {
				t.Fatalf("Conns after Close: %d %d", na, nb)
			}
			if len(hb.ch) != 0 {
				t.Fatalf("%d requests submitted after Close", len(hb.ch))
			}
			goleak.VerifyNone(t)
		})
	}
}

func TestRemoveExport(t *testing.T) {
	hb := newHold(1 << 20)
	s, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: hb},
		&Export{Name: "b", Size: 1 << 20, Backend: newStore(1 << 20)})
	a, b := connect(t, addr, "a"), connect(t, addr, "b")
	a.send(uint16(CmdRead), 0, 1, 0, 512, nil)
	hs := hb.take(t, 1)
	removed := make(chan error, 1)
	go func() { removed <- s.RemoveExport("a") }()
	a.expectClosed()
	hb.finish(hs[0])
	select {
	case err := <-removed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(testTimeout):
		t.Fatal("RemoveExport did not return")
	}
	if n := s.Conns("a"); n != 0 {
		t.Fatalf("Conns(a) = %d", n)
	}
	b.mustRead(0, 512) // and so b is in transmission
	if n := s.Conns("b"); n != 1 {
		t.Fatalf("Conns(b) = %d", n)
	}
	if err := s.RemoveExport("a"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("RemoveExport again: %v", err)
	}
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	if reps := c.option(optGo, goData("a")); final(reps) != repErrUnknown {
		t.Fatalf("OPT_GO of a removed export: %#x", final(reps))
	}
}

// TestCloseDuringHandshake: Close must not wait for a client that is in
// the middle of the handshake (it used to, for the 30 s handshake timeout).
func TestCloseDuringHandshake(t *testing.T) {
	s, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.readFull(18) // the greeting; then silence
	closed := make(chan struct{})
	go func() {
		s.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Error("Close did not return within 5s while a client was in the handshake")
		<-closed
	}
	c.expectClosed()
}

// TestCloseWaitsForServeKernel: Close says it waits, and the kernel's
// connections (ServeKernel) have requests in flight like any other; the
// client daemon closes its backends right after Close.
func TestCloseWaitsForServeKernel(t *testing.T) {
	hb := newHold(1 << 20)
	s := NewServer(Options{Log: log.Discard()})
	if err := s.AddExport(&Export{Name: "a", Size: 1 << 20, Backend: hb}); err != nil {
		t.Fatal(err)
	}
	cli, srv := net.Pipe()
	defer cli.Close()
	served := make(chan struct{})
	go func() {
		defer close(served)
		s.ServeKernel(srv, "a")
	}()
	c := &client{tb: t, nc: cli, br: bufio.NewReader(cli)}
	cli.SetDeadline(time.Now().Add(testTimeout))
	c.send(uint16(CmdRead), 0, 1, 0, 512, nil)
	h := hb.take(t, 1)[0]
	closed := make(chan struct{})
	go func() {
		s.Close()
		close(closed)
	}()
	c.expectClosed()
	select {
	case <-closed:
		t.Error("Close returned while a ServeKernel connection had a request in flight")
	case <-time.After(time.Second): // a bound, not a synchronisation
	}
	hb.finish(h)
	for _, ch := range []chan struct{}{closed, served} {
		select {
		case <-ch:
		case <-time.After(testTimeout):
			t.Fatal("Close or ServeKernel did not return")
		}
	}
}
