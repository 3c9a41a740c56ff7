// The host's TCP as a Network: its socket options (TCP_USER_TIMEOUT,
// TCP_RTO_MAX_MS), the network to listen on an address with, and the
// listener that refuses a connection as it accepts it.

package tcp

import (
	"context"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// tcpNetwork is the host's TCP.
type tcpNetwork struct {
	userTimeout time.Duration
}

// tcpRTOMaxMS is TCP_RTO_MAX_MS (Linux 6.11): the socket's largest
// retransmission timeout, 1000 ms at least.
const tcpRTOMaxMS = 44

func (n tcpNetwork) control(network, address string, c syscall.RawConn) error {
	var serr error
	if n.userTimeout < 0 {
		return nil // the kernel's retransmission limits, minutes
	}
	err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(n.userTimeout/time.Millisecond))
		// TCP_USER_TIMEOUT is checked when a retransmission is due, and
		// the first one is due after the retransmission timeout, which
		// one slow round trip (a busy moment) can raise past a second:
		// then a silent loss took two user timeouts, not one. Bounding
		// the timeout keeps it to about one. Older kernels do without.
		unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, tcpRTOMaxMS, int(max(n.userTimeout, time.Second)/time.Millisecond))
	})
	if err != nil {
		return err
	}
	return serr
}

func (n tcpNetwork) Dial(ctx context.Context, src, dst netip.AddrPort) (net.Conn, error) {
	d := net.Dialer{Control: n.control, KeepAlive: 15 * time.Second}
	if src.Addr().IsValid() {
		d.LocalAddr = &net.TCPAddr{IP: src.Addr().AsSlice(), Port: int(src.Port()), Zone: src.Addr().Zone()}
	}
	return d.DialContext(ctx, "tcp", dst.String())
}

func (n tcpNetwork) Listen(addr netip.AddrPort) (net.Listener, error) {
	lc := net.ListenConfig{Control: n.control}
	network, addr := ListenNetwork(addr)
	nl, err := lc.Listen(context.Background(), network, addr.String())
	if err != nil {
		return nil, err
	}
	// The socket as a file in the poller, whose RawConn can wait for
	// connections (a net.Listener's cannot): accept4 by hand.
	tl := nl.(*net.TCPListener)
	f, err := tl.File()
	tl.Close() // f holds the socket
	if err != nil {
		return nil, err
	}
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	hl := &hostListener{f: f, rc: rc, addr: tl.Addr(), syn: newSYNFilter(rc)}
	hl.acceptFn = hl.acceptOne
	return hl, nil
}

// hostListener is a listener of the host's TCP that can refuse a
// connection as it accepts it (acceptScreened): a refused connection
// costs the accept, a write of the answer and a close, with no goroutine,
// no poller registration and no allocation, however fast a peer makes
// them. What the kernel spent on it before (the SYN, the handshake, the
// place in the listen backlog) is spent; the accept loop that drains
// the backlog this fast keeps it from filling up, which would drop the
// SYNs of every peer alike. A peer that keeps coming while refused has
// its SYNs dropped by the kernel for the rest of its refusal (synFilter):
// then it costs nothing more.
type hostListener struct {
	f    *os.File // the listening socket
	rc   syscall.RawConn
	addr net.Addr
	syn  *synFilter
	// closed: Close was called (the file's error on a closed
	// descriptor is its own, not net.ErrClosed).
	closed atomic.Bool
	// The accept under way: only the listener's accept loop touches
	// them. acceptFn is acceptOne, made once.
	acceptFn func(fd uintptr) bool
	sc       *screen
	fd       int
	err      error
}

func (hl *hostListener) Addr() net.Addr { return hl.addr }

// Close closes the socket; an accept waiting returns an error.
func (hl *hostListener) Close() error {
	hl.closed.Store(true)
	hl.syn.close()
	return hl.f.Close()
}

// Accept returns the next connection.
func (hl *hostListener) Accept() (net.Conn, error) { return hl.acceptScreened(nil) }

// acceptScreened returns the next connection sc (if not nil) does not
// refuse. It is a TCPConn with TCP_NODELAY and keep-alives every 15 s,
// as Go's Accept makes them.
func (hl *hostListener) acceptScreened(sc *screen) (net.Conn, error) {
	hl.sc, hl.fd, hl.err = sc, -1, nil
	err := hl.rc.Read(hl.acceptFn)
	if err == nil {
		err = hl.err
	}
	if err != nil {
		if hl.closed.Load() {
			err = net.ErrClosed
		}
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: hl.addr, Err: err}
	}
	// A net.Conn of its own descriptor: FileConn duplicates it, puts it
	// in the poller and sets TCP_NODELAY and the keep-alives.
	f := os.NewFile(uintptr(hl.fd), "")
	nc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: hl.addr, Err: err}
	}
	return nc, nil
}

// acceptOne accepts from the listening socket lfd until a connection sc
// lets through (true, in hl.fd) or an error (true, in hl.err); refused
// ones are answered and closed here. With none waiting it returns false:
// RawConn.Read waits for the next.
func (hl *hostListener) acceptOne(lfd uintptr) bool {
	for {
		var sa unix.RawSockaddrAny
		n := uint32(unix.SizeofSockaddrAny)
		// Blocking (no SOCK_NONBLOCK): os.NewFile then leaves it out of
		// the poller, which FileConn's duplicate joins.
		fd, _, e := syscall.RawSyscall6(unix.SYS_ACCEPT4, lfd, uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&n)),
			unix.SOCK_CLOEXEC, 0, 0)
		switch e {
		case 0:
		case unix.EAGAIN:
			return false
		case unix.EINTR, unix.ECONNABORTED:
			continue // the peer gave up while it waited: the next
		default:
			hl.err = os.NewSyscallError("accept4", e)
			return true
		}
		if hl.sc != nil {
			a := sockaddrAddr(&sa)
			if d := hl.sc.refuse(a); d > 0 {
				// The answer fits an empty socket buffer: the write
				// never waits (MSG_DONTWAIT all the same), and what is
				// not taken is lost with the connection, as a reset
				// would.
				frame := hl.sc.frame
				syscall.RawSyscall6(unix.SYS_SENDTO, fd, uintptr(unsafe.Pointer(&frame[0])), uintptr(len(frame)),
					unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL, 0, 0)
				syscall.RawSyscall(unix.SYS_CLOSE, fd, 0, 0)
				hl.syn.refused(a, d)
				continue
			}
		}
		hl.syn.detach(fd)
		hl.fd = int(fd)
		return true
	}
}

// sockaddrAddr is the address of an IPv4 or IPv6 socket address; the
// zero Addr for another family.
func sockaddrAddr(sa *unix.RawSockaddrAny) netip.Addr {
	switch sa.Addr.Family {
	case unix.AF_INET:
		return netip.AddrFrom4((*unix.RawSockaddrInet4)(unsafe.Pointer(sa)).Addr)
	case unix.AF_INET6:
		return netip.AddrFrom16((*unix.RawSockaddrInet6)(unsafe.Pointer(sa)).Addr)
	}
	return netip.Addr{}
}

// ListenNetwork is the network to listen on addr with: "tcp4" for an
// IPv4 address (0.0.0.0 is every IPv4 address and no IPv6 one, where
// Go's "tcp" would listen on [::], both families), "tcp" for an IPv6 one
// ([::] both, as Go and the kernel's bindv6only=0 make it). An IPv4
// address written as IPv6 (::ffff:a.b.c.d) is the IPv4 one.
func ListenNetwork(addr netip.AddrPort) (string, netip.AddrPort) {
	if a := addr.Addr().Unmap(); a.Is4() {
		return "tcp4", netip.AddrPortFrom(a, addr.Port())
	}
	return "tcp", addr
}
