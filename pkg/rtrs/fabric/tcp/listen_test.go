package tcp

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"
)

// hasIPv6Loopback reports whether ::1 can be listened on here.
func hasIPv6Loopback() bool {
	l, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// TestListenIPv4WildcardIsIPv4Only: 0.0.0.0 is every IPv4 address, not
// (as Go's "tcp" would make it) both families: a dial to ::1 on its port
// is refused, and the listener says 0.0.0.0. [::] takes both and says
// [::].
func TestListenIPv4WildcardIsIPv4Only(t *testing.T) {
	if !hasIPv6Loopback() {
		t.Skip("no IPv6 loopback on this host")
	}
	f := New(Options{})
	l, err := f.Listen(netip.MustParseAddrPort("0.0.0.0:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	port := l.Addr().Port()
	if got := l.Addr().Addr(); got != netip.IPv4Unspecified() {
		t.Errorf("listening on 0.0.0.0 reports %v", l.Addr())
	}
	dial := func(network string, a netip.AddrPort) error {
		c, err := net.DialTimeout(network, a.String(), 5*time.Second)
		if err == nil {
			c.Close()
		}
		return err
	}
	if err := dial("tcp4", netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port)); err != nil {
		t.Errorf("IPv4 loopback to 0.0.0.0: %v", err)
	}
	if err := dial("tcp6", netip.AddrPortFrom(netip.IPv6Loopback(), port)); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("IPv6 loopback to a listener on 0.0.0.0: %v, want ECONNREFUSED", err)
	}

	both, err := f.Listen(netip.MustParseAddrPort("[::]:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer both.Close()
	if got := both.Addr().Addr(); got != netip.IPv6Unspecified() {
		t.Errorf("listening on [::] reports %v", both.Addr())
	}
	for _, a := range []string{"127.0.0.1", "::1"} {
		if err := dial("tcp", netip.AddrPortFrom(netip.MustParseAddr(a), both.Addr().Port())); err != nil {
			t.Errorf("%s to a listener on [::]: %v", a, err)
		}
	}
}
