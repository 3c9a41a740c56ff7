package ctl

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testca"
)

// TestRoleRights: each role has the rights of docs/control-api.md's
// table, and an unknown right is the admin's.
func TestRoleRights(t *testing.T) {
	want := map[Role][]Right{
		RoleNone:        {RightDiscover},
		RoleReader:      {RightDiscover, RightRead},
		RoleProvisioner: {RightDiscover, RightRead, RightProvision},
		RoleAdmin:       {RightDiscover, RightRead, RightProvision, RightAdmin, "something new"},
	}
	for role, has := range want {
		for _, x := range []Right{RightDiscover, RightRead, RightProvision, RightAdmin, "something new"} {
			got := role.Has(x)
			exp := false
			for _, h := range has {
				exp = exp || h == x
			}
			if got != exp {
				t.Errorf("role %s has %s: %v, want %v", role, x, got, exp)
			}
		}
	}
}

// auditLog is a JSON log the test reads back.
type auditLog struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *auditLog) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(b)
}

// lines are the log's lines with msg.
func (l *auditLog) lines(msg string) []map[string]any {
	l.mu.Lock()
	s := l.buf.String()
	l.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil && m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// has reports whether an audit line has every field of want.
func (l *auditLog) has(want map[string]string) bool {
	for _, m := range l.lines(AuditMsg) {
		ok := true
		for k, v := range want {
			if s, _ := m[k].(string); !strings.Contains(s, v) {
				ok = false
			}
		}
		if ok {
			return true
		}
	}
	return false
}

// testRoles are the roles of the rig's identities.
var testRoles = map[string]Role{"alice": RoleAdmin, "paul": RoleProvisioner, "rita": RoleReader, "ops": RoleAdmin, "mon": RoleReader}

type accessRig struct {
	s       *Server
	ca      *testca.CA
	addr    string
	log     *auditLog
	release chan struct{}
	sock    string
}

// newAccessRig serves a small API on a socket and a TLS listener: a
// rights table of a read route, a provision route, a discover route, an
// admin route (in no table) and a slow read route; roles by common name.
func newAccessRig(t *testing.T, a Access) *accessRig {
	t.Helper()
	r := &accessRig{ca: testca.New(t, "ctl-test-ca"), log: &auditLog{}, release: make(chan struct{}),
		sock: filepath.Join(t.TempDir(), "s.sock")}
	var err error
	if r.s, err = Listen(r.sock); err != nil {
		t.Fatal(err)
	}
	lg := logrus.New()
	lg.SetOutput(r.log)
	lg.SetFormatter(&logrus.JSONFormatter{})
	a.Log = logrus.NewEntry(lg)
	a.Rights = func(p string) Right {
		return map[string]Right{"GET /v1/things": RightRead, "GET /v1/slow": RightRead, "POST /v1/things": RightProvision,
			"GET /v1/discover": RightDiscover}[p]
	}
	a.Roles = func(names []string) (Role, string, error) {
		var role Role
		by := ""
		for _, n := range names {
			r, ok := testRoles[n]
			switch {
			case !ok:
			case by == "":
				role, by = r, n
			case r != role:
				return RoleNone, "", fmt.Errorf("names of roles %s and %s", role, r)
			}
		}
		return role, by, nil
	}
	a.Identify = func(c *x509.Certificate) []string {
		var names []string
		if c.Subject.CommonName != "" {
			names = append(names, c.Subject.CommonName)
		}
		return append(names, c.DNSNames...)
	}
	r.s.SetAccess(a)
	r.s.Handle("GET /v1/things", func(*http.Request) (any, error) { return []string{"a"}, nil })
	r.s.Handle("POST /v1/things", func(req *http.Request) (any, error) {
		var v map[string]string
		return nil, Decode(req, &v)
	})
	r.s.Handle("PUT /v1/names/{name}", func(*http.Request) (any, error) { return nil, nil })
	r.s.Handle("GET /v1/discover", func(req *http.Request) (any, error) { return CallerOf(req).Identity, nil })
	r.s.Handle("GET /v1/slow", func(*http.Request) (any, error) {
		<-r.release
		return nil, nil
	})
	srv := r.ca.Issue(t, "srv", "127.0.0.1")
	bound, err := r.s.ListenTLS("127.0.0.1:0", r.ca.Config(srv))
	if err != nil {
		t.Fatal(err)
	}
	r.addr = "https://" + bound.String()
	served := make(chan error, 1)
	go func() { served <- r.s.Serve() }()
	t.Cleanup(func() {
		if err := r.s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return r
}

// client is a client of the rig's TLS listener with a certificate of
// cn (and DNS names sans) from ca (nil: none), trusting the rig's CA.
func (r *accessRig) client(t *testing.T, ca *testca.CA, cn string, sans ...string) *Client {
	t.Helper()
	tc := &tls.Config{RootCAs: r.ca.Pool()}
	if ca != nil {
		// Presented whoever signed it, as conf.TLS's is (Certificates
		// would be held back from a server that names other CAs).
		cert := ca.Issue(t, cn, sans...)
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }
	}
	c, err := DialTLS(r.addr, tc)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func call(c *Client, method, path string, body any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.Do(ctx, method, path, body, nil)
}

// wantRefused checks an error's class and that it says what it must.
func wantRefused(t *testing.T, what string, err error, code Code, says ...string) {
	t.Helper()
	if Classify(err) != code {
		t.Fatalf("%s: %v (%s), want %s", what, err, Classify(err), code)
	}
	for _, s := range says {
		if !strings.Contains(err.Error(), s) {
			t.Fatalf("%s: %q does not say %q", what, err, s)
		}
	}
}

// TestAccessRoles: each route takes the callers its right allows and
// refuses the others with permission_denied naming the identity, its
// role and the right; every mutating or refused request has its audit
// line, the unix socket's as "local".
func TestAccessRoles(t *testing.T) {
	r := newAccessRig(t, Access{})
	body := map[string]string{"k": "v"}
	rita, paul, alice, nobody := r.client(t, r.ca, "rita"), r.client(t, r.ca, "paul"), r.client(t, r.ca, "alice"), r.client(t, r.ca, "nobody")

	if err := call(rita, "GET", "/v1/things", nil); err != nil {
		t.Fatalf("a reader's GET: %v", err)
	}
	wantRefused(t, "a reader's POST", call(rita, "POST", "/v1/things", body), CodePermission,
		"identity rita (role reader) may not POST /v1/things", "the provision right", "provisioner")
	if err := call(paul, "POST", "/v1/things", body); err != nil {
		t.Fatalf("a provisioner's POST: %v", err)
	}
	wantRefused(t, "a provisioner's PUT of a route in no table", call(paul, "PUT", "/v1/names/x", nil), CodePermission,
		"identity paul (role provisioner) may not PUT /v1/names/x", "the admin right")
	if err := call(alice, "PUT", "/v1/names/x", nil); err != nil {
		t.Fatalf("an admin's PUT: %v", err)
	}
	wantRefused(t, "a GET by a certificate without a role", call(nobody, "GET", "/v1/things", nil), CodePermission,
		"identity nobody (role none) may not GET /v1/things")
	var who string
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := nobody.Do(ctx, "GET", "/v1/discover", nil, &who); err != nil || who != "nobody" {
		t.Fatalf("discover by a certificate without a role: %q %v", who, err)
	}
	if err := call(Dial(r.sock), "POST", "/v1/things", body); err != nil {
		t.Fatalf("the socket's POST: %v", err)
	}

	for _, w := range []map[string]string{
		{"identity": "rita", "method": "POST", "object": "/v1/things", "result": "permission_denied", "role": "reader"},
		{"identity": "paul", "method": "POST", "object": "/v1/things", "result": "ok"},
		{"identity": "paul", "method": "PUT", "object": "/v1/names/x", "result": "permission_denied"},
		{"identity": "alice", "method": "PUT", "object": "/v1/names/x", "result": "ok"},
		{"identity": "nobody", "method": "GET", "object": "/v1/things", "result": "permission_denied"},
		{"identity": "local", "remote": "unix", "method": "POST", "object": "/v1/things", "result": "ok"},
		{"remote": "127.0.0.1:"},
	} {
		if !r.log.has(w) {
			t.Errorf("no audit line %v in\n%s", w, r.log.buf.String())
		}
	}
	// A read that is allowed is not audited.
	if r.log.has(map[string]string{"identity": "rita", "method": "GET"}) {
		t.Errorf("an allowed GET was audited")
	}
}

// TestAccessRefusedHandshakes: no client certificate, one of another
// CA, a server certificate the client does not trust: each a clear
// error, the server's two an audit line.
func TestAccessRefusedHandshakes(t *testing.T) {
	r := newAccessRig(t, Access{})
	wantRefused(t, "no certificate", call(r.client(t, nil, ""), "GET", "/v1/discover", nil), CodePermission,
		"the server refused our certificate")
	other := testca.New(t, "other-ca")
	wantRefused(t, "a certificate of another CA", call(r.client(t, other, "alice"), "GET", "/v1/discover", nil), CodePermission,
		"the server refused our certificate")
	defer func() {
		if t.Failed() {
			t.Log(r.log.buf.String())
		}
	}()
	kit.WaitFor(t, 10*time.Second, "the audit lines of the refused handshakes", func() bool {
		return r.log.has(map[string]string{"object": "tls", "result": "permission_denied", "error": "presented no certificate"}) &&
			r.log.has(map[string]string{"object": "tls", "result": "permission_denied", "identity": "alice", "error": "not trusted"})
	})

	c, err := DialTLS(r.addr, &tls.Config{RootCAs: other.Pool(), Certificates: []tls.Certificate{r.ca.Issue(t, "alice")}})
	if err != nil {
		t.Fatal(err)
	}
	wantRefused(t, "a server certificate of another CA", call(c, "GET", "/v1/discover", nil), CodePermission,
		"the server's certificate is not trusted")

	// Nothing listening: unavailable, saying so.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	c, _ = DialTLS("https://"+l.Addr().String(), &tls.Config{RootCAs: r.ca.Pool()})
	err = call(c, "GET", "/v1/discover", nil)
	wantRefused(t, "nothing listening", err, CodeUnavailable, "nothing listens there")
	if !errors.Is(err, ErrNotRunning) {
		t.Errorf("nothing listening: %v is not ErrNotRunning", err)
	}

	if _, err := DialTLS("http://127.0.0.1:1", &tls.Config{}); Classify(err) != CodeInvalid {
		t.Errorf("DialTLS of http://: %v, want invalid_argument", err)
	}
	if _, err := (&Server{}).ListenTLS("127.0.0.1:0", &tls.Config{}); err == nil {
		t.Errorf("ListenTLS without a CA for clients: no error")
	}
}

// TestAccessBounds: one identity's requests past the bound are refused
// busy, a body past the bound invalid_argument, connections past the
// bound closed; each said and logged.
func TestAccessBounds(t *testing.T) {
	r := newAccessRig(t, Access{MaxRequestsPerIdentity: 1, MaxBodySize: 4096, MaxConnections: 3, HandshakeTimeout: 5 * time.Second})
	rita := r.client(t, r.ca, "rita")
	slow, slowRita := make(chan error, 1), r.client(t, r.ca, "rita")
	go func() { slow <- call(slowRita, "GET", "/v1/slow", nil) }()
	kit.WaitFor(t, 10*time.Second, "rita's slow request to be under way", func() bool {
		r.s.slots.mu.Lock()
		defer r.s.slots.mu.Unlock()
		return r.s.slots.n["rita"] == 1
	})
	wantRefused(t, "a second request of rita's", call(rita, "GET", "/v1/things", nil), CodeUnavailable,
		"identity rita has 1 requests under way", "max_requests_per_identity")
	// Another identity is not held up by rita's.
	paul := r.client(t, r.ca, "paul")
	if err := call(paul, "GET", "/v1/things", nil); err != nil {
		t.Fatalf("paul's GET beside rita's: %v", err)
	}
	close(r.release)
	if err := <-slow; err != nil {
		t.Fatalf("the slow request: %v", err)
	}
	if !r.log.has(map[string]string{"identity": "rita", "result": "unavailable"}) {
		t.Errorf("no audit line of the busy refusal:\n%s", r.log.buf.String())
	}

	// The three connections so far closed and their places free: the
	// next client's is not one past max_connections (3).
	for _, c := range []*Client{rita, slowRita, paul} {
		c.Close()
	}
	kit.WaitFor(t, 10*time.Second, "the clients' connections to be released", func() bool { _, n, _ := r.s.adm.counts(); return n == 0 })
	big := map[string]string{"k": strings.Repeat("x", 8192)}
	wantRefused(t, "a body past max_body_size", call(r.client(t, r.ca, "paul"), "POST", "/v1/things", big), CodeInvalid,
		"request body larger than 4096 bytes")
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestAccessHandshakeTimeout: a connection that does not handshake in
// time is closed, and says so in the log.
func TestAccessHandshakeTimeout(t *testing.T) {
	r := newAccessRig(t, Access{HandshakeTimeout: 200 * time.Millisecond})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.addr, "https://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("a connection without a handshake: read %v, want it closed", err)
	}
	kit.WaitFor(t, 5*time.Second, "the log line", func() bool {
		return len(r.log.lines("admin listener: TLS handshake not done in time, connection closed")) == 1
	})
}
