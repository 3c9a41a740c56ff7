package tcp

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/conntest"
	"github.com/rnbd/rnbd/test/testca"
)

// The fabric's contract holds unchanged inside TLS, and the accepting
// side learns the names of the dialer's certificate.
func TestTLSContract(t *testing.T) {
	ca := testca.New(t, "test ca")
	cfg := ca.Config(ca.Issue(t, "node-a", "127.0.0.1", "node-a.example"))
	newTLSPair := func(t testing.TB, recvs []fabric.RecvWR) *conntest.Pair {
		return conntest.NewPair(t, New(Options{TLS: cfg}), netip.MustParseAddrPort("127.0.0.1:0"), recvs)
	}
	conntest.Contract{NewPair: newTLSPair, SendByteLen: true}.Run(t)
}

// TestAnySourceNotTLS: a plain connection lends its sends' buffers to
// writev, where a fault of a file mapping fails the send; a TLS one seals
// them in Go code, where it would take the process down: it does not.
func TestAnySourceNotTLS(t *testing.T) {
	ca := testca.New(t, "test ca")
	cfg := ca.Config(ca.Issue(t, "node-a", "127.0.0.1", "node-a.example"))
	for _, tc := range []struct {
		opts Options
		want bool
	}{{Options{}, true}, {Options{TLS: cfg}, false}} {
		p := conntest.NewPair(t, New(tc.opts), netip.MustParseAddrPort("127.0.0.1:0"), nil)
		for _, c := range []fabric.Conn{p.Cli.C, p.Srv.C} {
			if a, ok := c.(fabric.AnySource); !ok || a.AnySource() != tc.want {
				t.Fatalf("TLS %v: AnySource %v, want %v", tc.opts.TLS != nil, ok && a.AnySource(), tc.want)
			}
		}
	}
}

// tlsDial dials l with the fabric f; it returns the names the listener
// saw if it got a request (which it rejects), or the dial's error.
func tlsDial(t *testing.T, f *Fabric, l fabric.Listener) ([]string, error) {
	t.Helper()
	got := make(chan []string, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	go func() {
		r, err := l.Accept(ctx)
		if err != nil {
			got <- nil
			return
		}
		names := fabric.PeerNames(r)
		r.Reject([]byte("no"))
		got <- names
	}()
	dev, _ := f.Resolve(ctx, netip.AddrPort{}, l.Addr())
	pdv, _ := dev.AllocPD()
	_, _, err := dev.Dial(ctx, fabric.DialParams{Dst: l.Addr(), PD: pdv, PrivateData: []byte("hi"),
		Attr: fabric.ConnAttr{Handler: conntest.NewRecorder()}})
	if err == nil {
		t.Fatal("dial accepted: the test's listener rejects every request")
	}
	var rej *fabric.RejectError
	if errors.As(err, &rej) {
		return <-got, nil
	}
	cancel()
	<-got
	return nil, err
}

func TestTLSAuthentication(t *testing.T) {
	ca, other := testca.New(t, "test ca"), testca.New(t, "another ca")
	server := ca.Issue(t, "server", "127.0.0.1")
	logs, entries := kit.LogRecorder()
	srv := New(Options{TLS: ca.Config(server), Log: logs})
	l, err := srv.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()

	// A client of the authority reaches RTRS with the names of its
	// certificate.
	names, err := tlsDial(t, New(Options{TLS: ca.Config(ca.Issue(t, "client-1", "host1.example"))}), l)
	if err != nil || !slices.Equal(names, []string{"client-1", "host1.example"}) {
		t.Fatalf("client of the authority: %v, names %q", err, names)
	}

	refused := map[string]*Fabric{
		"without TLS":                  New(Options{}),
		"without a certificate":        New(Options{TLS: &tls.Config{RootCAs: ca.Pool()}}),
		"of another authority":         New(Options{TLS: &tls.Config{Certificates: []tls.Certificate{other.Issue(t, "client-1")}, RootCAs: ca.Pool()}}),
		"trusting another authority":   New(Options{TLS: other.Config(other.Issue(t, "client-1"))}),
		"for a server of another name": New(Options{TLS: &tls.Config{Certificates: []tls.Certificate{ca.Issue(t, "client-1")}, RootCAs: ca.Pool(), ServerName: "elsewhere.example"}}),
	}
	for what, f := range refused {
		names, err := tlsDial(t, f, l)
		if err == nil || names != nil {
			t.Errorf("client %s: dial error %v, listener saw a request from %q", what, err, names)
		}
		// What the CLI turns into its permission exit code.
		if !errors.Is(err, syscall.EACCES) {
			t.Errorf("client %s: %v, not EACCES", what, err)
		}
		if what == "without TLS" && !strings.Contains(fmt.Sprint(err), "requires TLS") {
			t.Errorf("client without TLS told %q", err)
		}
	}
	// A TLS client of a server without TLS fails too.
	plainFab := New(Options{Log: logs})
	plain, err := plainFab.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if names, err := tlsDial(t, New(Options{TLS: ca.Config(ca.Issue(t, "client-1"))}), plain); names != nil ||
		!errors.Is(err, syscall.EACCES) || !strings.Contains(fmt.Sprint(err), "does not speak TLS") {
		t.Errorf("TLS client of a plain server: %v %q", err, names)
	}
	plainSeen := false
	// The server logged the clients it refused in the handshake (the
	// one trusting another authority hangs up from its side, which the
	// server sees as a failed handshake too).
	n := 0
	for _, e := range entries() {
		if strings.Contains(e.Message, "TLS handshake failed") {
			n++
		}
		if strings.Contains(e.Message, "no TLS from a client") {
			plainSeen = true
		}
	}
	if !plainSeen {
		t.Error("the client without TLS was not logged")
	}
	if n < 2 {
		t.Errorf("%d TLS handshake failures logged, want one per refused client", n)
	}
	// Whatever became of them, no handshake is left counted.
	for _, l := range []fabric.Listener{l, plain} {
		ll := l.(*listener)
		waitShaken(t, ll)
	}
	// The server refused three of them (no TLS, no certificate, one of
	// another authority) and the plain server the TLS client: each is
	// counted where the server counts its refusals. The clients that
	// did not trust the server hung up themselves: no refusal.
	if got, want := srv.Refused(), map[syscall.Errno]uint64{syscall.EACCES: 3}; !maps.Equal(got, want) {
		t.Errorf("the TLS server's Refused %v, want %v", got, want)
	}
	if got, want := plainFab.Refused(), map[syscall.Errno]uint64{syscall.EACCES: 1}; !maps.Equal(got, want) {
		t.Errorf("the plain server's Refused %v, want %v", got, want)
	}
	for _, e := range entries() {
		if e.Message == "rejecting connection: TLS handshake failed" && strings.Contains(fmt.Sprint(e.Data["error"]), "no certificate") {
			return
		}
	}
	t.Error("the client without a certificate was not logged as such")
}

// waitShaken waits until l counts no handshake in progress.
func waitShaken(t *testing.T, l *listener) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		l.perAddrMu.Lock()
		n, m := len(l.shaking), len(l.perAddr)
		l.perAddrMu.Unlock()
		if n == 0 && m == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d handshakes (%d addresses) still counted after every peer went", n, m)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestCertNames(t *testing.T) {
	ca := testca.New(t, "test ca")
	c := ca.Issue(t, "a", "a", "b.example", "10.0.0.1")
	if got := CertNames(c.Leaf); !slices.Equal(got, []string{"a", "b.example"}) {
		t.Fatalf("names %q: the common name, then the DNS names, once each; addresses are not names", got)
	}
}

// A peer that completes the handshake and then reads nothing (it still
// acknowledges: its window is shut) loses its connection once a write
// has waited StallTimeout, with TLS and without.
func TestStalledPeer(t *testing.T) {
	ca := testca.New(t, "test ca")
	for _, withTLS := range []bool{false, true} {
		opts := Options{StallTimeout: 300 * time.Millisecond}
		if withTLS {
			opts.TLS = ca.Config(ca.Issue(t, "server", "127.0.0.1"))
		}
		f := New(opts)
		l, err := f.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
		if err != nil {
			t.Fatal(err)
		}
		raw, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		var peer net.Conn = raw
		if withTLS {
			cfg := ca.Config(ca.Issue(t, "stalled"))
			cfg.ServerName = "127.0.0.1"
			tc := tls.Client(raw, cfg)
			if err := tc.Handshake(); err != nil {
				t.Fatal(err)
			}
			peer = tc
		}
		if err := writeHandshake(peer, hsREQ, []byte("hi")); err != nil {
			t.Fatal(err)
		}
		r, err := l.Accept(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		dev := r.Device()
		pdv, _ := dev.AllocPD()
		rec := conntest.NewRecorder()
		c, err := r.Accept(pdv, fabric.ConnAttr{Handler: rec, MaxSendWR: 8}, nil)
		if err != nil {
			t.Fatal(err)
		}
		// Sends of 1 MiB, one at a time, until the socket's buffers are
		// full and the connection dies.
		buf := make([]byte, 1<<20)
		start := time.Now()
		for dead := false; !dead; {
			if err := c.PostSend(conntest.Write(buf, 0, 0, 0, fabric.OpSend, 0)); err != nil {
				t.Fatal(err)
			}
			select {
			case <-rec.WCs:
			case err := <-rec.Dead:
				if !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("tls %v: connection died of %v, want the stall timeout", withTLS, err)
				}
				dead = true
			case <-time.After(20 * time.Second):
				t.Fatalf("tls %v: a peer that reads nothing kept its connection", withTLS)
			}
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("tls %v: killed after %v", withTLS, d)
		}
		c.Close()
		raw.Close()
		l.Close()
	}
}

// TestTLSNamelessClient: a client certificate that verifies but names
// no identity (no subject common name, no DNS, URI or e-mail alternative
// name; an IP address is not a name) is refused in the handshake, as one
// that does not verify is: the client sees EACCES, the server logs why
// and counts it (Refused). With AllowAnonymousClients it gets through,
// without names. A certificate with a name still passes either way.
func TestTLSNamelessClient(t *testing.T) {
	ca := testca.New(t, "test ca")
	server := ca.Issue(t, "server", "127.0.0.1")
	nameless := map[string]tls.Certificate{
		"without a subject or alternative names": ca.Issue(t, ""),
		"naming an IP address only":              ca.Issue(t, "", "10.0.0.9"),
	}
	for _, allow := range []bool{false, true} {
		logs, entries := kit.LogRecorder()
		srv := New(Options{TLS: ca.Config(server), Log: logs, AllowAnonymousClients: allow})
		l, err := srv.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
		if err != nil {
			t.Fatal(err)
		}
		for what, cert := range nameless {
			names, err := tlsDial(t, New(Options{TLS: ca.Config(cert)}), l)
			if !allow && (!errors.Is(err, syscall.EACCES) || names != nil || !strings.Contains(fmt.Sprint(err), "naming no identity")) {
				t.Errorf("a client certificate %s: dial error %v, listener saw names %q; want EACCES in the handshake", what, err, names)
			}
			if allow && (err != nil || len(names) != 0) {
				t.Errorf("allowing anonymous clients, a certificate %s: %v, names %q", what, err, names)
			}
		}
		if names, err := tlsDial(t, New(Options{TLS: ca.Config(ca.Issue(t, "client-1"))}), l); err != nil || !slices.Equal(names, []string{"client-1"}) {
			t.Errorf("allow %v: a client with a name: %v, names %q", allow, err, names)
		}
		waitShaken(t, l.(*listener)) // the refusals are logged by now
		logged := 0
		for _, e := range entries() {
			if e.Message == "rejecting connection: client certificate names no identity (no CN, no SAN)" {
				logged++
				if e.Level != log.WarnLevel || e.Data["client"] == nil || !strings.Contains(fmt.Sprint(e.Data["issuer"]), "CN=test ca") {
					t.Errorf("the refusal logged as %v %v", e.Level, e.Data)
				}
			}
		}
		want, wantRefused := 0, map[syscall.Errno]uint64{}
		if !allow {
			want, wantRefused = len(nameless), map[syscall.Errno]uint64{syscall.EACCES: uint64(len(nameless))}
		}
		if logged != want {
			t.Errorf("allow %v: %d refusals logged, want %d", allow, logged, want)
		}
		if got := srv.Refused(); !maps.Equal(got, wantRefused) {
			t.Errorf("allow %v: Refused %v, want %v", allow, got, wantRefused)
		}
		l.Close()
	}
}

// TestTLSNamelessServer: a server certificate that names neither the
// address dialled (an IP alternative name) nor ServerName (a DNS one) is
// not accepted: Go's verification refuses it, and the client sees
// EACCES. A common name alone is no name here (Go has not matched it
// since 1.15).
func TestTLSNamelessServer(t *testing.T) {
	ca := testca.New(t, "test ca")
	for what, cert := range map[string]tls.Certificate{
		"without a subject or alternative names": ca.Issue(t, ""),
		"with a common name only":                ca.Issue(t, "server"),
		"naming another address":                 ca.Issue(t, "", "127.0.0.2"),
	} {
		l, err := New(Options{TLS: ca.Config(cert)}).Listen(netip.MustParseAddrPort("127.0.0.1:0"))
		if err != nil {
			t.Fatal(err)
		}
		for _, serverName := range []string{"", "server"} {
			cfg := ca.Config(ca.Issue(t, "client-1"))
			cfg.ServerName = serverName
			names, err := tlsDial(t, New(Options{TLS: cfg}), l)
			if !errors.Is(err, syscall.EACCES) || names != nil || !strings.Contains(fmt.Sprint(err), "certificate") {
				t.Errorf("a server certificate %s, server name %q: dial error %v, listener saw %q; want EACCES", what, serverName, err, names)
			}
		}
		waitShaken(t, l.(*listener))
		l.Close()
	}
}
