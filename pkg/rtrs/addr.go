package rtrs

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// PathAddr is the source and destination of a path. Src may be unset, in
// which case the fabric picks the source and the path learns it on connect.
type PathAddr struct {
	Src netip.AddrPort
	Dst netip.AddrPort
	// GID marks addresses given as "gid:" (AF_IB); only RDMA can use them.
	GID bool
}

// ErrBadAddr is returned for an address the kernel's grammar does not accept.
var ErrBadAddr = errors.New("rtrs: bad path address")

// ParseAddr parses one address the way rtrs_str_to_sockaddr does:
// "ip:<ipv4>", "ip:<ipv6>[%scope]" or "gid:<gid>".
func ParseAddr(s string, port uint16) (netip.AddrPort, bool, error) {
	var gid bool
	switch {
	case strings.HasPrefix(s, "ip:"):
		s = s[3:]
	case strings.HasPrefix(s, "gid:"):
		s, gid = s[4:], true
	default:
		return netip.AddrPort{}, false, fmt.Errorf("%w %q: want ip:<addr> or gid:<gid>", ErrBadAddr, s)
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.AddrPort{}, false, fmt.Errorf("%w %q: %v", ErrBadAddr, s, err)
	}
	if gid && (!a.Is6() || a.Zone() != "") {
		return netip.AddrPort{}, false, fmt.Errorf("%w: gid %q is not a GID", ErrBadAddr, s)
	}
	return netip.AddrPortFrom(a, port), gid, nil
}

// ParsePathAddr parses "[src(,|@)]dst" as rtrs_addr_to_sockaddr does; a
// single address is the destination, reached at port.
func ParsePathAddr(s string, port uint16) (PathAddr, error) {
	var p PathAddr
	i := strings.IndexByte(s, ',')
	if i < 0 {
		i = strings.IndexByte(s, '@')
	}
	dst := s
	if i >= 0 {
		src, gid, err := ParseAddr(s[:i], 0)
		if err != nil {
			return PathAddr{}, err
		}
		p.Src, p.GID = src, gid
		dst = s[i+1:]
	}
	d, gid, err := ParseAddr(dst, port)
	if err != nil {
		return PathAddr{}, err
	}
	if i >= 0 && gid != p.GID {
		return PathAddr{}, fmt.Errorf("%w %q: source and destination of different kinds", ErrBadAddr, s)
	}
	p.Dst, p.GID = d, gid
	return p, nil
}

// FormatAddr prints an address as the kernel's sockaddr_to_str does:
// "ip:1.2.3.4", "ip:fe80::1" (no scope), "gid:fe80:0000:...".
func FormatAddr(a netip.Addr, gid bool) string {
	if !a.IsValid() {
		return "<invalid address family>"
	}
	if gid {
		b := a.As16()
		return fmt.Sprintf("gid:%x:%x:%x:%x:%x:%x:%x:%x",
			[]byte{b[0], b[1]}, []byte{b[2], b[3]}, []byte{b[4], b[5]}, []byte{b[6], b[7]},
			[]byte{b[8], b[9]}, []byte{b[10], b[11]}, []byte{b[12], b[13]}, []byte{b[14], b[15]})
	}
	return "ip:" + a.Unmap().WithZone("").String()
}

// String is the path's name, "src@dst", as in /sys/class/rtrs-client/<sess>/paths/;
// while the source is not set (not given, and not connected yet: the
// kernel prints "<invalid address family>" there) the destination alone,
// as the path was given.
func (p PathAddr) String() string {
	if !p.Src.Addr().IsValid() {
		return FormatAddr(p.Dst.Addr(), p.GID)
	}
	return FormatAddr(p.Src.Addr(), p.GID) + "@" + FormatAddr(p.Dst.Addr(), p.GID)
}

// sysfsName is the name the kernel's rtrs_addr_to_str gives the path,
// "<invalid address family>" for a source not set: what path UUIDs
// were derived from, which must not change (derivePathUUID).
func (p PathAddr) sysfsName() string {
	return FormatAddr(p.Src.Addr(), p.GID) + "@" + FormatAddr(p.Dst.Addr(), p.GID)
}

// MatchPathName reports whether name, as someone typed it, names the
// path between the addresses first and second ("src@dst" of a client
// path, "client@server" of a server's): its name ("ip:A@ip:B"), the
// same without the "ip:" prefixes ("A@B"), or one address of the two,
// with or without "ip:". Callers look for the exact name first.
func MatchPathName(name string, first, second netip.Addr) bool {
	addr := func(s string) (netip.Addr, bool) {
		a, err := netip.ParseAddr(strings.TrimPrefix(s, "ip:"))
		return a.Unmap().WithZone(""), err == nil
	}
	same := func(a, b netip.Addr) bool { return b.IsValid() && a == b.Unmap().WithZone("") }
	if x, y, two := strings.Cut(name, "@"); two {
		a, okA := addr(x)
		b, okB := addr(y)
		return okA && okB && same(a, first) && same(b, second)
	}
	a, ok := addr(name)
	return ok && (same(a, first) || same(a, second))
}

// ParseListenAddr parses a TCP listen address "tcp://HOST[:PORT]" (HOST
// may be a bracketed IPv6 address); the port defaults to DefaultPort.
func ParseListenAddr(s string) (netip.AddrPort, error) {
	l, err := ParseListen(s)
	if err == nil && l.Transport != "tcp" {
		err = fmt.Errorf("%w %q: want tcp://HOST[:PORT]", ErrBadAddr, s)
	}
	return l.Addr, err
}

// Listen is a listen address and its transport.
type Listen struct {
	Transport string // "tcp" or "rdma"
	Addr      netip.AddrPort
}

func (l Listen) String() string { return l.Transport + "://" + l.Addr.String() }

// ParseListen parses "tcp://HOST[:PORT]" or "rdma://HOST[:PORT]" (HOST may
// be a bracketed IPv6 address); the port defaults to DefaultPort. RDMA
// ports are rdma_cm's (its TCP port space), apart from the kernel's TCP
// ports: both transports may listen on the same number.
func ParseListen(s string) (Listen, error) {
	var l Listen
	tr, rest, ok := strings.Cut(s, "://")
	if !ok || (tr != "tcp" && tr != "rdma") {
		return l, fmt.Errorf("%w %q: want tcp://HOST[:PORT] or rdma://HOST[:PORT]", ErrBadAddr, s)
	}
	l.Transport = tr
	if ap, err := netip.ParseAddrPort(rest); err == nil {
		l.Addr = ap
		return l, nil
	}
	// HOST:PORT with a port netip refuses: say what is wrong with it,
	// not with the address it then is not ("unexpected character").
	if h, p, err := net.SplitHostPort(rest); err == nil {
		if _, aerr := netip.ParseAddr(h); aerr == nil {
			n, perr := strconv.ParseUint(p, 10, 64)
			switch {
			case perr != nil && errors.Is(perr, strconv.ErrRange), perr == nil && n > 65535:
				return l, fmt.Errorf("%w %q: port %s is out of range: want 1 to 65535", ErrBadAddr, s, p)
			case perr != nil:
				return l, fmt.Errorf("%w %q: port %q is not a number", ErrBadAddr, s, p)
			}
		}
	}
	host := strings.TrimSuffix(strings.TrimPrefix(rest, "["), "]")
	a, err := netip.ParseAddr(host)
	if err != nil {
		return l, fmt.Errorf("%w %q: %v", ErrBadAddr, s, err)
	}
	l.Addr = netip.AddrPortFrom(a, DefaultPort)
	return l, nil
}
