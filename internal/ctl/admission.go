// Which connections the TLS listeners keep (docs/control-api.md,
// "Bounds"). A socket in its TLS handshake has proved nothing: it counts
// only against the handshakes of its address (max_handshakes_per_address)
// and of all (MaxHandshakes, past which the oldest handshake of the
// address with the most gives way), for handshake_timeout at most. A
// connection whose handshake is done has an identity and a role, and
// counts against max_connections, of which the roles other than admin
// and provisioner may hold half: the other half is kept for those that
// change things. Where a new connection finds no room, the longest idle
// connection of a role other than admin and provisioner (idle between
// requests, or still reading a header: no request in a handler) is
// closed to make it; with none, the new one is refused unavailable.

package ctl

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"time"
)

// retryAfterSeconds is the Retry-After of a refusal by a bound: the
// bounds free within a second or so (a request ends, a handshake times
// out, an idle connection is closed).
const retryAfterSeconds = 1

// evictedHandshake is admit's refusal of a connection whose handshake
// made way for newer ones meanwhile (closed already).
const evictedHandshake = "evicted"

// pending is a connection in its TLS handshake.
type pending struct {
	key   netip.Prefix
	raw   net.Conn
	start time.Time
}

// connState is what the admission knows of a connection it took.
type connState struct {
	// since is when it was taken or last became idle: the longest
	// idle is closed first.
	since time.Time
	// busy counts its requests in a handler (Handle): one with any is
	// never closed to make room.
	busy int
}

// admission counts the TLS listeners' handshakes and connections
// together. Its bounds are set by SetAccess, before any listener.
type admission struct {
	// The bounds, set before any listener: max_connections, the share
	// of the roles other than admin and provisioner, the handshakes of
	// one address and of all.
	maxConns      int
	lowConns      int
	perAddr       int
	maxHandshakes int

	mu sync.Mutex
	// byAddr are the handshakes under way of each address (an IPv4
	// address, an IPv6 /64), oldest first.
	// +checklocks:mu
	byAddr map[netip.Prefix][]*pending
	// +checklocks:mu
	handshakes int
	// conns are the connections taken; low counts those of a role
	// other than admin and provisioner.
	// +checklocks:mu
	conns map[*authConn]*connState
	// +checklocks:mu
	low int
}

// setBounds sets the bounds of a (SetAccess).
func (a *admission) setBounds(acc Access) {
	a.maxConns = acc.MaxConnections
	a.lowConns = acc.MaxConnections - acc.MaxConnections/2
	a.perAddr = acc.MaxHandshakesPerAddress
	a.maxHandshakes = acc.MaxHandshakes
}

// addrKey is what handshakes are counted by: an IPv4 address, or the
// /64 of an IPv6 one (what one host is given).
func addrKey(addr net.Addr) netip.Prefix {
	var ip netip.Addr
	if ta, ok := addr.(*net.TCPAddr); ok {
		ip = ta.AddrPort().Addr().Unmap()
	} else if ap, err := netip.ParseAddrPort(addr.String()); err == nil {
		ip = ap.Addr().Unmap()
	}
	if ip.Is6() {
		p, _ := ip.Prefix(64)
		return p
	}
	return netip.PrefixFrom(ip, ip.BitLen())
}

// startHandshake counts raw's handshake. With its address at
// max_handshakes_per_address, the oldest handshake of that address is
// the victim, which the caller closes: a peer that shares an address
// with another (a node's SNAT, an IPv6 /64) and holds idle sockets
// there makes way for the other's new ones, never locks it out. Past
// MaxHandshakes, the oldest handshake of the address with the most is
// the victim.
func (a *admission) startHandshake(raw net.Conn) (p *pending, victim net.Conn) {
	key := addrKey(raw.RemoteAddr())
	a.mu.Lock()
	defer a.mu.Unlock()
	if v := a.byAddr[key]; len(v) >= a.perAddr {
		victim = v[0].raw
		a.dropHandshake(v[0])
	} else if a.handshakes >= a.maxHandshakes {
		var most netip.Prefix
		for k, ps := range a.byAddr {
			m := a.byAddr[most]
			if len(ps) > len(m) || len(ps) == len(m) && len(m) > 0 && ps[0].start.Before(m[0].start) {
				most = k
			}
		}
		if v := a.byAddr[most]; len(v) > 0 {
			victim = v[0].raw
			a.dropHandshake(v[0])
		}
	}
	if a.byAddr == nil {
		a.byAddr = map[netip.Prefix][]*pending{}
	}
	p = &pending{key: key, raw: raw, start: time.Now()}
	a.byAddr[key] = append(a.byAddr[key], p)
	a.handshakes++
	return p, victim
}

// dropHandshake stops counting p; false if it was not counted (made way
// for a newer one).
// +checklocks:a.mu
func (a *admission) dropHandshake(p *pending) bool {
	ps := a.byAddr[p.key]
	i := slices.Index(ps, p)
	if i < 0 {
		return false
	}
	ps = slices.Delete(ps, i, i+1)
	if len(ps) == 0 {
		delete(a.byAddr, p.key)
	} else {
		a.byAddr[p.key] = ps
	}
	a.handshakes--
	return true
}

// endHandshake stops counting p's handshake, and reports whether it had
// made way for a newer one (closed by startHandshake).
func (a *admission) endHandshake(p *pending) (evicted bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return !a.dropHandshake(p)
}

// admit takes ac, whose handshake p is done, against max_connections
// and, for a role other than admin and provisioner, its share of it.
// Where there is no room it closes the longest idle connection of such
// a role (victim, which the caller closes); with none, it says why ac is
// refused, and p stays counted until the caller has answered it
// (endHandshake).
func (a *admission) admit(p *pending, ac *authConn) (victim *authConn, why string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !slices.Contains(a.byAddr[p.key], p) {
		return nil, evictedHandshake
	}
	full := len(a.conns) >= a.maxConns
	lowFull := ac.low && a.low >= a.lowConns
	if full || lowFull {
		for c, st := range a.conns {
			if c.low && st.busy == 0 && (victim == nil || st.since.Before(a.conns[victim].since)) {
				victim = c
			}
		}
		switch {
		case victim == nil && lowFull:
			return nil, fmt.Sprintf("%d connections of roles other than admin and provisioner already, the most they may have "+
				"(half of max_connections %d: the rest is kept for admins and provisioners)", a.low, a.maxConns)
		case victim == nil:
			return nil, fmt.Sprintf("%d connections already (max_connections)", len(a.conns))
		}
		a.dropConn(victim)
	}
	a.dropHandshake(p)
	if a.conns == nil {
		a.conns = map[*authConn]*connState{}
	}
	a.conns[ac] = &connState{since: time.Now()}
	if ac.low {
		a.low++
	}
	return victim, ""
}

// dropConn stops counting c.
// +checklocks:a.mu
func (a *admission) dropConn(c *authConn) {
	if _, ok := a.conns[c]; !ok {
		return
	}
	delete(a.conns, c)
	if c.low {
		a.low--
	}
}

// state follows a connection's state (http.Server's ConnState): idle
// from now, or gone.
func (a *admission) state(c *authConn, st http.ConnState) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch st {
	case http.StateIdle:
		if cs := a.conns[c]; cs != nil {
			cs.since = time.Now()
		}
	case http.StateClosed, http.StateHijacked:
		a.dropConn(c)
	}
}

// busy counts a request of c in a handler (d 1), or its end (-1).
func (a *admission) busy(c *authConn, d int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if cs := a.conns[c]; cs != nil {
		cs.busy += d
		if cs.busy == 0 {
			cs.since = time.Now()
		}
	}
}

// counts are the handshakes under way and the connections taken (for
// tests).
func (a *admission) counts() (handshakes, conns, low int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.handshakes, len(a.conns), a.low
}

// authConn is a connection whose handshake is done, taken by the
// admission: its caller, and the socket under its TLS, which closes it
// at once (to make room) without a TLS alert that could wait on a peer
// that does not read.
type authConn struct {
	net.Conn // *tls.Conn
	raw      net.Conn
	adm      *admission
	caller   *Caller
	// low: a role other than admin and provisioner (or a certificate
	// refused for its names' roles).
	low bool
}

// Close gives the connection's place back, and closes it.
func (c *authConn) Close() error {
	c.adm.mu.Lock()
	c.adm.dropConn(c)
	c.adm.mu.Unlock()
	return c.Conn.Close()
}

type connKey struct{}

// busy marks r's connection as serving a request until the func it
// gives is called: a connection of any role with a request in a handler
// is never closed to make room.
func (s *Server) busy(r *http.Request) func() {
	ac, _ := r.Context().Value(connKey{}).(*authConn)
	if ac == nil {
		return func() {}
	}
	s.adm.busy(ac, 1)
	return func() { s.adm.busy(ac, -1) }
}
