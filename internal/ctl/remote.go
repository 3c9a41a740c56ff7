// The control API on TCP: TLS 1.3 only, a client certificate of the CA
// required, handshakes done before a connection reaches HTTP (bounded in
// time and in number), and the caller named by its certificate.

package ctl

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
)

// errNoClientCert refuses a TLS client that presents no certificate.
var errNoClientCert = errors.New("the client presented no certificate (the admin listener requires one of its CA)")

// errNoIdentity refuses a client certificate that names no identity.
var errNoIdentity = errors.New("the client certificate names no identity (no common name, no DNS, URI or e-mail name)")

// ListenTLS listens on addr (HOST:PORT) for the control API in TLS 1.3:
// tc has the server's certificate and the CA of clients (ClientCAs),
// each of which must present a certificate it verifies that names an
// identity. It serves from Serve on, with the bounds of SetAccess, which
// must come first. It returns the address bound.
func (s *Server) ListenTLS(addr string, tc *tls.Config) (net.Addr, error) {
	if tc == nil || tc.ClientCAs == nil {
		return nil, fmt.Errorf("admin listener %s: no CA for client certificates: the control API is never served on the network without them", addr)
	}
	c := tc.Clone()
	c.MinVersion, c.MaxVersion = tls.VersionTLS13, tls.VersionTLS13
	c.SessionTicketsDisabled = true
	c.NextProtos = []string{"http/1.1"}
	// A certificate given is verified as RequireAndVerifyClientCert
	// does; none is refused below with an error of ours, so that the
	// audit line can say which it was.
	c.ClientAuth = tls.VerifyClientCertIfGiven
	c.VerifyConnection = func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errNoClientCert
		}
		if len(s.names(cs)) == 0 {
			return errNoIdentity
		}
		return nil
	}
	raw, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("admin listener %s: %w", addr, err)
	}
	l := &tlsListener{Listener: raw, s: s, tc: c, conns: make(chan net.Conn),
		slots: make(chan struct{}, s.access.MaxConnections), done: make(chan struct{})}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.hs = &http.Server{Handler: s.mux, ReadHeaderTimeout: s.access.ReadHeaderTimeout, IdleTimeout: s.access.IdleTimeout,
		MaxHeaderBytes: 64 << 10,
		ConnContext: func(ctx context.Context, nc net.Conn) context.Context {
			return withCaller(ctx, s.callerOf(nc))
		},
	}
	s.remote = append(s.remote, l)
	// Handshakes start now; the connections wait for Serve.
	l.wg.Add(1)
	go l.accept()
	return raw.Addr(), nil
}

// names are the names of a connection's verified client certificate.
func (s *Server) names(cs tls.ConnectionState) []string {
	if len(cs.PeerCertificates) == 0 || s.access.Identify == nil {
		return nil
	}
	return s.access.Identify(cs.PeerCertificates[0])
}

// callerOf is the caller of a connection of a TLS listener (handshake
// done).
func (s *Server) callerOf(nc net.Conn) *Caller {
	c := &Caller{Remote: nc.RemoteAddr().String()}
	if sc, ok := nc.(*slotConn); ok {
		nc = sc.Conn
	}
	if tc, ok := nc.(*tls.Conn); ok {
		c.Names = s.names(tc.ConnectionState())
	}
	if len(c.Names) > 0 {
		c.Identity = c.Names[0]
	}
	if s.access.Roles != nil && len(c.Names) > 0 {
		c.Role = s.access.Roles(c.Names)
	}
	return c
}

// RemoteAddrs are the addresses the TLS listeners are bound to.
func (s *Server) RemoteAddrs() []net.Addr {
	var out []net.Addr
	for _, l := range s.remote {
		out = append(out, l.Addr())
	}
	return out
}

// tlsListener hands http.Server connections whose TLS handshake is done:
// each handshake in a goroutine of its own with a deadline, at most
// MaxConnections connections (handshaking or not) at once.
type tlsListener struct {
	net.Listener
	s     *Server
	tc    *tls.Config
	hs    *http.Server
	conns chan net.Conn
	slots chan struct{}
	done  chan struct{}
	// ctx ends the handshakes under way when the listener closes.
	ctx    context.Context
	cancel context.CancelFunc
	once   sync.Once
	wg     sync.WaitGroup
}

// serve accepts and handshakes until closed; http.Server serves what
// Accept hands it.
func (l *tlsListener) serve() error {
	err := l.hs.Serve(l)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

func (l *tlsListener) accept() {
	defer l.wg.Done()
	for {
		raw, err := l.Listener.Accept()
		if err != nil {
			select {
			case <-l.done:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE and the like: do not spin.
			select {
			case <-l.done:
				return
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		select {
		case l.slots <- struct{}{}:
		default:
			l.s.auditConn(raw.RemoteAddr().String(), "", string(CodeBusy),
				fmt.Sprintf("%d connections already (max_connections): connection closed", cap(l.slots)))
			raw.Close()
			continue
		}
		l.wg.Add(1)
		go l.handshake(raw)
	}
}

// handshake runs the TLS handshake of raw and hands the connection to
// Accept, or says why it was refused.
func (l *tlsListener) handshake(raw net.Conn) {
	defer l.wg.Done()
	tc := tls.Server(raw, l.tc)
	ctx, cancel := context.WithTimeout(l.ctx, l.s.access.HandshakeTimeout)
	err := tc.HandshakeContext(ctx)
	cancel()
	if err != nil {
		l.refused(raw, tc, err)
		raw.Close()
		<-l.slots
		return
	}
	c := &slotConn{Conn: tc, release: func() { <-l.slots }}
	select {
	case l.conns <- c:
	case <-l.done:
		c.Close()
	}
}

// refused logs a failed handshake: an audit line where the server
// refused the client's certificate, a plain line where the client went
// away, was too slow, or refused ours.
func (l *tlsListener) refused(raw net.Conn, tc *tls.Conn, err error) {
	remote := raw.RemoteAddr().String()
	var cv *tls.CertificateVerificationError
	switch {
	case errors.Is(err, errNoClientCert), errors.Is(err, errNoIdentity):
		l.s.auditConn(remote, "", string(CodePermission), err.Error())
	case errors.As(err, &cv):
		claimed := ""
		if len(cv.UnverifiedCertificates) > 0 {
			claimed = strings.Join(certNames(l.s, cv), ",")
		}
		l.s.auditConn(remote, claimed, string(CodePermission), "the client certificate is not trusted: "+cv.Err.Error())
	case l.ctx.Err() != nil:
		// Closing.
	case errors.Is(err, context.DeadlineExceeded):
		l.s.connLog.Log(l.s.logEntry().WithFields(log.Fields{"remote": remote, "timeout": l.s.access.HandshakeTimeout}), log.InfoLevel,
			"admin listener: TLS handshake not done in time, connection closed")
	default:
		l.s.connLog.Log(l.s.logEntry().WithFields(log.Fields{"remote": remote, "error": err.Error()}), log.InfoLevel,
			"admin listener: TLS handshake failed")
	}
}

// certNames are the names an unverified certificate claims, for the
// audit line of its refusal (so that one can see who tried).
func certNames(s *Server, cv *tls.CertificateVerificationError) []string {
	if s.access.Identify == nil {
		return nil
	}
	return s.access.Identify(cv.UnverifiedCertificates[0])
}

func (s *Server) logEntry() *log.Entry {
	if s.access.Log != nil {
		return s.access.Log
	}
	return log.L
}

// Accept hands the next connection whose handshake is done.
func (l *tlsListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting (http.Server.Shutdown calls it); handshakes
// under way end with it.
func (l *tlsListener) Close() error {
	var err error
	l.once.Do(func() {
		close(l.done)
		l.cancel()
		err = l.Listener.Close()
	})
	return err
}

// shutdown stops the listener and its connections, and waits for its
// goroutines.
func (l *tlsListener) shutdown(ctx context.Context) error {
	err := l.hs.Shutdown(ctx)
	l.Close()
	l.wg.Wait()
	return err
}

// slotConn gives its slot back when closed.
type slotConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *slotConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
