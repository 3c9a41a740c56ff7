// Who may call which route: the caller of a request (the unix socket's
// root, or an identity of a client certificate on the admin listener),
// the roles identities are given, the right each route needs, and the
// audit line of every mutating or refused request (docs/control-api.md,
// "Roles" and "Audit").

package ctl

import (
	"context"
	"crypto/x509"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
)

// Role is what an identity may do through the control API.
type Role string

const (
	// RoleNone: a certificate the CA signed, with no role: discovery
	// only.
	RoleNone Role = ""
	// RoleReader may read everything (GET).
	RoleReader Role = "reader"
	// RoleProvisioner may read, and make and remove the volumes of
	// the pools, their snapshots and their grants: what an
	// orchestrator needs (the rights of each route are package api's).
	RoleProvisioner Role = "provisioner"
	// RoleAdmin may do everything, as root on the unix socket does.
	RoleAdmin Role = "admin"
)

// Right is what a route needs of its caller's role.
type Right string

const (
	// RightDiscover: every identity whose certificate verifies.
	RightDiscover Right = "discover"
	// RightRead: reader, provisioner, admin.
	RightRead Right = "read"
	// RightProvision: provisioner, admin.
	RightProvision Right = "provision"
	// RightAdmin: admin only; what a route not in the rights table
	// needs.
	RightAdmin Right = "admin"
)

// rolesWith are the roles that have each right, for the refusal's
// message.
var rolesWith = map[Right][]Role{
	RightDiscover:  {RoleNone, RoleReader, RoleProvisioner, RoleAdmin},
	RightRead:      {RoleReader, RoleProvisioner, RoleAdmin},
	RightProvision: {RoleProvisioner, RoleAdmin},
	RightAdmin:     {RoleAdmin},
}

// Has reports whether role r has right x. An unknown right is admin's.
func (r Role) Has(x Right) bool {
	roles, ok := rolesWith[x]
	if !ok {
		roles = rolesWith[RightAdmin]
	}
	for _, o := range roles {
		if o == r {
			return true
		}
	}
	return false
}

// reserved reports whether r may take the connections of the TLS
// listeners kept for the roles that change things: admin, provisioner.
func (r Role) reserved() bool { return r == RoleAdmin || r == RoleProvisioner }

func (r Role) String() string {
	if r == RoleNone {
		return "none"
	}
	return string(r)
}

// LocalIdentity is the identity of a caller on the unix socket, which
// only root can reach: an admin.
const LocalIdentity = "local"

// Caller is who sent a request.
type Caller struct {
	// Identity is the name of the client certificate that gave its
	// role, or its first name if none did (as the fabric's session
	// peers are named), or LocalIdentity.
	Identity string
	// Names are all the certificate's names (tcp.CertNames): what
	// roles and grants match. None for the unix socket.
	Names []string
	// Remote is the peer's address, or "unix".
	Remote string
	Role   Role
	// Local: the unix socket.
	Local bool
	// refused: a certificate refused at every request, as its names
	// give different roles (Access.Roles).
	refused error
}

type callerKey struct{}

// CallerOf is the caller of a request the control API serves; a request
// that came another way (a test calling a handler) is the local root.
func CallerOf(r *http.Request) Caller {
	if c, ok := r.Context().Value(callerKey{}).(*Caller); ok {
		return *c
	}
	return localCaller
}

var localCaller = Caller{Identity: LocalIdentity, Remote: "unix", Role: RoleAdmin, Local: true}

func withCaller(ctx context.Context, c *Caller) context.Context {
	return context.WithValue(ctx, callerKey{}, c)
}

// Access is how a Server admits requests: the right of each route, the
// roles of identities, the audit log, and the bounds of its TLS
// listeners. The zero value lets the unix socket's root do everything
// and audits nothing (rnbd-client's daemon).
type Access struct {
	// Rights gives the right a route's pattern ("POST /v1/exports")
	// needs; "" or a nil Rights: RightAdmin, so that a route no one
	// thought of is safe.
	Rights func(pattern string) Right
	// Roles gives the role of a certificate's names and the name that
	// gave it ("": none did); an error for names that give different
	// roles, a certificate then refused at every request (nil Roles:
	// no role).
	Roles func(names []string) (role Role, by string, err error)
	// Identify gives the names of a verified client certificate
	// (tcp.CertNames: as the fabric names its peers).
	Identify func(*x509.Certificate) []string
	// Log gets the audit lines ("audit") and the listeners' refusals;
	// nil: no audit.
	Log *log.Entry
	// HandshakeTimeout bounds a TLS handshake; ReadHeaderTimeout a
	// request's header; IdleTimeout a kept-alive connection between
	// requests.
	HandshakeTimeout, ReadHeaderTimeout, IdleTimeout time.Duration
	// MaxConnections bounds the connections of the TLS listeners
	// together whose handshake is done; half is kept for admins and
	// provisioners (admission.go). One more is refused unavailable.
	MaxConnections int
	// MaxHandshakesPerAddress bounds the TLS handshakes under way from
	// one address (an IPv6 /64); one more is closed at once.
	// MaxHandshakes bounds them all (0: 4 × MaxConnections); one more
	// closes the oldest of the address with the most.
	MaxHandshakesPerAddress, MaxHandshakes int
	// MaxRequestsPerIdentity bounds the requests one identity has under
	// way on the TLS listeners; one more is refused unavailable.
	MaxRequestsPerIdentity int
	// MaxBodySize bounds a request's body; a larger one is refused
	// invalid_argument.
	MaxBodySize int64
}

// Defaults of Access's bounds. DefaultMaxRequestsPerIdentity is twice
// what rnbd-csi's controller has under way on one storage node at most
// (16): room for a second controller during a leader's handover, and no
// more than the connections kept for admins and provisioners (half of
// DefaultMaxConnections), so that one identity cannot hold them all.
const (
	DefaultHandshakeTimeout        = 2 * time.Second
	DefaultReadHeaderTimeout       = 10 * time.Second
	DefaultIdleTimeout             = 2 * time.Minute
	DefaultMaxConnections          = 64
	DefaultMaxHandshakesPerAddress = 32
	DefaultMaxRequestsPerIdentity  = 32
	DefaultMaxBodySize             = 1 << 20
)

// DefaultAdminPort is the admin listener's port where an address names
// none (the fabric's is 1234).
const DefaultAdminPort = 1235

// SetAccess sets how requests are admitted; before Serve. Zero bounds
// are the defaults.
func (s *Server) SetAccess(a Access) {
	if a.HandshakeTimeout <= 0 {
		a.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if a.ReadHeaderTimeout <= 0 {
		a.ReadHeaderTimeout = DefaultReadHeaderTimeout
	}
	if a.IdleTimeout <= 0 {
		a.IdleTimeout = DefaultIdleTimeout
	}
	if a.MaxConnections <= 0 {
		a.MaxConnections = DefaultMaxConnections
	}
	if a.MaxHandshakesPerAddress <= 0 {
		a.MaxHandshakesPerAddress = DefaultMaxHandshakesPerAddress
	}
	if a.MaxHandshakes <= 0 {
		a.MaxHandshakes = 4 * a.MaxConnections
	}
	if a.MaxRequestsPerIdentity <= 0 {
		a.MaxRequestsPerIdentity = DefaultMaxRequestsPerIdentity
	}
	if a.MaxBodySize <= 0 {
		a.MaxBodySize = DefaultMaxBodySize
	}
	s.access = a
	s.adm.setBounds(a)
}

// rightOf is the right pattern needs.
func (s *Server) rightOf(pattern string) Right {
	if s.access.Rights == nil {
		return RightAdmin
	}
	if x := s.access.Rights(pattern); x != "" {
		return x
	}
	return RightAdmin
}

// mutating reports whether a request of method changes something: what
// the audit log records.
func mutating(method string) bool {
	return method != http.MethodGet && method != http.MethodHead && method != http.MethodOptions
}

// admit runs h for r if its caller may call pattern and has a request
// slot, and writes the audit line of a mutating or refused request.
func (s *Server) admit(pattern string, h Handler, r *http.Request) (any, error) {
	c := CallerOf(r)
	if c.refused != nil {
		s.audit(c, r, c.refused)
		return nil, c.refused
	}
	need := s.rightOf(pattern)
	if !c.Role.Has(need) {
		err := Errorf(CodePermission, "identity %s (role %s) may not %s %s: the route needs the %s right, which roles %s have",
			c.Identity, c.Role, r.Method, r.URL.Path, need, roleList(need))
		s.audit(c, r, err)
		return nil, err
	}
	if !c.Local {
		release, err := s.slots.take(c.Identity, s.access.MaxRequestsPerIdentity)
		if err != nil {
			s.audit(c, r, err)
			return nil, err
		}
		defer release()
	}
	limit := s.access.MaxBodySize
	if limit <= 0 {
		limit = DefaultMaxBodySize
	}
	if r.Body != nil {
		r.Body = http.MaxBytesReader(nil, r.Body, limit)
	}
	r = r.WithContext(context.WithValue(r.Context(), bodyLimitKey{}, limit))
	v, err := h(r)
	if mutating(r.Method) {
		s.audit(c, r, err)
	}
	return v, err
}

func roleList(x Right) string {
	var s []string
	for _, r := range rolesWith[x] {
		if r != RoleNone {
			s = append(s, string(r))
		}
	}
	if x == RightDiscover {
		s = append(s, "and any certificate of the CA")
	}
	return strings.Join(s, ", ")
}

// AuditMsg is the message of an audit line (docs/control-api.md,
// "Audit").
const AuditMsg = "audit"

// audit logs one request's audit line: who, from where, what, and ok or
// the error's class.
func (s *Server) audit(c Caller, r *http.Request, err error) {
	if s.access.Log == nil {
		return
	}
	e := s.access.Log.WithFields(log.Fields{"identity": c.Identity, "remote": c.Remote, "method": r.Method,
		"object": r.URL.Path, "role": c.Role.String()})
	if err != nil {
		e.WithFields(log.Fields{"result": string(Classify(err)), "error": err.Error()}).Warn(AuditMsg)
		return
	}
	e.WithField("result", "ok").Info(AuditMsg)
}

// auditConn logs the audit line of a connection refused before any
// request: a handshake without a certificate, with an untrusted one, in
// an older TLS or none, one over the bounds on handshakes or
// connections (with the identity and role it proved, if it did). Rate
// limited: anyone can connect.
func (s *Server) auditConn(remote, identity, role, result, why string) {
	if s.access.Log == nil {
		return
	}
	f := log.Fields{"identity": identity, "remote": remote, "method": "CONNECT", "object": "tls", "result": result, "error": why}
	if role != "" {
		f["role"] = role
	}
	s.connLog.Log(s.access.Log.WithFields(f), log.WarnLevel, AuditMsg)
}

// slots counts each identity's requests under way.
type slots struct {
	mu sync.Mutex
	// +checklocks:mu
	n map[string]int
}

// take takes a slot of identity, or refuses busy past max.
func (sl *slots) take(identity string, max int) (release func(), err error) {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	if sl.n == nil {
		sl.n = map[string]int{}
	}
	if max > 0 && sl.n[identity] >= max {
		e := Errorf(CodeUnavailable, "identity %s has %d requests under way, the most the admin listener allows one identity "+
			"(max_requests_per_identity): try again when one has ended", identity, sl.n[identity])
		e.retryAfter = retryAfterSeconds
		return nil, e
	}
	sl.n[identity]++
	return func() {
		sl.mu.Lock()
		defer sl.mu.Unlock()
		if sl.n[identity]--; sl.n[identity] == 0 {
			delete(sl.n, identity)
		}
	}, nil
}

// bodyLimitKey is the context key of the bound admit put on a
// request's body (MaxBodySize).
type bodyLimitKey struct{}

// bodyLimit is the bound on r's body: admit's, or DefaultMaxBodySize
// for a request that did not pass it.
func bodyLimit(r *http.Request) int64 {
	if n, ok := r.Context().Value(bodyLimitKey{}).(int64); ok && n > 0 {
		return n
	}
	return DefaultMaxBodySize
}

// bodyTooLarge is the error of a body over limit bytes.
func bodyTooLarge(limit int64) error {
	return Errorf(CodeInvalid, "request body larger than %d bytes, the most the control API takes", limit)
}
