package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
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
	ca(other, "ca")
	ca(other, "client", "client-a") // the same name from an authority the server does not trust
	tlsArgs := func(d, name string) []string {
		return []string{"--tls-cert", filepath.Join(d, name+".crt"), "--tls-key", filepath.Join(d, name+".key"),
			"--tls-ca", filepath.Join(d, "ca.crt")}
	}
	vol := filepath.Join(dir, "vol.img")
	sparseFile(t, vol, 256<<20)
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
	if _, errOut, code := b.ctl(mapArgs("sa2", "rw")...); code != 7 || !strings.Contains(errOut, "rnbd: open vol: permission denied") {
		t.Fatalf("rw map by an identity granted ro: exit %d %q", code, errOut)
	}
	b.ok(mapArgs("sa2", "ro")...)

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
	for _, says := range []string{"no TLS from a client, but the server requires it", "TLS handshake failed"} {
		if !strings.Contains(srv.out.String(), says) {
			t.Fatalf("server did not log %q:\n%s", says, srv.out.String())
		}
	}
	if sess := srv.records("session", "list"); len(sess) != 2 {
		t.Fatalf("server sessions after the refused clients: %v", sess)
	}
}
