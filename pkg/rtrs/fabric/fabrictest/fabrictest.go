// Package fabrictest provides an in-memory fabric for hermetic tests: the
// TCP fabric's emulation of RC queue pairs running over in-memory pipes
// instead of sockets, with fault injection per link. A link is the wire
// between two IP addresses; it can be cut (connections reset), taken down
// (reset, and new connections refused) or blackholed (data silently stops
// flowing, as when a cable is pulled, until the link is restored).
//
// Everything is built from channels and goroutines, so tests may run inside
// a testing/synctest bubble and let heartbeats and reconnect timers run on
// the bubble's fake clock.
//
// Which fields each lock guards, and which functions run with it held,
// are +checklocks annotations, checked by gVisor's checklocks analyzer
// in make vet.
package fabrictest

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// LinkState is the state of the wire between two addresses.
type LinkState int

const (
	// LinkUp passes data.
	LinkUp LinkState = iota
	// LinkBlackhole drops nothing but delivers nothing: writes block and
	// new connections hang, until the link is up again.
	LinkBlackhole
	// LinkDown refuses new connections; existing ones were reset.
	LinkDown
)

// Network is an in-memory network. It is safe for concurrent use.
type Network struct {
	mu sync.Mutex
	// +checklocks:mu
	listeners map[netip.AddrPort]*listener
	// +checklocks:mu
	links map[linkKey]*link
	// +checklocks:mu
	nextPort uint16
}

type linkKey struct{ a, b netip.Addr }

func key(a, b netip.Addr) linkKey {
	if b.Less(a) {
		a, b = b, a
	}
	return linkKey{a, b}
}

// link tracks one wire's state and the connections over it.
type link struct {
	state   LinkState
	changed chan struct{} // closed and replaced on every state change
	conns   map[*conn]struct{}
}

// NewNetwork returns an empty network.
func NewNetwork() *Network {
	return &Network{
		listeners: make(map[netip.AddrPort]*listener),
		links:     make(map[linkKey]*link),
		nextPort:  40000,
	}
}

// Fabric returns a fabric running on this network.
func (n *Network) Fabric() *tcp.Fabric { return n.FabricWith(tcp.Options{}) }

// FabricWith returns a fabric running on this network with opts (TLS,
// handshake limits).
func (n *Network) FabricWith(opts tcp.Options) *tcp.Fabric {
	opts.Network, opts.Name = n, "mem"
	return tcp.New(opts)
}

// linkLocked is the link between a and b, made on first use.
// +checklocks:n.mu
func (n *Network) linkLocked(a, b netip.Addr) *link {
	k := key(a, b)
	l := n.links[k]
	if l == nil {
		l = &link{changed: make(chan struct{}), conns: make(map[*conn]struct{})}
		n.links[k] = l
	}
	return l
}

// SetLink changes the wire between a and b. LinkDown resets every
// connection over it; LinkBlackhole freezes them; LinkUp releases them.
func (n *Network) SetLink(a, b netip.Addr, st LinkState) {
	n.mu.Lock()
	l := n.linkLocked(a, b)
	l.state = st
	close(l.changed)
	l.changed = make(chan struct{})
	var reset []*conn
	if st == LinkDown {
		for c := range l.conns {
			reset = append(reset, c)
		}
	}
	n.mu.Unlock()
	for _, c := range reset {
		c.Conn.Close()
	}
}

// Cut resets every connection between a and b and leaves the link up.
func (n *Network) Cut(a, b netip.Addr) {
	n.mu.Lock()
	l := n.linkLocked(a, b)
	var reset []*conn
	for c := range l.conns {
		reset = append(reset, c)
	}
	n.mu.Unlock()
	for _, c := range reset {
		c.Conn.Close()
	}
}

// Crash makes the host at a vanish silently, as when a machine loses
// power: its ends of every connection fail at once, but their peers are
// told nothing and only notice by their own timeouts (a write to it
// blocks, a read waits). New connections from a work as before: the host
// has rebooted.
func (n *Network) Crash(a netip.Addr) {
	n.mu.Lock()
	var dead []*conn
	for _, l := range n.links {
		for c := range l.conns {
			if c.local.Addr() == a {
				dead = append(dead, c)
				delete(l.conns, c)
			}
		}
	}
	n.mu.Unlock()
	// Every end is marked before any fails: a failing end makes its
	// owner close the others, and those closes must not reach the peer.
	for _, c := range dead {
		c.crashed.Store(true)
	}
	for _, c := range dead {
		c.Conn.SetDeadline(time.Now()) // its own reads and writes fail
	}
}

// Conns returns how many connections exist between a and b.
func (n *Network) Conns(a, b netip.Addr) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.linkLocked(a, b).conns)
}

// waitUp blocks while the link is blackholed; it fails if the link is
// down or ctx ends.
func (n *Network) waitUp(ctx context.Context, l *link, closed <-chan struct{}) error {
	for {
		n.mu.Lock()
		st, ch := l.state, l.changed
		n.mu.Unlock()
		switch st {
		case LinkUp:
			return nil
		case LinkDown:
			return syscall.ENETUNREACH
		}
		select {
		case <-ch:
		case <-closed:
			return net.ErrClosed
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Dial connects src to the listener at dst.
func (n *Network) Dial(ctx context.Context, src, dst netip.AddrPort) (net.Conn, error) {
	n.mu.Lock()
	if !src.Addr().IsValid() {
		src = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), 0)
	}
	if src.Port() == 0 {
		n.nextPort++
		src = netip.AddrPortFrom(src.Addr(), n.nextPort)
	}
	l := n.listeners[dst]
	if l == nil {
		l = n.listeners[netip.AddrPortFrom(netip.IPv4Unspecified(), dst.Port())]
	}
	if l == nil {
		l = n.listeners[netip.AddrPortFrom(netip.IPv6Unspecified(), dst.Port())]
	}
	lk := n.linkLocked(src.Addr(), dst.Addr())
	n.mu.Unlock()
	if err := n.waitUp(ctx, lk, nil); err != nil {
		return nil, &net.OpError{Op: "dial", Net: "mem", Err: err}
	}
	if l == nil {
		return nil, &net.OpError{Op: "dial", Net: "mem", Err: syscall.ECONNREFUSED}
	}
	p1, p2 := net.Pipe()
	cc := &conn{Conn: p1, n: n, l: lk, local: src, remote: dst, closed: make(chan struct{})}
	sc := &conn{Conn: p2, n: n, l: lk, local: dst, remote: src, closed: make(chan struct{})}
	n.mu.Lock()
	lk.conns[cc] = struct{}{}
	lk.conns[sc] = struct{}{}
	n.mu.Unlock()
	select {
	case l.ch <- sc:
		return cc, nil
	case <-l.done:
	case <-ctx.Done():
	}
	cc.Close()
	sc.Close()
	return nil, &net.OpError{Op: "dial", Net: "mem", Err: syscall.ECONNREFUSED}
}

// Listen accepts connections to addr (an unspecified address matches
// every destination on its port).
func (n *Network) Listen(addr netip.AddrPort) (net.Listener, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if addr.Port() == 0 {
		n.nextPort++
		addr = netip.AddrPortFrom(addr.Addr(), n.nextPort)
	}
	if _, ok := n.listeners[addr]; ok {
		return nil, &net.OpError{Op: "listen", Net: "mem", Err: syscall.EADDRINUSE}
	}
	l := &listener{n: n, addr: addr, ch: make(chan net.Conn), done: make(chan struct{})}
	n.listeners[addr] = l
	return l, nil
}

type listener struct {
	n    *Network
	addr netip.AddrPort
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
}

func (l *listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *listener) Close() error {
	l.once.Do(func() {
		close(l.done)
		l.n.mu.Lock()
		delete(l.n.listeners, l.addr)
		l.n.mu.Unlock()
	})
	return nil
}

func (l *listener) Addr() net.Addr { return net.TCPAddrFromAddrPort(l.addr) }

// conn is one end of a pipe over a link.
type conn struct {
	net.Conn
	n             *Network
	l             *link
	local, remote netip.AddrPort
	closeOnce     sync.Once
	closed        chan struct{}
	crashed       atomic.Bool // its host crashed: Close tells the peer nothing
}

func (c *conn) LocalAddr() net.Addr  { return net.TCPAddrFromAddrPort(c.local) }
func (c *conn) RemoteAddr() net.Addr { return net.TCPAddrFromAddrPort(c.remote) }

func (c *conn) Write(b []byte) (int, error) {
	if c.crashed.Load() {
		return 0, fmt.Errorf("mem write: host crashed: %w", syscall.ECONNRESET)
	}
	if err := c.n.waitUp(context.Background(), c.l, c.closed); err != nil {
		return 0, fmt.Errorf("mem write: %w", err)
	}
	return c.Conn.Write(b)
}

func (c *conn) Close() error {
	c.closeOnce.Do(func() {
		close(c.closed)
		c.n.mu.Lock()
		delete(c.l.conns, c)
		c.n.mu.Unlock()
	})
	if c.crashed.Load() {
		return nil // the pipe stays open: the peer must find out itself
	}
	return c.Conn.Close()
}
