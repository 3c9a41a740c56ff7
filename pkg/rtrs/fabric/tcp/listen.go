// The listener: accepting connections, the handshake of each within its
// bounds (handshake slots per peer and in all), and the connection
// requests it hands to Accept.

package tcp

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Listen starts accepting connections on addr.
func (f *Fabric) Listen(addr netip.AddrPort) (fabric.Listener, error) {
	nl, err := f.opts.Network.Listen(addr)
	if err != nil {
		return nil, err
	}
	l := &listener{
		fab:  f,
		nl:   nl,
		reqs: make(chan *connReq, f.opts.Backlog),
		done: make(chan struct{}),
	}
	l.wg.Add(1)
	go l.acceptLoop()
	return l, nil
}

type listener struct {
	fab       *Fabric
	nl        net.Listener
	reqs      chan *connReq
	done      chan struct{}
	screen    atomic.Pointer[screen] // Screen's
	perAddrMu sync.Mutex             // guards perAddr, shaking and shakeSeq
	// +checklocks:perAddrMu
	perAddr map[netip.Prefix]int // handshakes in progress per peer (fabric.PeerGroup)
	// +checklocks:perAddrMu
	shaking map[net.Conn]shakingState // their connections, closed by Close
	// +checklocks:perAddrMu
	shakeSeq  uint64
	closeOnce sync.Once
	wg        sync.WaitGroup
}

func (l *listener) Addr() netip.AddrPort { return addrPortOf(l.nl.Addr()) }

func (l *listener) acceptLoop() {
	defer l.wg.Done()
	for {
		nc, err := l.accept()
		if err != nil {
			select {
			case <-l.done:
				return
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // EMFILE and friends: do not spin
			continue
		}
		peer := fabric.PeerGroup(addrPortOf(nc.RemoteAddr()).Addr())
		if !l.takePeerSlot(peer, nc) {
			nc.Close() // too many from this peer, or in all
			continue
		}
		l.wg.Add(1)
		go l.handshake(nc, peer)
	}
}

// screen is what a server refuses at accept (fabric.Screener): the
// peers refuse says, each answered with frame, a REJ.
type screen struct {
	refuse func(netip.Addr) time.Duration
	frame  []byte
}

// Screen makes the listener refuse, as it accepts them, the connections
// of the peers refuse names (fabric.Screener): each is answered with a
// REJ of priv and closed, with no goroutine, no handshake, no read.
func (l *listener) Screen(refuse func(netip.Addr) time.Duration, priv []byte) {
	if len(priv) > maxPrivData {
		return // more than a REJ carries: as Reject, nothing is sent
	}
	frame := make([]byte, hsHdrSize+len(priv))
	putHandshake(frame, hsREJ, priv)
	l.screen.Store(&screen{refuse: refuse, frame: frame})
}

// accept returns the next connection that the screen, if there is one,
// lets through; it answers and closes those it refuses. On the host's
// TCP a refused connection costs an accept, a write and a close
// (hostListener.acceptScreened).
func (l *listener) accept() (net.Conn, error) {
	sc := l.screen.Load()
	if sc == nil {
		return l.nl.Accept()
	}
	if hl, ok := l.nl.(*hostListener); ok {
		return hl.acceptScreened(sc)
	}
	for {
		nc, err := l.nl.Accept()
		if err != nil || sc.refuse(addrPortOf(nc.RemoteAddr()).Addr()) <= 0 {
			return nc, err
		}
		// A test's network, whose writes may wait for the peer: the
		// answer goes from a goroutine of its own.
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			nc.SetDeadline(time.Now().Add(l.fab.opts.HandshakeTimeout))
			nc.Write(sc.frame)
			nc.Close()
		}()
	}
}

// handshake reads a REQ within the handshake timeout and queues it for
// Accept. A peer that sends garbage or nothing only costs its own socket.
func (l *listener) handshake(raw net.Conn, peer netip.Prefix) {
	defer l.wg.Done()
	defer l.putPeerSlot(peer, raw) // the connection takePeerSlot counted
	nc := raw
	nc.SetDeadline(time.Now().Add(l.fab.opts.HandshakeTimeout))
	// The first byte tells a TLS record (a handshake: 22) from the
	// plain handshake ('R'): a peer configured otherwise than the server
	// is told so, not only hung up on.
	var first [1]byte
	if _, err := io.ReadFull(raw, first[:]); err != nil {
		raw.Close()
		return
	}
	nc = &prefixConn{Conn: raw, prefix: first[:]}
	tlsFirst := first[0] == 22
	if tlsFirst != (l.fab.opts.TLS != nil) {
		typ, why := byte(hsNoTLS), "TLS from a client, but the server has no tls configured"
		if !tlsFirst {
			typ, why = hsNeedTLS, "no TLS from a client, but the server requires it"
		}
		// Counted where the server counts its refusals: the client
		// sees EACCES either way.
		l.fab.refused[syscall.EACCES].Add(1)
		l.fab.rl.Log(l.fab.opts.Log.WithField("client", raw.RemoteAddr().String()), log.WarnLevel, "rejecting connection: "+why)
		writeHandshake(raw, typ, nil)
		raw.Close()
		return
	}
	var names []string
	if cfg := l.fab.opts.TLS; cfg != nil {
		tc := tls.Server(nc, l.fab.srvTLS)
		if err := tc.Handshake(); err != nil {
			if refusedHandshake(err) {
				// Answered with an alert (EACCES at the client),
				// and counted where the server counts its
				// refusals.
				l.fab.refused[syscall.EACCES].Add(1)
			}
			if ni, ok := errors.AsType[noIdentityError](err); ok {
				l.fab.rl.Log(l.fab.opts.Log.WithFields(log.Fields{"client": nc.RemoteAddr().String(),
					"subject": ni.cert.Subject.String(), "issuer": ni.cert.Issuer.String(), "serial": ni.cert.SerialNumber.String()}),
					log.WarnLevel, "rejecting connection: "+ni.Error())
			} else {
				l.fab.rl.Log(l.fab.opts.Log.WithError(err).WithField("client", nc.RemoteAddr().String()),
					log.WarnLevel, "rejecting connection: TLS handshake failed")
			}
			raw.Close()
			return
		}
		names = CertNames(tc.ConnectionState().PeerCertificates[0])
		nc = tc
	}
	typ, priv, err := readHandshake(nc)
	if err != nil || typ != hsREQ {
		raw.Close()
		return
	}
	if l.fab.opts.TLS == nil {
		nc = raw // the first byte is read: no wrapper in the way of writev
	}
	// The handshake is done: its slot is freed before the request is
	// queued, so an eviction cannot close a connection Accept hands out;
	// one evicted while it finished is closed already.
	if !l.finishShake(raw) {
		return
	}
	r := &connReq{l: l, nc: nc, raw: raw, priv: priv, names: names}
	select {
	case l.reqs <- r:
	case <-l.done:
		raw.Close()
	default: // backlog full: drop, as a listen backlog overflow does
		raw.Close()
	}
}

// shakingState is a handshake in progress: its peer, and its place in
// the order they started in.
type shakingState struct {
	peer netip.Prefix
	seq  uint64
}

// takePeerSlot counts nc's handshake, unless its peer (a
// fabric.PeerGroup) has MaxHandshakesPerAddr in progress or the listener
// is closed. When MaxHandshakes are in progress in all, the peer with the
// most gives up its oldest to a peer with fewer (its connection is
// closed): a peer's fair share is kept however many others flood the
// listener, so idle connections from a few hosts cannot keep a
// legitimate client's paths out.
func (l *listener) takePeerSlot(peer netip.Prefix, nc net.Conn) bool {
	l.perAddrMu.Lock()
	defer l.perAddrMu.Unlock()
	if l.shaking == nil {
		l.shaking = make(map[net.Conn]shakingState)
		l.perAddr = make(map[netip.Prefix]int)
	}
	select {
	case <-l.done:
		return false
	default:
	}
	// A stream without addresses counts as one peer without a bound.
	if peer.IsValid() && l.perAddr[peer] >= l.fab.opts.MaxHandshakesPerAddr {
		return false
	}
	if len(l.shaking) >= l.fab.opts.MaxHandshakes && !l.evictLocked(peer) {
		return false
	}
	if peer.IsValid() {
		l.perAddr[peer]++
	}
	l.shakeSeq++
	l.shaking[nc] = shakingState{peer: peer, seq: l.shakeSeq}
	return true
}

// evictLocked closes the oldest handshake of the network with the most
// in progress, if that is more than peer's network's next one would
// make; it reports whether it made room. Networks, not addresses, share
// the slots here (an IPv6 /64, an IPv4 address: evictionNet): one host
// that takes a handshake from each of many addresses of its /64 is one
// network, and gives way to others.
// +checklocks:l.perAddrMu
func (l *listener) evictLocked(peer netip.Prefix) bool {
	counts := map[netip.Prefix]int{}
	for _, st := range l.shaking {
		if st.peer.IsValid() {
			counts[evictionNet(st.peer)]++
		}
	}
	var most netip.Prefix
	for p, n := range counts {
		if n > counts[most] {
			most = p
		}
	}
	if !most.IsValid() || counts[most] <= counts[evictionNet(peer)]+1 {
		return false
	}
	var victim net.Conn
	var oldest uint64
	for c, st := range l.shaking {
		if st.peer.IsValid() && evictionNet(st.peer) == most && (victim == nil || st.seq < oldest) {
			victim, oldest = c, st.seq
		}
	}
	l.dropLocked(victim)
	victim.Close() // its handshake fails now; its slot is free already
	return true
}

// evictionNet is the network a peer (a fabric.PeerGroup) shares
// handshake slots with when they run short: its /64 for IPv6, itself for
// IPv4.
func evictionNet(peer netip.Prefix) netip.Prefix {
	if !peer.IsValid() {
		return peer
	}
	if a := peer.Addr(); a.Is6() {
		p, _ := a.Prefix(64)
		return p
	}
	return peer
}

// dropLocked uncounts nc's handshake, once.
// +checklocks:l.perAddrMu
func (l *listener) dropLocked(nc net.Conn) {
	st, ok := l.shaking[nc]
	if !ok {
		return
	}
	delete(l.shaking, nc)
	if !st.peer.IsValid() {
		return
	}
	if l.perAddr[st.peer]--; l.perAddr[st.peer] <= 0 {
		delete(l.perAddr, st.peer)
	}
}

// finishShake uncounts nc's finished handshake; false if an eviction
// took it first.
func (l *listener) finishShake(nc net.Conn) bool {
	l.perAddrMu.Lock()
	defer l.perAddrMu.Unlock()
	if _, ok := l.shaking[nc]; !ok {
		return false
	}
	l.dropLocked(nc)
	return true
}

func (l *listener) putPeerSlot(peer netip.Prefix, nc net.Conn) {
	l.perAddrMu.Lock()
	defer l.perAddrMu.Unlock()
	l.dropLocked(nc)
}

func (l *listener) Accept(ctx context.Context) (fabric.ConnRequest, error) {
	select {
	case r := <-l.reqs:
		return r, nil
	case <-l.done:
		return nil, fabric.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (l *listener) Close() error {
	l.closeOnce.Do(func() {
		l.perAddrMu.Lock()
		close(l.done)
		for nc := range l.shaking {
			nc.Close() // a handshake in progress ends now, not at its timeout
		}
		l.perAddrMu.Unlock()
		l.nl.Close()
	})
	l.wg.Wait()
	for {
		select {
		case r := <-l.reqs:
			r.raw.Close()
		default:
			return nil
		}
	}
}

type connReq struct {
	l     *listener
	nc    net.Conn // in TLS if the fabric has it
	raw   net.Conn // the TCP connection under nc
	priv  []byte
	names []string // of the peer's certificate
	once  sync.Once
}

// PeerNames are the names of the peer's certificate (fabric.Authenticated).
func (r *connReq) PeerNames() []string { return r.names }

func (r *connReq) PrivateData() []byte        { return r.priv }
func (r *connReq) LocalAddr() netip.AddrPort  { return addrPortOf(r.nc.LocalAddr()) }
func (r *connReq) RemoteAddr() netip.AddrPort { return addrPortOf(r.nc.RemoteAddr()) }
func (r *connReq) Device() fabric.Device      { return r.l.fab.dev }

var errAnswered = errors.New("tcp fabric: connection request already answered")

func (r *connReq) Accept(p fabric.PD, attr fabric.ConnAttr, priv []byte) (fabric.Conn, error) {
	err := errAnswered
	var c *conn
	r.once.Do(func() {
		pdp, ok := p.(*pd)
		if !ok {
			err = errors.New("tcp fabric: accept with a protection domain of another fabric")
			r.raw.Close()
			return
		}
		c, err = newConn(r.nc, r.raw, r.l.fab.dev, pdp, attr)
		if err != nil {
			r.raw.Close()
			return
		}
		r.nc.SetDeadline(time.Now().Add(r.l.fab.opts.HandshakeTimeout))
		if err = writeHandshake(r.nc, hsREP, priv); err != nil {
			r.raw.Close()
			return
		}
		r.nc.SetDeadline(time.Time{})
		c.start()
	})
	if err != nil {
		return nil, err
	}
	return c, nil
}

func (r *connReq) Reject(priv []byte) error {
	err := errAnswered
	r.once.Do(func() {
		r.nc.SetDeadline(time.Now().Add(r.l.fab.opts.HandshakeTimeout))
		err = writeHandshake(r.nc, hsREJ, priv)
		r.raw.Close()
	})
	return err
}
