package ctl

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/test/kit"
)

// The admission of the TLS listeners' connections (admission.go): the
// denials of issue 40 on a small scale, each against the bound it
// defeats.

// host is the rig's TLS listener's HOST:PORT.
func (r *accessRig) host() string { return strings.TrimPrefix(r.addr, "https://") }

// dialFrom opens a TCP socket to the rig's TLS listener from the
// loopback address 127.0.0.n (the clients of the rig come from
// 127.0.0.1), closed at the end of the test.
func (r *accessRig) dialFrom(t *testing.T, n int) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(n))}}
	c, err := d.Dial("tcp", r.host())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// tlsFrom is a TLS connection to the rig's listener from 127.0.0.n with
// a certificate of cn, its handshake done; closed at the end of the
// test.
func (r *accessRig) tlsFrom(t *testing.T, n int, cn string) *tls.Conn {
	t.Helper()
	cert := r.ca.Issue(t, cn)
	c := tls.Client(r.dialFrom(t, n), &tls.Config{RootCAs: r.ca.Pool(), ServerName: "127.0.0.1", NextProtos: []string{"http/1.1"},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.HandshakeContext(ctx); err != nil {
		t.Fatalf("handshake as %s: %v", cn, err)
	}
	return c
}

// closedWithin reports whether the server closes c within d: a read that
// ends, not one that times out.
func closedWithin(c net.Conn, d time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(d))
	defer c.SetReadDeadline(time.Time{})
	_, err := io.Copy(io.Discard, c)
	return !isTimeout(err)
}

// waitCounts waits for the admission's handshakes under way and
// connections taken to be what cond wants.
func (r *accessRig) waitCounts(t *testing.T, what string, cond func(handshakes, conns, low int) bool) {
	t.Helper()
	kit.WaitFor(t, 10*time.Second, what, func() bool { return cond(r.s.adm.counts()) })
}

// rawGet writes a GET of path on c and reads the answer.
func rawGet(t *testing.T, c net.Conn, path string) *http.Response {
	t.Helper()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", path); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	resp.Body = io.NopCloser(strings.NewReader(readAll(resp.Body)))
	return resp
}

func readAll(r io.Reader) string {
	b, _ := io.ReadAll(r)
	return string(b)
}

// TestAccessHandshakesNotCounted: sockets that never handshake, more
// than max_connections and than MaxHandshakes, take no connection: the
// clients that prove an identity are served beside them, the oldest of
// them made way for the newer ones, and none stays past
// handshake_timeout.
func TestAccessHandshakesNotCounted(t *testing.T) {
	r := newAccessRig(t, Access{MaxConnections: 2, HandshakeTimeout: 3 * time.Second})
	var idle []net.Conn
	for i := range 20 {
		idle = append(idle, r.dialFrom(t, 2+i%4))
	}
	// At most MaxHandshakes (4 × 2) under way: the 12 oldest made way.
	r.waitCounts(t, "8 handshakes under way", func(h, _, _ int) bool { return h == 8 })
	for _, who := range []string{"paul", "alice", "rita"} {
		c := r.client(t, r.ca, who)
		if err := call(c, "GET", "/v1/things", nil); err != nil {
			t.Fatalf("%s's GET beside 20 sockets that never handshake: %v", who, err)
		}
		c.Close()
		r.waitCounts(t, "no connection", func(_, n, _ int) bool { return n == 0 })
	}
	closed := 0
	for _, c := range idle[:12] {
		if closedWithin(c, time.Second) {
			closed++
		}
	}
	if closed != 12 {
		t.Errorf("%d of the 12 oldest sockets closed to make way for newer ones, want 12", closed)
	}
	for i, c := range idle[12:] {
		if !closedWithin(c, 5*time.Second) {
			t.Errorf("socket %d still open after handshake_timeout", 12+i)
		}
	}
	r.waitCounts(t, "no handshake under way", func(h, _, _ int) bool { return h == 0 })
}

// TestAccessHandshakesPerAddress: one address has at most
// max_handshakes_per_address handshakes under way; one more is closed at
// once, with an audit line; other addresses are not held up.
func TestAccessHandshakesPerAddress(t *testing.T) {
	r := newAccessRig(t, Access{MaxHandshakesPerAddress: 2, HandshakeTimeout: 5 * time.Second})
	first := r.dialFrom(t, 2)
	second := r.dialFrom(t, 2)
	r.waitCounts(t, "2 handshakes under way", func(h, _, _ int) bool { return h == 2 })
	// A third of 127.0.0.2 takes the place of its oldest: a peer
	// holding idle sockets makes way for new ones of its address (which
	// another may share), it does not lock them out.
	third := r.dialFrom(t, 2)
	if !closedWithin(first, 2*time.Second) {
		t.Fatalf("the oldest socket of 127.0.0.2 not closed for the third")
	}
	if closedWithin(second, 100*time.Millisecond) || closedWithin(third, 100*time.Millisecond) {
		t.Fatalf("a newer socket of 127.0.0.2 closed")
	}
	r.waitCounts(t, "2 handshakes under way", func(h, _, _ int) bool { return h == 2 })
	if c := r.dialFrom(t, 3); closedWithin(c, 200*time.Millisecond) {
		t.Fatalf("a socket of 127.0.0.3 closed at once")
	}
	if err := call(r.client(t, r.ca, "paul"), "GET", "/v1/things", nil); err != nil {
		t.Fatalf("paul's GET beside them: %v", err)
	}
	kit.WaitFor(t, 5*time.Second, "the audit line of the socket that made way", func() bool {
		return r.log.has(map[string]string{"method": "CONNECT", "remote": "127.0.0.2:", "result": "unavailable",
			"error": "TLS handshake not done when a newer one of its address, or of all, needed its place " +
				"(max_handshakes_per_address, or 4 × max_connections): connection closed"})
	})
}

// TestAccessHandshakeMakesWay: past MaxHandshakes, the oldest handshake
// of the address with the most gives way to the new one.
func TestAccessHandshakeMakesWay(t *testing.T) {
	r := newAccessRig(t, Access{MaxHandshakes: 4, HandshakeTimeout: 10 * time.Second})
	a1, a2, a3 := r.dialFrom(t, 2), r.dialFrom(t, 2), r.dialFrom(t, 2)
	b := r.dialFrom(t, 3)
	r.waitCounts(t, "4 handshakes under way", func(h, _, _ int) bool { return h == 4 })
	r.dialFrom(t, 4)
	if !closedWithin(a1, 2*time.Second) {
		t.Fatalf("the oldest socket of the address with the most not closed")
	}
	for _, c := range []net.Conn{a2, a3, b} {
		if closedWithin(c, 100*time.Millisecond) {
			t.Fatalf("socket %v closed, want only the oldest of 127.0.0.2", c.LocalAddr())
		}
	}
	r.waitCounts(t, "4 handshakes under way", func(h, _, _ int) bool { return h == 4 })
}

// TestAccessReserve: roles other than admin and provisioner hold at most
// half of max_connections; past it, with none of theirs idle, a new
// connection of theirs is refused unavailable (503, Retry-After), with
// an audit line naming its identity and role, while admins and
// provisioners get the rest; past max_connections, theirs are refused
// too.
func TestAccessReserve(t *testing.T) {
	r := newAccessRig(t, Access{MaxConnections: 4})
	defer close(r.release)
	// Two requests of rita under way: her two connections are busy.
	for range 2 {
		c := r.client(t, r.ca, "rita")
		go call(c, "GET", "/v1/slow", nil)
		t.Cleanup(c.Close)
	}
	r.waitCounts(t, "rita's two connections", func(_, n, low int) bool { return n == 2 && low == 2 })
	kit.WaitFor(t, 10*time.Second, "rita's requests under way", func() bool {
		r.s.slots.mu.Lock()
		defer r.s.slots.mu.Unlock()
		return r.s.slots.n["rita"] == 2
	})
	for _, who := range []string{"rita", "nobody"} {
		resp := rawGet(t, r.tlsFrom(t, 1, who), "/v1/discover")
		body := readAll(resp.Body)
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" || !strings.Contains(body, `"unavailable"`) ||
			!strings.Contains(body, "2 connections of roles other than admin and provisioner already") {
			t.Errorf("a third connection of a low role (%s): %s Retry-After %q %s", who, resp.Status, resp.Header.Get("Retry-After"), body)
		}
	}
	kit.WaitFor(t, 5*time.Second, "the audit line of rita's refused connection", func() bool {
		return r.log.has(map[string]string{"method": "CONNECT", "identity": "rita", "role": "reader", "result": "unavailable", "error": "half of max_connections"})
	})
	// Admins and provisioners have the other half.
	paul, alice := r.client(t, r.ca, "paul"), r.client(t, r.ca, "alice")
	defer paul.Close()
	defer alice.Close()
	for who, c := range map[string]*Client{"paul": paul, "alice": alice} {
		if err := call(c, "POST", "/v1/things", map[string]string{"k": "v"}); err != nil {
			t.Fatalf("%s's POST beside rita's connections: %v", who, err)
		}
	}
	// Full, and nothing of a low role idle: a fifth is refused.
	r.waitCounts(t, "4 connections", func(_, n, _ int) bool { return n == 4 })
	err := call(r.client(t, r.ca, "paul"), "GET", "/v1/things", nil)
	wantRefused(t, "a fifth connection", err, CodeUnavailable, "4 connections already (max_connections)")
}

// TestAccessIdleLowMakesRoom: kept-alive connections of a role other
// than admin and provisioner do not pin their places: a new connection
// that finds none closes the longest idle of them.
func TestAccessIdleLowMakesRoom(t *testing.T) {
	r := newAccessRig(t, Access{MaxConnections: 4})
	n1, n2 := r.client(t, r.ca, "nobody"), r.client(t, r.ca, "nobody")
	defer n1.Close()
	defer n2.Close()
	for _, c := range []*Client{n1, n2} {
		if err := call(c, "GET", "/v1/discover", nil); err != nil {
			t.Fatal(err)
		}
	}
	r.waitCounts(t, "two idle connections of nobody", func(_, n, low int) bool { return n == 2 && low == 2 })
	// A reader takes the place of the longest idle: n1's.
	rita := r.client(t, r.ca, "rita")
	defer rita.Close()
	if err := call(rita, "GET", "/v1/things", nil); err != nil {
		t.Fatalf("a reader's GET beside two idle connections of nobody: %v", err)
	}
	r.waitCounts(t, "still two connections of low roles", func(_, n, low int) bool { return n == 2 && low == 2 })
	// Admins and provisioners fill the rest, and one more takes the
	// place of an idle low one.
	for _, who := range []string{"paul", "alice", "paul"} {
		c := r.client(t, r.ca, who)
		defer c.Close()
		if err := call(c, "GET", "/v1/things", nil); err != nil {
			t.Fatalf("%s's GET: %v", who, err)
		}
	}
	r.waitCounts(t, "four connections, one of a low role", func(_, n, low int) bool { return n == 4 && low == 1 })
	// The connections closed to make room are reopened for the next
	// request, as a client does with a kept-alive connection the
	// server closed.
	if err := call(n2, "GET", "/v1/discover", nil); err != nil {
		t.Fatalf("nobody's GET after its connection was closed: %v", err)
	}
}

// TestAccessSlowHeaders: requests whose header never ends hold no
// request slot of their identity and no place of the roles that change
// things: the reader they come from is still served, as are admins and
// provisioners, and they are closed to make room.
func TestAccessSlowHeaders(t *testing.T) {
	r := newAccessRig(t, Access{MaxConnections: 4, MaxRequestsPerIdentity: 1})
	var slow []*tls.Conn
	for range 6 {
		c := r.tlsFrom(t, 2, "rita")
		if _, err := io.WriteString(c, "GET /v1/things HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n"); err != nil {
			t.Fatal(err)
		}
		slow = append(slow, c)
	}
	r.waitCounts(t, "two connections of rita", func(_, n, low int) bool { return n == 2 && low == 2 })
	r.s.slots.mu.Lock()
	held := r.s.slots.n["rita"]
	r.s.slots.mu.Unlock()
	if held != 0 {
		t.Errorf("headers being read hold %d request slots of rita", held)
	}
	for _, who := range []string{"paul", "alice", "rita"} {
		c := r.client(t, r.ca, who)
		if err := call(c, "GET", "/v1/things", nil); err != nil {
			t.Fatalf("%s's GET beside rita's slow headers: %v", who, err)
		}
		c.Close()
	}
	closed := 0
	for _, c := range slow {
		if closedWithin(c, 200*time.Millisecond) {
			closed++
		}
	}
	if closed < 5 {
		t.Errorf("%d of rita's 6 slow headers closed, want at least 5 (2 places, one of them taken by her request)", closed)
	}
}

// TestAccessRefusalRetryAfter: a request past max_requests_per_identity
// is refused unavailable, HTTP 503 with Retry-After: what the CSI
// sidecars retry with a backoff.
func TestAccessRefusalRetryAfter(t *testing.T) {
	r := newAccessRig(t, Access{MaxRequestsPerIdentity: 1})
	slow := r.client(t, r.ca, "rita")
	done := make(chan error, 1)
	go func() { done <- call(slow, "GET", "/v1/slow", nil) }()
	kit.WaitFor(t, 10*time.Second, "rita's slow request under way", func() bool {
		r.s.slots.mu.Lock()
		defer r.s.slots.mu.Unlock()
		return r.s.slots.n["rita"] == 1
	})
	c := r.client(t, r.ca, "rita")
	defer c.Close()
	resp, err := c.hc.Get(r.addr + "/v1/things")
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" || !strings.Contains(body, `"code":"unavailable"`) {
		t.Errorf("a request past max_requests_per_identity: %s, Retry-After %q, %s", resp.Status, resp.Header.Get("Retry-After"), body)
	}
	close(r.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	slow.Close()
}

// TestAccessDefaultsFitTheController: the default bound on one
// identity's requests lets rnbd-csi's controller (16 under way per
// storage node) run twice over: 32 of one provisioner at once.
func TestAccessDefaultsFitTheController(t *testing.T) {
	r := newAccessRig(t, Access{})
	paul := r.client(t, r.ca, "paul")
	defer paul.Close()
	errs := make(chan error, 32)
	for range 32 {
		go func() { errs <- call(paul, "GET", "/v1/slow", nil) }()
	}
	kit.WaitFor(t, 20*time.Second, "32 requests of paul under way", func() bool {
		r.s.slots.mu.Lock()
		defer r.s.slots.mu.Unlock()
		return r.s.slots.n["paul"] == 32
	})
	close(r.release)
	for range 32 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// TestAccessNotTLS13Audited: a client that speaks plaintext HTTP, and
// one that offers TLS 1.2 only, are refused with the audit line
// docs/control-api.md promises; plaintext HTTP is answered that the
// listener takes TLS only.
func TestAccessNotTLS13Audited(t *testing.T) {
	r := newAccessRig(t, Access{})
	c := r.dialFrom(t, 2)
	c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "GET /v1/things HTTP/1.1\r\nHost: x\r\n\r\n")
	if got := readAll(c); !strings.Contains(got, "400 Bad Request") || !strings.Contains(got, "TLS 1.3 only") {
		t.Errorf("plaintext HTTP answered %q", got)
	}
	cert := r.ca.Issue(t, "alice")
	old := tls.Client(r.dialFrom(t, 3), &tls.Config{RootCAs: r.ca.Pool(), ServerName: "127.0.0.1", MaxVersion: tls.VersionTLS12,
		Certificates: []tls.Certificate{cert}})
	if err := old.Handshake(); err == nil || !strings.Contains(err.Error(), "protocol version") {
		t.Errorf("a TLS 1.2 client's handshake: %v, want a protocol version alert", err)
	}
	kit.WaitFor(t, 5*time.Second, "the audit lines", func() bool {
		return r.log.has(map[string]string{"method": "CONNECT", "object": "tls", "remote": "127.0.0.2:", "result": "permission_denied",
			"error": "the client does not speak TLS (plaintext HTTP?)"}) &&
			r.log.has(map[string]string{"method": "CONNECT", "object": "tls", "remote": "127.0.0.3:", "result": "permission_denied",
				"error": "the client offered TLS 1.2 only: the admin listener takes TLS 1.3 only"})
	})
}

// TestAccessNamesOfDifferentRoles: a certificate whose names give
// different roles is refused at every request, discovery too, with an
// audit line naming the names and roles, and a warning the first time
// only; one whose names give one role has it, and is audited by the
// name that gave it.
func TestAccessNamesOfDifferentRoles(t *testing.T) {
	r := newAccessRig(t, Access{})
	mixed := r.client(t, r.ca, "mon2", "mon", "ops")
	defer mixed.Close()
	for _, p := range []string{"/v1/things", "/v1/discover"} {
		wantRefused(t, "GET "+p+" with names of a reader and an admin", call(mixed, "GET", p, nil), CodePermission,
			"the client certificate (mon2, mon, ops) is refused", "names of roles reader and admin")
	}
	// A new connection of the same certificate.
	mixed.Close()
	wantRefused(t, "a POST with names of a reader and an admin", call(mixed, "POST", "/v1/things", map[string]string{"k": "v"}), CodePermission,
		"is refused")
	if !r.log.has(map[string]string{"identity": "mon2", "method": "POST", "result": "permission_denied", "role": "none",
		"error": "the client certificate (mon2, mon, ops) is refused: names of roles reader and admin"}) {
		t.Errorf("no audit line of the refusal:\n%s", r.log.buf.String())
	}
	if n := len(r.log.lines("admin listener: a client certificate whose names give different roles: every request of it is refused")); n != 1 {
		t.Errorf("%d warnings of the certificate, want 1 (its first sight)", n)
	}

	// Names of one role: that role, by the name that gave it.
	one := r.client(t, r.ca, "x1", "paul", "y1")
	defer one.Close()
	if err := call(one, "POST", "/v1/things", map[string]string{"k": "v"}); err != nil {
		t.Fatalf("a POST of a certificate with one name of a provisioner: %v", err)
	}
	if !r.log.has(map[string]string{"identity": "paul", "method": "POST", "result": "ok", "role": "provisioner"}) {
		t.Errorf("no audit line of the provisioner by the name paul:\n%s", r.log.buf.String())
	}
}

// TestAccessNoLeaks: after handshakes that never end, connections
// closed to make room, refused, or cut short in their header, and the
// server's Close, no goroutine of the listener is left.
func TestAccessNoLeaks(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	// Registered first, run last: after the rig's Close.
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
	r := newAccessRig(t, Access{MaxConnections: 2, MaxHandshakes: 4, HandshakeTimeout: 5 * time.Second})
	for i := range 6 {
		r.dialFrom(t, 2+i%2)
	}
	slow := r.tlsFrom(t, 3, "nobody")
	io.WriteString(slow, "GET /v1/discover HTTP/1.1\r\n")
	c := r.client(t, r.ca, "rita")
	if err := call(c, "GET", "/v1/things", nil); err != nil {
		t.Fatal(err)
	}
	c.Close()
	resp := rawGet(t, r.tlsFrom(t, 4, "nobody"), "/v1/discover")
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("nobody's GET: %s", resp.Status)
	}
	p := r.dialFrom(t, 5)
	io.WriteString(p, "GET / HTTP/1.1\r\n\r\n")
	readAll(p)
}
