// Package tcp is the TCP fabric: the reliable-connection contract of
// package fabric emulated over one TCP connection per RTRS connection, in
// the way soft-iWARP emulates RDMA. Memory regions have rkeys; every remote
// write is checked against the key and the region's bounds before a byte
// lands, so always_invalidate means on TCP what it means on an HCA.
//
// The wire format (connection handshake and work-request frames) is ours;
// docs/protocol.md describes it. The RTRS messages inside are the kernel's.
//
// Every object is safe for concurrent use, as package fabric's contract
// wants. Lock order (outermost first; a sync.Once counts, as Do holds it
// while its function runs):
//
//	conn.failOnce (fail)
//	  conn.sqMu
//	  conn.rqMu
//	  linkWatch.mu (the connection stops being watched)
//	listener.closeOnce (Close)
//	  listener.perAddrMu
//	  synFilter.mu, then synFilter.once (the listening socket closed)
//	connReq.once (Accept)
//	  conn.rqMu (newConn posts the first receives)
//
// No two mutexes are held at once: conn.sqMu, conn.rqMu, linkWatch.mu,
// listener.perAddrMu, synFilter.mu and mrTable.mu are each let go before
// another is taken (popRecv lets rqMu go to flush, which takes sqMu;
// linkWatch fails its connections after it lets mu go; the accept loop
// notes a refusal under synFilter.mu and starts the filter's goroutine
// after it lets it go). No handler is called under a mutex;
// Handler.Disconnected runs inside conn.failOnce, and Handler.Attached
// inside connReq.once. A listener's screen (fabric.Screener) is called
// from its accept loop with none held.
//
// Which fields each lock guards, and which functions run with it held,
// are +checklocks annotations, checked by gVisor's checklocks analyzer
// in make vet; the order above is not.
package tcp

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/rnbd/rnbd/pkg/log"
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

func (f *Fabric) Name() string { return f.opts.Name }

// Resolve returns the fabric's one device: every address is reachable
// through the host's network stack.
func (f *Fabric) Resolve(ctx context.Context, src, dst netip.AddrPort) (fabric.Device, error) {
	if !dst.IsValid() {
		return nil, fmt.Errorf("tcp fabric: invalid destination %v", dst)
	}
	return f.dev, nil
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
