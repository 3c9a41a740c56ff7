package tcp

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/conntest"
	"github.com/rnbd/rnbd/test/testca"
)

// screened is a listener of f that refuses 127.0.0.3 at accept with the
// private data "later".
func screened(t *testing.T, f *Fabric) *listener {
	t.Helper()
	l, err := f.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	refused := netip.MustParseAddr("127.0.0.3")
	l.(fabric.Screener).Screen(func(a netip.Addr) bool { return a == refused }, []byte("later"))
	// The accept loop takes the screen with its next accept: let one
	// connection through to be sure it has.
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	return l.(*listener)
}

// dialFrom dials l with f from src, sending "hi", and returns the error
// (nil if l accepted: no listener here does).
func dialFrom(f *Fabric, src string, l fabric.Listener) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s := netip.AddrPortFrom(netip.MustParseAddr(src), 0)
	dev, err := f.Resolve(ctx, s, l.Addr())
	if err != nil {
		return err
	}
	pdv, _ := dev.AllocPD()
	c, _, err := dev.Dial(ctx, fabric.DialParams{Src: s, Dst: l.Addr(), PD: pdv, PrivateData: []byte("hi"),
		Attr: fabric.ConnAttr{Handler: conntest.NewRecorder(), MaxSendWR: 4, MaxRecvWR: 4}})
	if err == nil {
		c.Close()
	}
	return err
}

// acceptOne rejects the next request of l with "no" and returns where it
// came from.
func acceptOne(t *testing.T, l fabric.Listener) <-chan netip.Addr {
	from := make(chan netip.Addr, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		r, err := l.Accept(ctx)
		if err != nil {
			from <- netip.Addr{}
			return
		}
		from <- r.RemoteAddr().Addr()
		r.Reject([]byte("no"))
	}()
	return from
}

// A Screener's refused peer is answered as it is accepted, before any
// read: a connection that sends nothing gets the REJ at once (an
// unscreened one would wait for its request, then its handshake timeout),
// a dialer gets a RejectError with the screen's private data, in TLS as
// well (the answer comes before TLS, and the dialer reads it), and none
// of them reaches Accept, which hands out the next peer's request.
func TestScreenRefusesAtAccept(t *testing.T) {
	for _, withTLS := range []bool{false, true} {
		opts := Options{HandshakeTimeout: 30 * time.Second}
		if withTLS {
			ca := testca.New(t, "test ca")
			opts.TLS = ca.Config(ca.Issue(t, "node", "127.0.0.1"))
		}
		f := New(opts)
		l := screened(t, f)

		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.3")}}
		c, err := d.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		typ, priv, err := readHandshake(c)
		if err != nil || typ != hsREJ || string(priv) != "later" {
			t.Fatalf("TLS %v: a refused connection that sent nothing read %d %q %v, want a REJ with \"later\" at once", withTLS, typ, priv, err)
		}
		if _, err := c.Read(make([]byte, 1)); err == nil {
			t.Fatalf("TLS %v: the refused connection stays open", withTLS)
		}
		c.Close()

		from := acceptOne(t, l)
		var rej *fabric.RejectError
		if err := dialFrom(f, "127.0.0.3", l); !errors.As(err, &rej) || string(rej.PrivateData) != "later" {
			t.Fatalf("TLS %v: a dial from the refused address: %v, want a RejectError with \"later\"", withTLS, err)
		}
		if err := dialFrom(f, "127.0.0.4", l); !errors.As(err, &rej) || string(rej.PrivateData) != "no" {
			t.Fatalf("TLS %v: a dial from another address: %v, want the listener's reject", withTLS, err)
		}
		if a := <-from; a != netip.MustParseAddr("127.0.0.4") {
			t.Fatalf("TLS %v: Accept handed out a request from %v, want only 127.0.0.4's", withTLS, a)
		}
	}
}

// Refused connections cost the listener no goroutine and keep no slot,
// however many a peer holds open, and a peer from another address is
// accepted meanwhile.
func TestScreenRefusedHoldNothing(t *testing.T) {
	f := New(Options{HandshakeTimeout: 30 * time.Second, MaxHandshakesPerAddr: 4, MaxHandshakes: 8})
	l := screened(t, f)
	before := runtime.NumGoroutine()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.3")}}
	for i := 0; i < 200; i++ {
		c, err := d.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close() // open until the end, never read
	}
	from := acceptOne(t, l)
	if err := dialFrom(f, "127.0.0.4", l); err == nil || errors.Is(err, io.EOF) {
		t.Fatalf("a dial from another address beside 200 refused connections: %v, want the listener's reject", err)
	}
	if a := <-from; a != netip.MustParseAddr("127.0.0.4") {
		t.Fatalf("Accept handed out a request from %v, want 127.0.0.4's", a)
	}
	if n := runtime.NumGoroutine(); n > before+4 {
		t.Fatalf("%d goroutines with 200 refused connections open, %d before", n, before)
	}
	l.perAddrMu.Lock()
	shaking := len(l.shaking)
	l.perAddrMu.Unlock()
	if shaking != 0 {
		t.Fatalf("%d handshake slots taken by refused connections", shaking)
	}
}

// A refused connection allocates nothing in the listener: an accept, a
// write and a close. The peer here makes its connections with system
// calls alone, so that what is counted is the listener's.
func TestScreenRefusalAllocatesNothing(t *testing.T) {
	f := New(Options{})
	l := screened(t, f)
	dst := &unix.SockaddrInet4{Port: int(l.Addr().Port()), Addr: [4]byte{127, 0, 0, 1}}
	src := &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 3}}
	buf := make([]byte, 64)
	refused := func() {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		if err := unix.Bind(fd, src); err != nil {
			t.Fatal(err)
		}
		if err := unix.Connect(fd, dst); err != nil {
			t.Fatal(err)
		}
		if n, err := unix.Read(fd, buf); err != nil || n != hsHdrSize+len("later") || buf[8] != hsREJ {
			t.Fatalf("read %d bytes (%v), want the REJ", n, err)
		}
	}
	refused() // the first in a while may wake things that allocate once
	if n := testing.AllocsPerRun(200, refused); n != 0 {
		t.Fatalf("%v allocations a refused connection, want 0", n)
	}
}
