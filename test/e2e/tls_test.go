package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestTLSEndToEnd runs both daemons with certificates made by
// scripts/test-ca.sh: a client maps an export granted to its identity and
// fio verifies what it wrote through the mapping; another identity gets
// what its grant allows and no more; a client without TLS, or with a
// certificate of another authority, gets no session; the server names
// each session's peer.
func TestTLSEndToEnd(t *testing.T) {
	needTools(t, "fio", "openssl")
	dir := t.TempDir()
	pki, other := filepath.Join(dir, "pki"), filepath.Join(dir, "other")
	ca := func(args ...string) {
		t.Helper()
		run(t, time.Minute, "bash", append([]string{"../../scripts/test-ca.sh"}, args...)...)
	}
	ca(pki, "ca")
	ca(pki, "server", "srv", "127.0.0.1")
	ca(pki, "client", "client-a")
	ca(pki, "client", "client-b")
	ca(pki, "client", "client-c") // granted nothing
	ca(other, "ca")
	ca(other, "client", "client-a") // the same name from an authority the server does not trust
	tlsArgs := func(d, name string) []string {
		return []string{"--tls-cert", filepath.Join(d, name+".crt"), "--tls-key", filepath.Join(d, name+".key"),
			"--tls-ca", filepath.Join(d, "ca.crt")}
	}
	vol := filepath.Join(dir, "vol.img")
	kit.SparseFile(t, vol, 256<<20)
	port := freePort(t)
	srv := startServer(t, dir, port, tlsArgs(pki, "srv")...)
	srv.ok("map", "vol", vol, "--allow-identity", "client-a", "--allow-identity", "client-b=ro")
	// The grants are kept with the export across restarts.
	var st bytes.Buffer
	raw, _ := os.ReadFile(filepath.Join(dir, "state.json"))
	if json.Compact(&st, raw); !strings.Contains(st.String(),
		`"allow_identities":[{"identity":"client-a","access":"rw"},{"identity":"client-b","access":"ro"}]`) {
		t.Fatalf("state file: %s", raw)
	}

	client := func(name string, args ...string) *clientDaemon {
		d := filepath.Join(dir, name)
		os.MkdirAll(d, 0o755)
		return startClient(t, d, args...)
	}
	mapArgs := func(sess, mode string) []string {
		return []string{"map", "--sessname", sess, "--path", "ip:127.0.0.1", "--device-path", "vol",
			"--dest-port", fmt.Sprint(port), "--access-mode", mode}
	}
	a := client("a", tlsArgs(pki, "client-a")...)
	out := a.ok(mapArgs("sa", "rw")...)
	uri, ok := strings.CutPrefix(strings.TrimSpace(out), "rnbd0 mapped: ")
	if !ok {
		t.Fatalf("map output %q", out)
	}
	fioVerify(t, uri, "128k", "128m", 5*time.Minute)
	sess := srv.records("session", "list", "--fields", "all")
	if len(sess) != 1 || sess[0]["sessname"] != "sa" || sess[0]["peer"] != "client-a" {
		t.Fatalf("server sessions: %v", sess)
	}

	// client-b may read, not write; its session name does not matter.
	b := client("b", tlsArgs(pki, "client-b")...)
	if _, errOut, code := b.ctl(mapArgs("sa2", "rw")...); code != 7 ||
		!strings.Contains(errOut, "rnbd: open vol: permission denied: the export grants this client's identity (its TLS certificate) no access, or less than this access mode") {
		t.Fatalf("rw map by an identity granted ro: exit %d %q", code, errOut)
	}
	bOut := b.ok(mapArgs("sa2", "ro")...)
	bURI, ok := strings.CutPrefix(strings.TrimSpace(bOut), "rnbd0 mapped: ")
	if !ok {
		t.Fatalf("map output %q", bOut)
	}
	// Through its ro mapping it reads what client-a wrote, and cannot
	// write: the NBD export is read-only, and the server would refuse.
	if out, err := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 0x42 0 4k", bURI).CombinedOutput(); err == nil && !strings.Contains(string(out), "failed") {
		t.Fatalf("a write through client-b's ro mapping: %s, want it refused", out)
	}
	if out, err := exec.Command("qemu-io", "-f", "raw", "-r", "-c", "read 0 4k", bURI).CombinedOutput(); err != nil || strings.Contains(string(out), "failed") {
		t.Fatalf("a read through client-b's ro mapping: %v %s", err, out)
	}
	// An identity the export does not name: refused, said why, no
	// session left open for it.
	c := client("c", tlsArgs(pki, "client-c")...)
	if _, errOut, code := c.ctl(mapArgs("sc", "ro")...); code != 7 ||
		!strings.Contains(errOut, "permission denied: the export grants this client's identity (its TLS certificate) no access") {
		t.Fatalf("map by an identity granted nothing: exit %d %q", code, errOut)
	}
	kit.WaitFor(t, 10*time.Second, "the server to log the refusal", func() bool {
		return strings.Contains(srv.out.String(), "export vol does not allow client client-c")
	})
	c.stop()
	kit.WaitFor(t, 10*time.Second, "the refused client's session to go", func() bool {
		for _, r := range srv.records("session", "list") {
			if r["sessname"] == "sc" {
				return false
			}
		}
		return true
	})
	// It was refused: its session name is bound to nothing
	// (TestTLSSessionNamesBoundOnAdmission).
	if _, errOut, code := srv.ctl("session", "forget", "sc"); code != 3 || !strings.Contains(errOut, "not bound") {
		t.Fatalf("forget of the refused client's session name: exit %d %q, want 3: never bound", code, errOut)
	}

	// No TLS, or another authority: no session, and the server says why.
	for _, c := range []struct {
		name, says string
		args       []string
	}{
		{"plain", "requires TLS: give the client a certificate", []string{"--tls-cert="}}, // no TLS, even in a suite run with it
		{"other", "certificate signed by unknown authority", tlsArgs(other, "client-a")},
	} {
		cl := client(c.name, c.args...)
		_, errOut, code := cl.ctl(mapArgs("s-"+c.name, "ro")...)
		if code != 7 || !strings.Contains(errOut, c.says) {
			t.Fatalf("map by a client %s: exit %d: %q", c.name, code, errOut)
		}
	}
	// The server's side of a failed handshake may end a little after the
	// client's.
	for _, says := range []string{"no TLS from a client, but the server requires it", "TLS handshake failed"} {
		kit.WaitFor(t, 10*time.Second, "the server to log "+says, func() bool { return strings.Contains(srv.out.String(), says) })
	}
	if sess := srv.records("session", "list"); len(sess) != 2 {
		t.Fatalf("server sessions after the refused clients: %v", sess)
	}

	// Session names are bound to the identities that took them, and
	// kept across a restart of the server: while client-a is down and
	// the server restarts, client-b cannot take "sa" and lock client-a
	// out of it; client-a gets it back; the operator can free it.
	names := func() string {
		var b strings.Builder
		for _, r := range srv.records("session", "names") {
			fmt.Fprintf(&b, "%s=%s ", r["sessname"], r["identity"])
		}
		return strings.TrimSpace(b.String())
	}
	if got := names(); got != "sa=client-a sa2=client-b" {
		t.Fatalf("session names %q", got)
	}
	a.stop()
	srv.stop()
	srv = startServer(t, dir, port, tlsArgs(pki, "srv")...)
	if got := names(); got != "sa=client-a sa2=client-b" {
		t.Fatalf("session names after a restart %q", got)
	}
	b.ok("unmap", "rnbd0") // its sa2 mapping of vol: the NBD export name is taken
	if _, errOut, code := b.ctl(mapArgs("sa", "ro")...); code == 0 || !strings.Contains(errOut, "when it refuses a session name in use, or bound to another client's identity") {
		t.Fatalf("client-b's map through client-a's session name: exit %d %q", code, errOut)
	}
	kit.WaitFor(t, 10*time.Second, "the server to log why it refused the name", func() bool {
		return strings.Contains(srv.out.String(), "session name refused: it belongs to another identity")
	})
	a = startClient(t, filepath.Join(dir, "a"), tlsArgs(pki, "client-a")...) // restores its mapping in "sa"
	deadline := time.Now().Add(30 * time.Second)
	for {
		if s := a.records("session", "show", "sa"); len(s) == 1 && s[0]["act_path_cnt"] == float64(1) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("client-a did not get its session back:\n%s", srv.out.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	// A name in use cannot be forgotten (its session would bind it again
	// when it reconnects); the operator gives it to another identity
	// instead, which disconnects the session that has it.
	if _, errOut, code := srv.ctl("session", "forget", "sa"); code != 5 || !strings.Contains(errOut, "is connected") {
		t.Fatalf("forget of a name in use: exit %d %q", code, errOut)
	}
	if out := srv.ok("session", "bind", "sa", "client-b"); !strings.Contains(out, "was disconnected") {
		t.Fatalf("bind of a name in use: %q", out)
	}
	if got := names(); got != "sa=client-b sa2=client-b" {
		t.Fatalf("session names after bind %q", got)
	}
	deadline = time.Now().Add(30 * time.Second)
	for {
		_, errOut, code := b.ctl(mapArgs("sa", "ro")...)
		if code == 0 {
			break
		}
		// client-a's session may still be closing on the server.
		if time.Now().After(deadline) {
			t.Fatalf("client-b cannot take the name given to it: exit %d %q", code, errOut)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// client-a keeps trying, and is refused, until it unmaps.
	a.ok("unmap", "rnbd0")
	if _, errOut, code := srv.ctl("session", "forget", "nosuch"); code == 0 || !strings.Contains(errOut, "not bound") {
		t.Fatalf("forget of a free name: exit %d %q", code, errOut)
	}
	if got := names(); got != "sa=client-b sa2=client-b" {
		t.Fatalf("session names after client-b took the freed one %q", got)
	}
}

// TestTLSNamelessClient: a client certificate of the server's authority
// that names no identity (scripts/test-ca.sh nameless: no common name,
// no alternative names) gets no session: map exits 7 (EACCES) saying the
// server refused the certificate, and the server logs why and counts it
// in rnbd_server_refused_connections_total{reason="EACCES"}. With
// --tls-allow-anonymous-clients the same client maps an export that
// grants no identities, and what it writes reads back.
func TestTLSNamelessClient(t *testing.T) {
	needTools(t, "openssl", "qemu-io")
	dir := t.TempDir()
	pki := filepath.Join(dir, "pki")
	for _, args := range [][]string{{"ca"}, {"server", "srv", "127.0.0.1"}, {"nameless", "anon"}} {
		run(t, time.Minute, "bash", append([]string{"../../scripts/test-ca.sh", pki}, args...)...)
	}
	tlsArgs := func(name string) []string {
		return []string{"--tls-cert", filepath.Join(pki, name+".crt"), "--tls-key", filepath.Join(pki, name+".key"),
			"--tls-ca", filepath.Join(pki, "ca.crt")}
	}
	vol := filepath.Join(dir, "vol.img")
	kit.SparseFile(t, vol, 64<<20)
	port := freePort(t)
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	srvDir := filepath.Join(dir, "srv")
	os.MkdirAll(srvDir, 0o755)
	srv := startServer(t, srvDir, port, append(tlsArgs("srv"), "--metrics-listen", metricsAddr)...)
	srv.ok("map", "vol", vol)
	refusedBefore := fetchMetrics(t, metricsAddr).sum("rnbd_server_refused_connections_total", `reason="EACCES"`)

	cl := startClient(t, filepath.Join(dir, "cl"), tlsArgs("anon")...)
	mapArgs := []string{"map", "--sessname", "anon", "--path", "ip:127.0.0.1", "--device-path", "vol",
		"--dest-port", fmt.Sprint(port), "--access-mode", "rw"}
	if _, errOut, code := cl.ctl(mapArgs...); code != 7 || !strings.Contains(errOut, "refused the client's certificate") ||
		!strings.Contains(errOut, "naming no identity") {
		t.Fatalf("map with a nameless certificate: exit %d %q, want 7 (permission)", code, errOut)
	}
	const why = "rejecting connection: client certificate names no identity (no CN, no SAN)"
	kit.WaitFor(t, 10*time.Second, "the server to log why it refused the certificate", func() bool {
		return strings.Contains(srv.out.String(), why)
	})
	if got := fetchMetrics(t, metricsAddr).sum("rnbd_server_refused_connections_total", `reason="EACCES"`); got < refusedBefore+1 {
		t.Fatalf("refused_connections_total{reason=\"EACCES\"} %v after the refusal, %v before", got, refusedBefore)
	}
	if sess := srv.records("session", "list"); len(sess) != 0 {
		t.Fatalf("server sessions after the refusal: %v", sess)
	}

	srv.stop()
	srv = startServer(t, srvDir, port, append(tlsArgs("srv"), "--tls-allow-anonymous-clients")...)
	kit.WaitFor(t, 10*time.Second, "the server to warn that it lets anonymous clients in", func() bool {
		return strings.Contains(srv.out.String(), "tls allow_anonymous_clients: a client certificate that names no identity is accepted")
	})
	out := cl.ok(mapArgs...)
	uri, ok := strings.CutPrefix(strings.TrimSpace(out), "rnbd0 mapped: ")
	if !ok {
		t.Fatalf("map output %q", out)
	}
	for _, c := range []string{"write -P 0x5a 0 1M", "read -P 0x5a 0 1M"} {
		if out, err := exec.Command("qemu-io", "-f", "raw", "-c", c, uri).CombinedOutput(); err != nil || strings.Contains(string(out), "failed") {
			t.Fatalf("qemu-io %s through the anonymous client's mapping: %v %s", c, err, out)
		}
	}
	sess := srv.records("session", "list", "--fields", "all")
	if len(sess) != 1 || sess[0]["sessname"] != "anon" || sess[0]["peer"] != "" {
		t.Fatalf("server sessions: %v", sess)
	}
	cl.ok("unmap", "rnbd0")
}

// tlsRig is a TLS server with metrics and its own authority
// (scripts/test-ca.sh), certificates of the clients newTLSRig names, and
// one of another authority ("stranger").
type tlsRig struct {
	t        *testing.T
	dir, pki string
	other    string // another authority's directory
	port     int
	metrics  string // the server's metrics_listen
	srv      *serverDaemon
	srvDir   string
	vol      string
}

func newTLSRig(t *testing.T, clients ...string) *tlsRig {
	t.Helper()
	needTools(t, "openssl")
	dir := t.TempDir()
	r := &tlsRig{t: t, dir: dir, pki: filepath.Join(dir, "pki"), other: filepath.Join(dir, "other"), port: freePort(t),
		srvDir: filepath.Join(dir, "srv"), vol: filepath.Join(dir, "vol.img")}
	r.metrics = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	steps := [][]string{{r.pki, "ca"}, {r.pki, "server", "srv", "127.0.0.1"}, {r.other, "ca"}, {r.other, "client", "stranger"}}
	for _, c := range clients {
		steps = append(steps, []string{r.pki, "client", c})
	}
	for _, args := range steps {
		run(t, time.Minute, "bash", append([]string{"../../scripts/test-ca.sh"}, args...)...)
	}
	kit.SparseFile(t, r.vol, 64<<20)
	os.MkdirAll(r.srvDir, 0o755)
	r.startServer()
	return r
}

func (r *tlsRig) startServer() {
	r.t.Helper()
	r.srv = startServer(r.t, r.srvDir, r.port, "--tls-cert", filepath.Join(r.pki, "srv.crt"), "--tls-key", filepath.Join(r.pki, "srv.key"),
		"--tls-ca", filepath.Join(r.pki, "ca.crt"), "--metrics-listen", r.metrics)
}

// client starts a client daemon with args (its TLS flags).
func (r *tlsRig) client(name string, args ...string) *clientDaemon {
	d := filepath.Join(r.dir, name)
	os.MkdirAll(d, 0o755)
	return startClient(r.t, d, args...)
}

// tls are the TLS flags of a client of the rig's authority.
func (r *tlsRig) tls(name string) []string {
	return []string{"--tls-cert", filepath.Join(r.pki, name+".crt"), "--tls-key", filepath.Join(r.pki, name+".key"),
		"--tls-ca", filepath.Join(r.pki, "ca.crt")}
}

func (r *tlsRig) mapArgs(sess, dev string) []string {
	return []string{"map", "--sessname", sess, "--path", "ip:127.0.0.1", "--device-path", dev,
		"--dest-port", fmt.Sprint(r.port), "--access-mode", "rw"}
}

// names are the server's session name bindings, "name=identity ...".
func (r *tlsRig) names() string {
	var b strings.Builder
	for _, rec := range r.srv.records("session", "names") {
		fmt.Fprintf(&b, "%s=%s ", rec["sessname"], rec["identity"])
	}
	return strings.TrimSpace(b.String())
}

// sessionGone waits until the server has no session sess.
func (r *tlsRig) sessionGone(sess string) {
	r.t.Helper()
	kit.WaitFor(r.t, 10*time.Second, "session "+sess+" to go from the server", func() bool {
		for _, rec := range r.srv.records("session", "list") {
			if rec["sessname"] == sess {
				return false
			}
		}
		return true
	})
}

// TestTLSRefusalsCounted: rnbd_server_refused_connections_total counts,
// as reason="EACCES", what a TLS server refuses: a client without TLS, a
// client certificate of another authority (the client trusts the
// server's), and a path whose identity asks for a session name bound to
// another identity (refused at INFO_REQ). Each refusal is scraped after
// it was provoked.
func TestTLSRefusalsCounted(t *testing.T) {
	r := newTLSRig(t, "client-a", "client-b")
	r.srv.ok("map", "vol", r.vol)
	r.srv.ok("session", "bind", "owned", "client-a")
	refused := func() float64 {
		return fetchMetrics(t, r.metrics).sum("rnbd_server_refused_connections_total", `reason="EACCES"`)
	}
	for _, c := range []struct {
		what, sess, says string
		args             []string
	}{
		{"a client without TLS", "s-plain", "requires TLS: give the client a certificate", []string{"--tls-cert="}},
		{"a certificate of another authority", "s-stranger", "refused the client's certificate",
			[]string{"--tls-cert", filepath.Join(r.other, "stranger.crt"), "--tls-key", filepath.Join(r.other, "stranger.key"),
				"--tls-ca", filepath.Join(r.pki, "ca.crt")}},
		{"an identity asking for a name bound to another", "owned", "bound to another client's identity", r.tls("client-b")},
	} {
		before := refused()
		cl := r.client(c.sess, c.args...)
		if _, errOut, code := cl.ctl(r.mapArgs(c.sess, "vol")...); code == 0 || !strings.Contains(errOut, c.says) {
			t.Fatalf("map by %s: exit %d %q, want it refused saying %q", c.what, code, errOut, c.says)
		}
		kit.WaitFor(t, 10*time.Second, "the refusal of "+c.what+" counted", func() bool { return refused() >= before+1 })
		cl.stop()
	}
	if sess := r.srv.records("session", "list"); len(sess) != 0 {
		t.Fatalf("server sessions after the refusals: %v", sess)
	}
	// The name's owner is not refused.
	before := refused()
	a := r.client("a", r.tls("client-a")...)
	a.ok(r.mapArgs("owned", "vol")...)
	m := fetchMetrics(t, r.metrics)
	lintMetrics(t, "rnbd-server (after refusals)", m)
	if got := m.sum("rnbd_server_refused_connections_total", `reason="EACCES"`); got != before {
		t.Errorf("refused_connections_total{reason=\"EACCES\"} %v after the owner's map, %v before", got, before)
	}
}

// TestTLSSessionNamesBoundOnAdmission: a session name is bound to an
// identity only once its session was admitted — it opened a device. An
// identity the export grants nothing, refused at OPEN, and a map of a
// device the server does not have, leave no binding, in session names
// or the state file; a map that succeeds binds, and the binding is kept
// across a restart.
func TestTLSSessionNamesBoundOnAdmission(t *testing.T) {
	r := newTLSRig(t, "client-a", "client-c")
	r.srv.ok("map", "vol", r.vol, "--allow-identity", "client-a")
	state := func() string {
		b, _ := os.ReadFile(filepath.Join(r.srvDir, "state.json"))
		return string(b)
	}

	c := r.client("c", r.tls("client-c")...)
	if _, errOut, code := c.ctl(r.mapArgs("intr", "vol")...); code != 7 || !strings.Contains(errOut, "permission denied") {
		t.Fatalf("map by an identity the export grants nothing: exit %d %q", code, errOut)
	}
	a := r.client("a", r.tls("client-a")...)
	if _, errOut, code := a.ctl(r.mapArgs("s-miss", "nosuch")...); code != 3 {
		t.Fatalf("map of a device the server does not have: exit %d %q, want 3 (not found)", code, errOut)
	}
	r.sessionGone("intr")
	r.sessionGone("s-miss")
	if got := r.names(); got != "" {
		t.Fatalf("session names after a refused client and a failed map: %q, want none", got)
	}
	if s := state(); strings.Contains(s, "intr") || strings.Contains(s, "s-miss") {
		t.Fatalf("state file after a refused client and a failed map:\n%s", s)
	}

	a.ok(r.mapArgs("sa", "vol")...)
	kit.WaitFor(t, 10*time.Second, "the admitted session's name saved", func() bool { return strings.Contains(state(), `"sa"`) })
	if got := r.names(); got != "sa=client-a" {
		t.Fatalf("session names after a map that succeeded: %q, want sa=client-a", got)
	}
	a.ok("unmap", "rnbd0")
	r.srv.stop()
	r.startServer()
	if got := r.names(); got != "sa=client-a" {
		t.Fatalf("session names after a restart: %q", got)
	}
	// client-c may not take it now.
	if _, errOut, code := c.ctl(r.mapArgs("sa", "vol")...); code == 0 || !strings.Contains(errOut, "bound to another client's identity") {
		t.Fatalf("client-c's map through client-a's name: exit %d %q", code, errOut)
	}
}
