// The control API on TCP: TLS 1.3 only, a client certificate of the CA
// required, handshakes done before a connection reaches HTTP, and the
// caller named by its certificate. What a peer can hold is bounded in
// two stages (docs/control-api.md, "Bounds"): a socket still
// handshaking has proved nothing, and is bounded by its address and by
// a short deadline; a connection that proved an identity counts against
// max_connections, of which the roles other than admin and provisioner
// may hold only their share (admission.go).

package ctl

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
)

// errNoClientCert refuses a TLS client that presents no certificate.
var errNoClientCert = errors.New("the client presented no certificate (the admin listener requires one of its CA)")

// errNoIdentity refuses a client certificate that names no identity.
var errNoIdentity = errors.New("the client certificate names no identity (no common name, no DNS, URI or e-mail name)")

// clientHandshakeTimeout bounds a client's TLS handshake (DialTLS): more
// than a server allows, so that the server's bound is the one a slow
// network meets.
const clientHandshakeTimeout = 10 * time.Second

// refuseWait is how long a connection refused after its handshake (past
// max_connections) has to send its request's header, which is answered
// unavailable, before it is closed without an answer.
const refuseWait = time.Second

// ListenTLS listens on addr (HOST:PORT) for the control API in TLS 1.3:
// tc has the server's certificate and the CA of clients (ClientCAs),
// each of which must present a certificate it verifies that names an
// identity. It serves from Serve on, with the bounds of SetAccess, which
// must come first. It returns the address bound.
func (s *Server) ListenTLS(addr string, tc *tls.Config) (net.Addr, error) {
	if tc == nil || tc.ClientCAs == nil {
		return nil, fmt.Errorf("admin listener %s: no CA for client certificates: the control API is never served on the network without them", addr)
	}
	if s.access.MaxConnections <= 0 {
		s.SetAccess(s.access) // the default bounds
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
	// The versions a client offers, for the audit line of one that
	// offers no TLS 1.3 (the handshake's error does not say).
	prev := c.GetConfigForClient
	c.GetConfigForClient = func(chi *tls.ClientHelloInfo) (*tls.Config, error) {
		if hc, ok := chi.Conn.(*helloConn); ok {
			hc.versions = slices.Clone(chi.SupportedVersions)
		}
		if prev != nil {
			return prev(chi)
		}
		return nil, nil
	}
	raw, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("admin listener %s: %w", addr, err)
	}
	l := &tlsListener{Listener: raw, s: s, tc: c, conns: make(chan net.Conn), done: make(chan struct{})}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.hs = &http.Server{Handler: s.mux, ReadHeaderTimeout: s.access.ReadHeaderTimeout, IdleTimeout: s.access.IdleTimeout,
		MaxHeaderBytes: 64 << 10,
		ConnContext: func(ctx context.Context, nc net.Conn) context.Context {
			if ac, ok := nc.(*authConn); ok {
				return withCaller(context.WithValue(ctx, connKey{}, ac), ac.caller)
			}
			return withCaller(ctx, &Caller{Remote: nc.RemoteAddr().String()})
		},
		ConnState: func(nc net.Conn, st http.ConnState) {
			if ac, ok := nc.(*authConn); ok {
				s.adm.state(ac, st)
			}
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

// callerOf is the caller of a TLS connection whose handshake is done:
// its names, its role and the name that gave it (Access.Roles). A
// certificate whose names give different roles is refused at every
// request; the first time it is seen, a warning says so.
func (s *Server) callerOf(tc *tls.Conn, remote string) *Caller {
	c := &Caller{Remote: remote, Names: s.names(tc.ConnectionState())}
	if len(c.Names) == 0 {
		return c
	}
	c.Identity = c.Names[0]
	if s.access.Roles == nil {
		return c
	}
	role, by, err := s.access.Roles(c.Names)
	if err != nil {
		c.refused = Errorf(CodePermission, "the client certificate (%s) is refused: %v", strings.Join(c.Names, ", "), err)
		s.conflictSeen(c.Names, remote, err)
		return c
	}
	c.Role = role
	if by != "" {
		c.Identity = by
	}
	return c
}

// maxConflictsRemembered bounds the certificates whose conflict was
// warned of: past it, each sight is warned of again (rate limited).
const maxConflictsRemembered = 1024

// conflictSeen warns, the first time, of a certificate whose names give
// different roles.
func (s *Server) conflictSeen(names []string, remote string, err error) {
	key := strings.Join(names, "\x00")
	s.conflictMu.Lock()
	seen := s.conflicts[key]
	if !seen && len(s.conflicts) < maxConflictsRemembered {
		if s.conflicts == nil {
			s.conflicts = map[string]bool{}
		}
		s.conflicts[key] = true
	}
	full := len(s.conflicts) >= maxConflictsRemembered
	s.conflictMu.Unlock()
	if seen {
		return
	}
	e := s.logEntry().WithFields(log.Fields{"names": strings.Join(names, ","), "remote": remote, "error": err.Error()})
	const msg = "admin listener: a client certificate whose names give different roles: every request of it is refused"
	if full {
		s.connLog.Log(e, log.WarnLevel, msg)
		return
	}
	e.Warn(msg)
}

// RemoteAddrs are the addresses the TLS listeners are bound to.
func (s *Server) RemoteAddrs() []net.Addr {
	var out []net.Addr
	for _, l := range s.remote {
		out = append(out, l.Addr())
	}
	return out
}

// tlsListener hands http.Server connections whose TLS handshake is done
// and which the admission took: each handshake in a goroutine of its
// own with a deadline.
type tlsListener struct {
	net.Listener
	s     *Server
	tc    *tls.Config
	hs    *http.Server
	conns chan net.Conn
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
		p, victim := l.s.adm.startHandshake(raw)
		if victim != nil {
			victim.Close()
			l.s.auditConn(victim.RemoteAddr().String(), "", "", string(CodeUnavailable),
				"TLS handshake not done when a newer one of its address, or of all, needed its place "+
					"(max_handshakes_per_address, or 4 × max_connections): connection closed")
		}
		l.wg.Add(1)
		go l.handshake(raw, p)
	}
}

// helloConn is a connection in its handshake, with the TLS versions its
// client offered.
type helloConn struct {
	net.Conn
	versions []uint16
}

// handshake runs the TLS handshake of raw, admits the connection (or
// refuses it) and hands it to Accept, or says why it was refused.
func (l *tlsListener) handshake(raw net.Conn, p *pending) {
	defer l.wg.Done()
	hc := &helloConn{Conn: raw}
	tc := tls.Server(hc, l.tc)
	ctx, cancel := context.WithTimeout(l.ctx, l.s.access.HandshakeTimeout)
	err := tc.HandshakeContext(ctx)
	cancel()
	if err != nil {
		evicted := l.s.adm.endHandshake(p)
		if !evicted {
			l.refused(raw, hc, err)
		}
		raw.Close()
		return
	}
	remote := raw.RemoteAddr().String()
	ac := &authConn{Conn: tc, raw: raw, adm: &l.s.adm}
	ac.caller = l.s.callerOf(tc, remote)
	ac.low = !ac.caller.Role.reserved() || ac.caller.refused != nil
	victim, why := l.s.adm.admit(p, ac)
	if victim != nil {
		victim.raw.Close()
		l.s.connLog.Log(l.s.logEntry().WithFields(log.Fields{"remote": victim.caller.Remote, "identity": victim.caller.Identity,
			"role": victim.caller.Role.String()}), log.InfoLevel,
			"admin listener: an idle connection of a role other than admin and provisioner closed, to make room for a new one (max_connections)")
	}
	if why != "" {
		if why != evictedHandshake {
			l.s.auditConn(remote, ac.caller.Identity, ac.caller.Role.String(), string(CodeUnavailable), why)
			answerRefused(tc, raw, why)
		}
		raw.Close()
		l.s.adm.endHandshake(p)
		return
	}
	select {
	case l.conns <- ac:
	case <-l.done:
		ac.Close()
	}
}

// answerRefused answers the request of a connection refused after its
// handshake unavailable (503, Retry-After), if its header comes within
// refuseWait, so that the client learns why and when to try again.
func answerRefused(tc *tls.Conn, raw net.Conn, why string) {
	raw.SetDeadline(time.Now().Add(refuseWait))
	if _, err := http.ReadRequest(bufio.NewReader(io.LimitReader(tc, 64<<10))); err != nil {
		return
	}
	body, _ := json.Marshal(&Error{Code: CodeUnavailable, Message: why + ": try again later"})
	body = append(body, '\n')
	fmt.Fprintf(tc, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: %d\r\nConnection: close\r\n"+
		"Content-Length: %d\r\n\r\n%s", retryAfterSeconds, len(body), body)
	// Whatever else the client sends is read, not left to make the
	// close a reset that could lose the answer.
	tc.CloseWrite()
	io.Copy(io.Discard, io.LimitReader(tc, 1<<20))
}

// refused logs a failed handshake: an audit line where the server
// refused the client (its certificate, a version of TLS older than 1.3,
// a client that does not speak TLS), a plain line where the client went
// away, was too slow, or refused ours.
func (l *tlsListener) refused(raw net.Conn, hc *helloConn, err error) {
	remote := raw.RemoteAddr().String()
	var cv *tls.CertificateVerificationError
	var rh tls.RecordHeaderError
	switch {
	case errors.Is(err, errNoClientCert), errors.Is(err, errNoIdentity):
		l.s.auditConn(remote, "", "", string(CodePermission), err.Error())
	case errors.As(err, &cv):
		claimed := ""
		if len(cv.UnverifiedCertificates) > 0 {
			claimed = strings.Join(certNames(l.s, cv), ",")
		}
		l.s.auditConn(remote, claimed, "", string(CodePermission), "the client certificate is not trusted: "+cv.Err.Error())
	case errors.As(err, &rh):
		l.s.auditConn(remote, "", "", string(CodePermission),
			"the client does not speak TLS (plaintext HTTP?): the admin listener takes TLS 1.3 only, with a client certificate (https://)")
		if rh.Conn != nil {
			// As http.Server answers plaintext on its TLS port.
			rh.Conn.SetWriteDeadline(time.Now().Add(time.Second))
			io.WriteString(rh.Conn, "HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"+
				"the admin listener takes TLS 1.3 only, with a client certificate: use https://\n")
		}
	case hc.versions != nil && !slices.Contains(hc.versions, tls.VersionTLS13):
		l.s.auditConn(remote, "", "", string(CodePermission), fmt.Sprintf("the client offered %s only: the admin listener takes TLS 1.3 only",
			versionNames(hc.versions)))
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

// versionNames names TLS versions ("TLS 1.2, TLS 1.1").
func versionNames(vs []uint16) string {
	var s []string
	for _, v := range vs {
		s = append(s, tls.VersionName(v))
	}
	return strings.Join(s, ", ")
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
