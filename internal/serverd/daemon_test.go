package serverd

import (
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/test/testca"
)

// A daemon stops once: a second Stop returns the first's result, and
// the export retry's goroutine is gone with the first.
func TestStopTwice(t *testing.T) {
	dir := t.TempDir()
	cfg := DefaultConfig()
	cfg.Listen = []string{"tcp://127.0.0.1:0"}
	cfg.ControlSocket = filepath.Join(dir, "s.sock")
	cfg.StateFile = filepath.Join(dir, "s.json")
	cfg.ExportRetry = Duration{Duration: 100 * time.Millisecond}
	d, err := Start(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-d.retryDone:
	default:
		t.Fatal("the export retry still runs after Stop")
	}
}

// trustConfig is a daemon on a loopback port of its own, with the TLS
// of pki (none if nil).
func trustConfig(t *testing.T, pki *ServerTLS) Config {
	dir := t.TempDir()
	cfg := DefaultConfig()
	cfg.Listen = []string{"tcp://127.0.0.1:0"}
	cfg.ControlSocket = filepath.Join(dir, "s.sock")
	cfg.StateFile = filepath.Join(dir, "s.json")
	if pki != nil {
		cfg.TLS = *pki
	}
	return cfg
}

// startLogged starts cfg and returns what it logged at start-up, by
// message.
func startLogged(t *testing.T, cfg Config) (*Daemon, map[string][]*log.Entry) {
	t.Helper()
	lg, entries := kit.LogRecorder()
	d, err := Start(cfg, Options{Log: lg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop() })
	m := map[string][]*log.Entry{}
	for _, e := range entries() {
		m[e.Message] = append(m[e.Message], e)
	}
	return d, m
}

// A server without TLS says once, at start-up, that whoever reaches its
// listeners is trusted, naming them; with TLS it does not, and with
// anonymous client certificates let in it says that instead.
func TestStartSaysWhomItTrusts(t *testing.T) {
	const anonymous = "tls allow_anonymous_clients: a client certificate that names no identity is accepted; " +
		"such a client is counted by its address and may open every export that grants no identities"
	d, logged := startLogged(t, trustConfig(t, nil))
	w := logged[noTLSWarning]
	if len(w) != 1 || w[0].Level != log.WarnLevel || w[0].Data["listen"] != fmt.Sprintf("tcp://%v", d.Addrs()[0]) {
		t.Fatalf("without TLS: %d warnings %q, want one at warn level naming tcp://%v", len(w), noTLSWarning, d.Addrs()[0])
	}
	if !strings.Contains(noTLSWarning, "anyone who can reach") || !strings.Contains(noTLSWarning, "not credentials") ||
		!strings.Contains(noTLSWarning, "RDMA authenticates no one") || !strings.Contains(noTLSWarning, "docs/operations.md") {
		t.Fatalf("the warning does not say it plainly: %q", noTLSWarning)
	}

	ca := testca.New(t, "test ca")
	dir := t.TempDir()
	var pki ServerTLS
	pki.Cert, pki.Key = testca.WriteCert(t, ca.Issue(t, "srv", "127.0.0.1"), dir, "srv")
	pki.CA = ca.WriteCA(t, dir, "ca")
	for _, anon := range []bool{false, true} {
		pki.AllowAnonymousClients = anon
		d, logged := startLogged(t, trustConfig(t, &pki))
		if w := logged[noTLSWarning]; len(w) != 0 {
			t.Errorf("with TLS: %q logged", noTLSWarning)
		}
		w := logged[anonymous]
		if anon && (len(w) != 1 || w[0].Level != log.WarnLevel || w[0].Data["listen"] != fmt.Sprintf("tcp://%v", d.Addrs()[0])) {
			t.Errorf("allow_anonymous_clients: %d warnings %q", len(w), anonymous)
		}
		if !anon && len(w) != 0 {
			t.Errorf("anonymous clients refused, yet %q logged", anonymous)
		}
	}
}
