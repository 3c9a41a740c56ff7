// The host's TCP as a Network: its socket options (TCP_USER_TIMEOUT,
// TCP_RTO_MAX_MS) and the network to listen on an address with.

package tcp

import (
	"context"
	"net"
	"net/netip"
	"syscall"
	"time"

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
	lc := net.ListenConfig{Control: n.control, KeepAlive: 15 * time.Second}
	network, addr := ListenNetwork(addr)
	return lc.Listen(context.Background(), network, addr.String())
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
