package tcp

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"runtime"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/conntest"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testca"
)

// screened is a listener of f that refuses 127.0.0.3 at accept with the
// private data "later" for as long as refusing says (an hour if nil),
// and that has the kernel drop its SYNs after dropAfter refusals (never
// if 0).
func screened(t *testing.T, f *Fabric, refusing func() time.Duration, dropAfter int) *listener {
	t.Helper()
	l, err := f.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if refusing == nil {
		refusing = func() time.Duration { return time.Hour }
	}
	syn := l.(*listener).nl.(*hostListener).syn
	syn.mu.Lock()
	syn.after = dropAfter
	if dropAfter == 0 {
		syn.after = 1 << 30
	}
	syn.mu.Unlock()
	refused := netip.MustParseAddr("127.0.0.3")
	l.(fabric.Screener).Screen(func(a netip.Addr) time.Duration {
		if a == refused {
			return refusing()
		}
		return 0
	}, []byte("later"))
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
		l := screened(t, f, nil, 0)

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
	l := screened(t, f, nil, 0)
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
	l := screened(t, f, nil, 0)
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

// filterLen is how many instructions the socket program of the socket rc
// is has: 0 without one.
func filterLen(t *testing.T, rc syscall.RawConn) int {
	t.Helper()
	n := -1
	rc.Control(func(fd uintptr) {
		var l uint32 // 0: the kernel says how long the program is
		_, _, e := syscall.RawSyscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_SOCKET, unix.SO_GET_FILTER, 0, uintptr(unsafe.Pointer(&l)), 0)
		if e != 0 {
			t.Fatalf("SO_GET_FILTER: %v", e)
		}
		n = int(l)
	})
	return n
}

// An address the screen keeps refusing has its SYNs dropped by the
// kernel for the rest of its refusal, after synFilterAfter refusals at
// accept: a connect from it then waits (the kernel's SYN
// retransmissions), while another address is accepted as before, and a
// connection accepted meanwhile does not carry the program along. When
// the refusal ends the program goes, and the address is heard again.
func TestSYNFilter(t *testing.T) {
	end := time.Now().Add(time.Second)
	f := New(Options{HandshakeTimeout: 30 * time.Second})
	l := screened(t, f, func() time.Duration { return time.Until(end) }, synFilterAfter)
	hl := l.nl.(*hostListener)
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.3")}, Timeout: 300 * time.Millisecond}
	for i := 0; i < synFilterAfter; i++ {
		c, err := d.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatalf("refused connection %d of %d before its SYNs are dropped: %v", i, synFilterAfter, err)
		}
		c.Close()
	}
	kit.WaitFor(t, 5*time.Second, "the program on the listening socket", func() bool { return filterLen(t, hl.rc) > 0 })
	if c, err := d.Dial("tcp", l.Addr().String()); err == nil {
		c.Close()
		t.Fatal("a connection from the address the kernel drops the SYNs of completed")
	}
	dialed := make(chan error, 1)
	go func() { dialed <- dialFrom(f, "127.0.0.4", l) }()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := l.Accept(ctx)
	if err != nil || r.RemoteAddr().Addr() != netip.MustParseAddr("127.0.0.4") {
		t.Fatalf("Accept: %v, want 127.0.0.4's request", err)
	}
	raw, _ := r.(*connReq).raw.(syscall.Conn).SyscallConn()
	if n := filterLen(t, raw); n != 0 {
		t.Fatalf("a connection accepted beside the program carries %d instructions of it", n)
	}
	r.Reject([]byte("no"))
	var rej *fabric.RejectError
	if err := <-dialed; !errors.As(err, &rej) || string(rej.PrivateData) != "no" {
		t.Fatalf("a dial from another address beside the program: %v, want the listener's reject", err)
	}
	kit.WaitFor(t, 10*time.Second, "the program to go with the refusal", func() bool { return filterLen(t, hl.rc) == 0 })
	from := acceptOne(t, l)
	if err := dialFrom(f, "127.0.0.3", l); !errors.As(err, &rej) || string(rej.PrivateData) != "no" {
		t.Fatalf("a dial from the address once its refusal ended: %v, want the listener's reject", err)
	}
	if a := <-from; a != netip.MustParseAddr("127.0.0.3") {
		t.Fatalf("Accept handed out a request from %v, want 127.0.0.3's", a)
	}
}

// A host listener closed while it waits for a connection returns
// net.ErrClosed, as Go's listeners do: the accept loop ends on it.
func TestHostListenerClosed(t *testing.T) {
	nl, err := tcpNetwork{}.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error)
	go func() {
		_, err := nl.Accept()
		done <- err
	}()
	kit.WaitBlocked(t, 5*time.Second, "hostListener).acceptScreened", "IO wait")
	nl.Close()
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept on a listener closed meanwhile: %v, want net.ErrClosed", err)
	}
}
