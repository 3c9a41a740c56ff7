// Tests of the listeners: a listener limited to one export, exports that
// share a name, and accepts that fail for a while or for good.

package nbd

import (
	"bytes"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
)

// TestServeExport: a listener limited to one export lists only it, opens
// it by its name or the default name, and opens no other, by any option.
func TestServeExport(t *testing.T) {
	s := NewServer(Options{Log: log.Discard()})
	for _, name := range []string{"mine", "other"} {
		if err := s.AddExport(&Export{Name: name, Size: 1 << 20, Backend: newStore(1 << 20)}); err != nil {
			t.Fatal(err)
		}
	}
	addr := serveOn(t, s, func(l net.Listener) error { return s.ServeExport(l, "mine") })
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	reps := c.option(optList, nil)
	if len(reps) != 2 || reps[0].typ != repServer || string(reps[0].data[4:]) != "mine" || final(reps) != repAck {
		t.Fatalf("OPT_LIST on a socket of one export: %+v", reps)
	}
	for _, opt := range []uint32{optInfo, optGo} {
		if reps := c.option(opt, goData("other", infoBlockSize)); len(reps) != 1 || reps[0].typ != repErrUnknown {
			t.Fatalf("option %d of another export: %+v", opt, reps)
		}
	}
	// The default name is this socket's export, though the server has two.
	c.optGo("")
	if !bytes.Equal(c.mustRead(0, 512), pattern(0, 512)) {
		t.Fatal("wrong data")
	}
	c = connect(t, addr, "mine")
	c.mustRead(0, 512)
	c = dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	c.sendOpt(optExportName, []byte("other"))
	c.expectClosed()
}

// failingListener fails its first n accepts with EMFILE.
type failingListener struct {
	net.Listener
	mu sync.Mutex
	// +checklocks:mu
	n int
}

func (l *failingListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	fail := l.n > 0
	l.n--
	l.mu.Unlock()
	if fail {
		return nil, &net.OpError{Op: "accept", Net: "unix", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	return l.Listener.Accept()
}

// TestAcceptRetry: an accept that fails (out of descriptors) does not end
// the socket's service: it accepts again, and serves.
func TestAcceptRetry(t *testing.T) {
	s := NewServer(Options{Log: log.Discard()})
	if err := s.AddExport(&Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	addr := serveOn(t, s, func(l net.Listener) error { return s.ServeExport(&failingListener{Listener: l, n: 3}, "a") })
	c := connect(t, addr, "a")
	if !bytes.Equal(c.mustRead(0, 512), pattern(0, 512)) {
		t.Fatal("wrong data")
	}
}

// TestExportIDs: exports may share a name under different IDs; each
// listener limited to one serves that one under the shared name, and a
// listener of every export refuses the name as ambiguous.
func TestExportIDs(t *testing.T) {
	s := NewServer(Options{Log: log.Discard()})
	stores := map[string]*storeBackend{"a": newStore(1 << 20), "b": newStore(1 << 20)}
	copy(stores["b"].data, bytes.Repeat([]byte{0xbb}, 4096)) // +checklocksignore: not shared yet
	for id, st := range stores {
		if err := s.AddExport(&Export{ID: id, Name: "vol", Size: 1 << 20, Backend: st}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.AddExport(&Export{ID: "a", Name: "other", Size: 1 << 20, Backend: newStore(1 << 20)}); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("a second export of ID a: %v, want EEXIST", err)
	}
	la := serveOn(t, s, func(l net.Listener) error { return s.ServeExport(l, "a") })
	lb := serveOn(t, s, func(l net.Listener) error { return s.ServeExport(l, "b") })
	all := serveOn(t, s, s.Serve)
	if got := connect(t, la, "vol").mustRead(0, 4096); !bytes.Equal(got, pattern(0, 4096)) {
		t.Fatal("a's socket: not a's data")
	}
	cb := connect(t, lb, "vol")
	if got := cb.mustRead(0, 4096); !bytes.Equal(got, bytes.Repeat([]byte{0xbb}, 4096)) {
		t.Fatal("b's socket: not b's data")
	}
	if n := s.Conns("b"); n != 1 {
		t.Fatalf("Conns(b) = %d", n)
	}
	c := dial(t, all)
	c.greet(cflagFixedNew | cflagNoZeroes)
	if reps := c.option(optGo, goData("vol")); len(reps) != 1 || reps[0].typ != repErrUnknown {
		t.Fatalf("OPT_GO of a name two exports share, on the socket of every export: %+v", reps)
	}
	if err := s.RemoveExport("b"); err != nil {
		t.Fatal(err)
	}
	cb.expectClosed()
	if got := connect(t, all, "vol").mustRead(0, 4096); !bytes.Equal(got, pattern(0, 4096)) {
		t.Fatal("the name left to one export does not open it")
	}
}

// brokenListener fails every accept with EINVAL, as a socket shut down.
type brokenListener struct{ net.Listener }

func (brokenListener) Accept() (net.Conn, error) {
	return nil, &net.OpError{Op: "accept", Net: "unix", Err: os.NewSyscallError("accept4", syscall.EINVAL)}
}

// TestAcceptBroken: an accept error that no retry cures ends Serve with
// it, rather than a retry every second for ever.
func TestAcceptBroken(t *testing.T) {
	s := NewServer(Options{Log: log.Discard()})
	defer s.Close()
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	done := make(chan error, 1)
	go func() { done <- s.Serve(brokenListener{l}) }()
	select {
	case err := <-done:
		if !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("Serve: %v, want EINVAL", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Serve retries an accept error that does not go away")
	}
}
