// Package tcp is the TCP fabric: the reliable-connection contract of
// package fabric emulated over one TCP connection per RTRS connection, in
// the way soft-iWARP emulates RDMA. Memory regions have rkeys; every remote
// write is checked against the key and the region's bounds before a byte
// lands, so always_invalidate means on TCP what it means on an HCA.
//
// The wire format (connection handshake and work-request frames) is ours;
// docs/protocol.md describes it. The RTRS messages inside are the kernel's.
package tcp

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/internal/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Network is what the fabric runs on: real TCP by default, or an
// in-memory network in tests (package fabrictest).
type Network interface {
	Dial(ctx context.Context, src, dst netip.AddrPort) (net.Conn, error)
	Listen(addr netip.AddrPort) (net.Listener, error)
}

// Options configure a Fabric. The zero value is usable.
type Options struct {
	// Windows emulates memory windows: a region registered with
	// fabric.AccessWindow is a fabric.WindowMR, as on fabric/rdma, so
	// that the code using them is tested without a verbs device.
	// Without it the flag is ignored (plain regions are cheaper here).
	Windows bool
	// Network defaults to TCP.
	Network Network
	// Name is the fabric and device name; "tcp" by default.
	Name string
	// HandshakeTimeout bounds the connection handshake (10 s).
	HandshakeTimeout time.Duration
	// UserTimeout is TCP_USER_TIMEOUT for real TCP: how long sent data
	// may stay unacknowledged before the kernel kills the connection
	// (1 s). A path that dies silently (a dead switch port, a peer's
	// address gone: no RST, no carrier change) with IO in flight on it
	// fails over that soon, instead of when heartbeats notice (25 s); a
	// live peer's kernel acknowledges within milliseconds however busy
	// its CPUs, and retransmissions ride out a few lost segments in that
	// time. An idle path is checked by its heartbeats, which are data.
	// Linux applies it to a peer's receive window kept shut as well (its
	// zero-window probes): a peer that stops reading loses its
	// connection after it too (test/e2e TestHostileBesideVerify).
	// Negative: none, the kernel's retransmission limits (minutes). On a
	// network with long round trips or heavy loss raise it: it must
	// outlast a few retransmissions of one segment (each 200 ms and a
	// round trip at least), or a live path is failed over and
	// reconnects (no IO is lost, but it waits).
	UserTimeout time.Duration
	// StallTimeout is how long a write may wait for a peer that takes
	// (almost) no data — less than 4 MiB in that time: its receive
	// window shut, a peer that stopped reading but acknowledges, which
	// TCP_USER_TIMEOUT does not catch. Past it the connection is killed
	// (30 s). A frozen peer is caught sooner by heartbeats; this is for
	// one that writes but never reads. A slow but moving peer is not.
	StallTimeout time.Duration
	// Backlog is how many handshaken requests may wait for Accept (64).
	Backlog int
	// MaxHandshakes bounds the handshakes in progress at once (256):
	// past it a connection from a peer with fewer in progress than the
	// peer with the most takes the oldest of that one's slots, and
	// others are closed at once, so a flood costs sockets, not
	// goroutines, and cannot keep a peer with few out.
	MaxHandshakes int
	// MaxHandshakesPerAddr bounds those of one peer address
	// (fabric.PeerGroup) (32), so that idle connections from one host cannot
	// take every slot.
	MaxHandshakesPerAddr int
	// TLS, if set, runs every connection in TLS 1.3 with certificates
	// on both ends, in both roles: dialing, it verifies the server
	// against RootCAs (ServerName defaults to the address dialed, so a
	// server's certificate names its addresses) and presents
	// Certificates or GetClientCertificate; listening, it presents
	// Certificates or GetCertificate and requires a client certificate
	// that ClientCAs verifies and that names an identity (CertNames;
	// AllowAnonymousClients). A peer without TLS, or with a
	// certificate that does not verify, loses its connection in the
	// handshake. The handshake's time counts against HandshakeTimeout.
	TLS *tls.Config
	// AllowAnonymousClients, with TLS, accepts a client certificate
	// that verifies but names no identity: no subject common name, no
	// DNS, URI or e-mail alternative name (CertNames is empty; an IP
	// address is not a name). Such a client has no PeerNames: the
	// server counts it by its address, as a client without TLS, and
	// exports that grant identities are closed to it. Off (the
	// default), such a certificate fails the handshake as one that
	// does not verify does (the client sees EACCES); the listener logs
	// why and Refused counts it.
	AllowAnonymousClients bool
	// Log receives what a listener refuses before RTRS sees it (failed
	// TLS handshakes), rate limited; nil: log.L.
	Log *log.Entry
}

// Defaults of Options.
const (
	DefaultUserTimeout  = time.Second
	DefaultStallTimeout = 30 * time.Second
)

// Fabric is the TCP fabric. It is safe for concurrent use.
type Fabric struct {
	opts Options
	// srvTLS is opts.TLS for the listening side: with the checks that a
	// client presents a certificate and that it names an identity.
	srvTLS *tls.Config
	dev    *device
	rl     log.Limiter
	// refused counts connections the listeners refused before Accept,
	// by the errno (low byte) the peer was answered with (Refused).
	refused [256]atomic.Uint64
	// links fails dialled connections whose interface goes down.
	links linkWatch
}

// New returns a TCP fabric.
func New(opts Options) *Fabric {
	if opts.Name == "" {
		opts.Name = "tcp"
	}
	if opts.HandshakeTimeout <= 0 {
		opts.HandshakeTimeout = 10 * time.Second
	}
	if opts.UserTimeout == 0 {
		opts.UserTimeout = DefaultUserTimeout
	}
	if opts.StallTimeout <= 0 {
		opts.StallTimeout = DefaultStallTimeout
	}
	if opts.Backlog <= 0 {
		opts.Backlog = 64
	}
	if opts.MaxHandshakes <= 0 {
		opts.MaxHandshakes = 256
	}
	if opts.MaxHandshakesPerAddr <= 0 {
		opts.MaxHandshakesPerAddr = 32
	}
	if opts.Network == nil {
		opts.Network = tcpNetwork{userTimeout: opts.UserTimeout}
	}
	if opts.Log == nil {
		opts.Log = log.L
	}
	if opts.TLS != nil {
		c := opts.TLS.Clone()
		c.MinVersion = tls.VersionTLS13
		c.ClientAuth = tls.RequireAndVerifyClientCert
		// Nothing resumes; a ticket would be one more record to
		// read on a stream that starts with the RTRS handshake.
		c.SessionTicketsDisabled = true
		opts.TLS = c
	}
	f := &Fabric{opts: opts}
	f.links.log = opts.Log
	if c := opts.TLS; c != nil {
		f.srvTLS = c.Clone()
		// A certificate given is verified as RequireAndVerifyClientCert
		// does; none is refused below, with an error of ours, so that
		// the listener can tell the refusal from a peer that went away
		// (crypto/tls says "didn't provide a certificate" in words only).
		f.srvTLS.ClientAuth = tls.VerifyClientCertIfGiven
		verify := c.VerifyConnection
		f.srvTLS.VerifyConnection = func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errNoClientCert
			}
			if verify != nil {
				if err := verify(cs); err != nil {
					return err
				}
			}
			// Verified by now.
			if !opts.AllowAnonymousClients && len(CertNames(cs.PeerCertificates[0])) == 0 {
				return noIdentityError{cs.PeerCertificates[0]}
			}
			return nil
		}
	}
	f.dev = &device{fab: f}
	return f
}

var (
	_ fabric.Fabric  = (*Fabric)(nil)
	_ fabric.Refuser = (*Fabric)(nil)
)

// Refused counts the connections the fabric's listeners refused before
// a connection request reached Accept, by the errno the peer was
// answered with: EACCES for a client without TLS at a listener with it
// (or with TLS at one without), and for a client certificate that is
// missing, does not verify (another authority, expired) or names no
// identity (Options.AllowAnonymousClients). A handshake the client broke
// off (it did not trust the server's certificate), or that ended because
// the peer went away or was too slow, is no refusal: it is logged only.
func (f *Fabric) Refused() map[syscall.Errno]uint64 {
	m := map[syscall.Errno]uint64{}
	for i := range f.refused {
		if n := f.refused[i].Load(); n > 0 {
			m[syscall.Errno(i)] = n
		}
	}
	return m
}

// noIdentityError refuses a client certificate that names no identity.
type noIdentityError struct{ cert *x509.Certificate }

func (e noIdentityError) Error() string {
	return "client certificate names no identity (no CN, no SAN)"
}

// errNoClientCert refuses a TLS client that presents no certificate.
var errNoClientCert = errors.New("client presented no certificate")

// refusedHandshake says whether a TLS handshake failed by the server's
// own verdict on the client's certificate, rather than the client's or
// the network's.
func refusedHandshake(err error) bool {
	var cv *tls.CertificateVerificationError
	_, ni := errors.AsType[noIdentityError](err)
	return ni || errors.Is(err, errNoClientCert) || errors.As(err, &cv)
}

func (f *Fabric) Name() string { return f.opts.Name }

// Resolve returns the fabric's one device: every address is reachable
// through the host's network stack.
func (f *Fabric) Resolve(ctx context.Context, src, dst netip.AddrPort) (fabric.Device, error) {
	if !dst.IsValid() {
		return nil, fmt.Errorf("tcp fabric: invalid destination %v", dst)
	}
	return f.dev, nil
}

// AllocMemory returns Go memory (the TCP fabric never hands it to
// hardware), aligned to 4 KiB so that chunks can be read and written with
// O_DIRECT.
func (f *Fabric) AllocMemory(n int) (fabric.Memory, error) {
	if n <= 0 {
		return nil, errors.New("tcp fabric: memory size must be positive")
	}
	return &heapMemory{b: AlignedBytes(n)}, nil
}

// AlignedBytes returns n zeroed bytes whose first byte is 4 KiB aligned.
func AlignedBytes(n int) []byte {
	const align = 4096
	b := make([]byte, n+align)
	off := (align - int(uintptr(unsafe.Pointer(&b[0]))%align)) % align
	return b[off : off+n : off+n]
}

type heapMemory struct{ b []byte }

func (m *heapMemory) Bytes() []byte { return m.b }
func (m *heapMemory) Free() error   { return nil }

// AllocMapped returns n bytes of a private anonymous mapping
// (fabric.Mapper): zero, taking no room until touched, and unmapped by
// Free. Page aligned, so O_DIRECT can use it.
func (f *Fabric) AllocMapped(n int) (fabric.Memory, error) {
	if n <= 0 {
		return nil, errors.New("tcp fabric: memory size must be positive")
	}
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("tcp fabric: mmap %d bytes: %w", n, err)
	}
	return &mappedMemory{b: b}, nil
}

type mappedMemory struct{ b []byte }

func (m *mappedMemory) Bytes() []byte { return m.b }

func (m *mappedMemory) Free() error {
	if m.b == nil {
		return nil
	}
	err := unix.Munmap(m.b)
	m.b = nil
	return err
}

// readBufSize is what a connection's reader reads the socket into.
const readBufSize = 128 << 10

// connFixed bounds what a connection holds besides its queues, batches
// and read buffer: its two goroutines' stacks, the socket's and the
// connection's own structures.
const connFixed = 96 << 10

// tlsConnExtra bounds what TLS adds to a connection: the records being
// read and written, and the stage buffers of its two batches.
const tlsConnExtra = 2*stageSize + 64<<10

// ConnMemory is what one connection with these queue sizes holds at
// most (fabric.ConnCoster): its send queue and the two batches that
// take work requests from it (the reader's and the writer's), each with
// a frame header and an iovec of up to 1+MaxSGE buffers per request,
// the receive queue, the read buffer, and TLS's buffers with TLS.
func (f *Fabric) ConnMemory(maxSendWR, maxRecvWR int) int64 {
	sqCap, rqCap := queueCaps(maxSendWR, maxRecvWR)
	wr := int64(unsafe.Sizeof(fabric.SendWR{}))
	batch := int64(sqCap) * (wr + frameHdrSize + (1+fabric.MaxSGE)*int64(unsafe.Sizeof([]byte(nil))))
	n := int64(sqCap)*wr + 2*batch + int64(rqCap)*int64(unsafe.Sizeof(fabric.RecvWR{})) + readBufSize + connFixed
	if f.opts.TLS != nil {
		n += tlsConnExtra
	}
	return n
}

type device struct {
	fab *Fabric
	mrs mrTable
}

func (d *device) Name() string { return d.fab.opts.Name }
func (d *device) Port() int    { return 1 }

func (d *device) AllocPD() (fabric.PD, error) { return &pd{dev: d}, nil }

// The handshake stands in for the CM's REQ, REP and REJ. Each frame is a
// 12-byte header, then private data:
//
//	off 0  [7]u8 "RTRSTCP"
//	off 7  u8    version (1)
//	off 8  u8    type: 1 REQ, 2 REP (accept), 3 REJ (reject), 4 TLS
//	             required (a server with TLS to a peer without), 5 no TLS
//	             (a server without TLS to a peer that starts it)
//	off 9  u8    reserved (0)
//	off 10 le16  private data length (at most 256)
const (
	hsHdrSize   = 12
	hsVersion   = 1
	hsREQ       = 1
	hsREP       = 2
	hsREJ       = 3
	hsNeedTLS   = 4
	hsNoTLS     = 5
	maxPrivData = 256
)

var hsMagic = [7]byte{'R', 'T', 'R', 'S', 'T', 'C', 'P'}

func writeHandshake(w io.Writer, typ byte, priv []byte) error {
	if len(priv) > maxPrivData {
		return fmt.Errorf("tcp fabric: %d bytes of private data, at most %d", len(priv), maxPrivData)
	}
	b := make([]byte, hsHdrSize+len(priv))
	copy(b, hsMagic[:])
	b[7] = hsVersion
	b[8] = typ
	binary.LittleEndian.PutUint16(b[10:], uint16(len(priv)))
	copy(b[hsHdrSize:], priv)
	_, err := w.Write(b)
	return err
}

func readHandshake(r io.Reader) (typ byte, priv []byte, err error) {
	var h [hsHdrSize]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, err
	}
	if [7]byte(h[:7]) != hsMagic || h[7] != hsVersion {
		return 0, nil, fmt.Errorf("tcp fabric: not an RTRS/TCP peer: %w", errProtocol)
	}
	n := binary.LittleEndian.Uint16(h[10:])
	if n > maxPrivData {
		return 0, nil, fmt.Errorf("tcp fabric: %d bytes of private data: %w", n, errProtocol)
	}
	priv = make([]byte, n)
	if _, err := io.ReadFull(r, priv); err != nil {
		return 0, nil, err
	}
	return h[8], priv, nil
}

// Dial connects and performs the handshake.
func (d *device) Dial(ctx context.Context, p fabric.DialParams) (fabric.Conn, []byte, error) {
	pdp, ok := p.PD.(*pd)
	if !ok || pdp.dev != d {
		return nil, nil, errors.New("tcp fabric: dial with a protection domain of another device")
	}
	nc, err := d.fab.opts.Network.Dial(ctx, p.Src, p.Dst)
	if err != nil {
		return nil, nil, err
	}
	deadline := time.Now().Add(d.fab.opts.HandshakeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	nc.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { nc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	raw := nc
	if cfg := d.fab.opts.TLS; cfg != nil {
		if cfg.ServerName == "" {
			cfg = cfg.Clone()
			cfg.ServerName = p.Dst.Addr().Unmap().WithZone("").String()
		}
		tc := tls.Client(raw, cfg)
		if err := tc.Handshake(); err != nil {
			raw.Close()
			if ctx.Err() != nil {
				return nil, nil, ctx.Err()
			}
			var rh tls.RecordHeaderError
			if errors.As(err, &rh) {
				return nil, nil, fmt.Errorf("tcp fabric: %v does not speak TLS (its server has no tls configured): %w", p.Dst, syscall.EACCES)
			}
			err = fmt.Errorf("tcp fabric: TLS handshake with %v: %w", p.Dst, err)
			if isAuthFailure(err) {
				err = authError{err}
			}
			return nil, nil, err
		}
		nc = tc
	}
	if err := writeHandshake(nc, hsREQ, p.PrivateData); err != nil {
		raw.Close()
		return nil, nil, err
	}
	typ, priv, err := readHandshake(nc)
	if err != nil {
		raw.Close()
		if ctx.Err() != nil {
			return nil, nil, ctx.Err()
		}
		// TLS 1.3: the server checks the client's certificate after
		// the client's side of the handshake is done; its verdict is
		// an alert on the first read.
		if nc != raw && isAuthFailure(err) {
			return nil, nil, authError{fmt.Errorf("tcp fabric: %v refused the client's certificate "+
				"(not of its ca, expired, or naming no identity: the server's log says which): %w", p.Dst, err)}
		}
		return nil, nil, fmt.Errorf("tcp fabric: handshake with %v: %w", p.Dst, err)
	}
	if !stop() {
		raw.Close()
		return nil, nil, ctx.Err()
	}
	nc.SetDeadline(time.Time{})
	switch typ {
	case hsREP:
	case hsREJ:
		raw.Close()
		return nil, nil, &fabric.RejectError{PrivateData: priv}
	case hsNeedTLS:
		raw.Close()
		return nil, nil, fmt.Errorf("tcp fabric: %v requires TLS: give the client a certificate (tls): %w", p.Dst, syscall.EACCES)
	default:
		raw.Close()
		return nil, nil, fmt.Errorf("tcp fabric: handshake reply of type %d: %w", typ, errProtocol)
	}
	c, err := newConn(nc, raw, d, pdp, p.Attr)
	if err != nil {
		raw.Close()
		return nil, nil, err
	}
	c.start()
	if _, host := d.fab.opts.Network.(tcpNetwork); host {
		d.fab.links.add(c)
	}
	return c, priv, nil
}

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
	perAddrMu sync.Mutex                // guards perAddr, shaking and shakeSeq
	perAddr   map[netip.Prefix]int      // handshakes in progress per peer (fabric.PeerGroup)
	shaking   map[net.Conn]shakingState // their connections, closed by Close
	shakeSeq  uint64
	closeOnce sync.Once
	wg        sync.WaitGroup
}

func (l *listener) Addr() netip.AddrPort { return addrPortOf(l.nl.Addr()) }

func (l *listener) acceptLoop() {
	defer l.wg.Done()
	for {
		nc, err := l.nl.Accept()
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

// prefixConn is a connection whose first bytes were read already.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// isAuthFailure reports whether a TLS error is about credentials: a
// certificate that does not verify here, or an alert from the peer (which
// refuses ours). A timeout, a reset or an EOF is not.
func isAuthFailure(err error) bool {
	var cv *tls.CertificateVerificationError
	var oe *net.OpError
	return errors.As(err, &cv) || (errors.As(err, &oe) && oe.Op == "remote error")
}

// authError is a failed TLS authentication: a permission error (EACCES)
// to those who classify errors by errno.
type authError struct{ err error }

func (e authError) Error() string   { return e.err.Error() }
func (e authError) Unwrap() []error { return []error{e.err, syscall.EACCES} }

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
