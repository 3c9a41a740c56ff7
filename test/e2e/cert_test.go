package e2e

import (
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/certs"
	"github.com/rnbd/rnbd/test/kit"
)

// TestCertCommands: the certificates the packages' own commands make
// (rnbd-server cert, rnbd-client cert: no openssl, no script) run a
// storage node's fabric and admin listener: an operator's client
// certificate manages the node over the admin listener by its role, a
// worker's maps the export granted to its identity over TLS, and cert
// list shows them all signed, in date and with their keys.
func TestCertCommands(t *testing.T) {
	dir := t.TempDir()
	pki, caKey := filepath.Join(dir, "pki"), filepath.Join(dir, "private", "ca.key")
	cert := func(prog string, args ...string) string {
		t.Helper()
		out, errOut, code := runCode(t, time.Minute, bin(prog), append(append([]string{"cert"}, args...), "--certs-dir", pki, "--ca-key", caKey)...)
		if code != 0 {
			t.Fatalf("%s cert %s: exit %d: %s", prog, strings.Join(args, " "), code, errOut)
		}
		return out
	}
	cert("rnbd-server", "create-ca")
	cert("rnbd-server", "create-node", "storage-a", "127.0.0.1", "localhost", "--file", "server")
	cert("rnbd-server", "create-client", "ops")                       // an admin
	cert("rnbd-server", "create-client", "nobody")                    // no role
	cert("rnbd-client", "create-client", "host7", "--file", "client") // a worker

	out, errOut, code := runCode(t, time.Minute, bin("rnbd-server"), "cert", "list", "--certs-dir", pki, "-f", "json")
	var recs []map[string]any
	if code != 0 || json.Unmarshal([]byte(out), &recs) != nil {
		t.Fatalf("cert list: exit %d: %s%s", code, out, errOut)
	}
	var got []string
	for _, r := range recs {
		got = append(got, fmt.Sprintf("%s:%s:%v:%v:%s", r["file"], r["kind"], r["names"], r["usages"], r["status"]))
	}
	want := "ca.crt:ca:[rnbd CA]:[certSign]:ok client.crt:client:[host7]:[clientAuth]:ok nobody.crt:client:[nobody]:[clientAuth]:ok " +
		"ops.crt:client:[ops]:[clientAuth]:ok server.crt:node:[storage-a localhost]:[serverAuth clientAuth]:ok"
	if strings.Join(got, " ") != want {
		t.Errorf("cert list:\n%s\nwant\n%s", strings.Join(got, " "), want)
	}

	vol := filepath.Join(dir, "vol.img")
	kit.SparseFile(t, vol, 16<<20)
	port, admin := freePort(t), freePort(t)
	files := func(name, prefix string) []string {
		return []string{prefix + "cert", filepath.Join(pki, name+".crt"), prefix + "key", filepath.Join(pki, name+".key"),
			prefix + "ca", filepath.Join(pki, "ca.crt")}
	}
	srv := startServerConf(t, dir, port, fmt.Sprintf("[admin]\nlisten = [\"127.0.0.1:%d\"]\nadmins = [\"ops\"]\nexport_roots = [%q]\n", admin, dir), files("server", "--tls-")...)
	kit.WaitFor(t, 10*time.Second, "the admin listener's start-up line", func() bool {
		return strings.Contains(srv.out.String(), fmt.Sprintf("admin_listen=\"127.0.0.1:%d\"", admin))
	})
	remote := func(name string, args ...string) (string, string, int) {
		return runCode(t, time.Minute, bin("rnbd-server"), append(append([]string{"--server", fmt.Sprintf("https://127.0.0.1:%d", admin),
			"--socket", "/nonexistent/not-used.sock"}, files(name, "--")...), args...)...)
	}
	if _, errOut, code := remote("ops", "map", "vol", vol, "--allow-identity", "host7"); code != 0 {
		t.Fatalf("a remote map by ops (an admin): exit %d: %s", code, errOut)
	}
	if out, errOut, code := remote("ops", "export", "list"); code != 0 || !strings.Contains(out, "host7") {
		t.Fatalf("a remote export list by ops: exit %d: %s%s", code, out, errOut)
	}
	// The admin listener names the host dialled too (localhost, a DNS
	// name of the node's certificate).
	if _, errOut, code := runCode(t, time.Minute, bin("rnbd-server"), append(append([]string{"--server", fmt.Sprintf("https://localhost:%d", admin),
		"--socket", "/nonexistent/not-used.sock"}, files("ops", "--")...), "export", "list")...); code != 0 {
		t.Fatalf("export list by ops at https://localhost: exit %d: %s", code, errOut)
	}
	if _, errOut, code := remote("nobody", "map", "vol2", vol); code != 7 || !strings.Contains(errOut, "may not POST /v1/exports") {
		t.Fatalf("a remote map by an identity with no role: exit %d: %q", code, errOut)
	}

	// The worker maps the export granted to host7 over TLS, and reads
	// it.
	cd := filepath.Join(dir, "client")
	os.MkdirAll(cd, 0o755)
	c := startClient(t, cd, files("client", "--tls-")...)
	out = c.ok("map", "--sessname", "w1", "--path", "ip:127.0.0.1", "--device-path", "vol", "--dest-port", fmt.Sprint(port))
	if !strings.HasPrefix(out, "rnbd0 mapped: ") {
		t.Fatalf("map: %q", out)
	}
	sess := srv.records("session", "list", "--fields", "all")
	if len(sess) != 1 || sess[0]["peer"] != "host7" {
		t.Fatalf("the server's sessions: %v", sess)
	}
	c.ok("unmap", "rnbd0")
}

// TestAdminCertWithoutClientAuth: a certificate of the admin listener's
// CA, naming an admin, but made for a server (serverAuth only), is
// refused: the command says it lacks the clientAuth extended key usage,
// not that it is of another CA or names no identity.
func TestAdminCertWithoutClientAuth(t *testing.T) {
	dir := t.TempDir()
	pki, caKey := filepath.Join(dir, "pki"), filepath.Join(dir, "ca.key")
	for _, args := range [][]string{{"create-ca"}, {"create-node", "srv", "127.0.0.1"}} {
		if _, errOut, code := runCode(t, time.Minute, bin("rnbd-server"), append(append([]string{"cert"}, args...), "--certs-dir", pki, "--ca-key", caKey)...); code != 0 {
			t.Fatalf("cert %v: exit %d: %s", args, code, errOut)
		}
	}
	// ops's certificate as a server's: serverAuth only.
	ca, err := certs.LoadCA(pki, caKey)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := certs.NewKey()
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "ops"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(24 * time.Hour), KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	if _, _, err := certs.WriteCert(pki, "ops", cert, key, false); err != nil {
		t.Fatal(err)
	}
	port, admin := freePort(t), freePort(t)
	flags := func(name, prefix string) []string {
		return []string{prefix + "cert", filepath.Join(pki, name+".crt"), prefix + "key", filepath.Join(pki, name+".key"),
			prefix + "ca", filepath.Join(pki, "ca.crt")}
	}
	srv := startServerConf(t, dir, port, fmt.Sprintf("[admin]\nlisten = [\"127.0.0.1:%d\"]\nadmins = [\"ops\"]\n", admin), flags("srv", "--tls-")...)
	kit.WaitFor(t, 10*time.Second, "the admin listener's start-up line", func() bool {
		return strings.Contains(srv.out.String(), fmt.Sprintf("admin_listen=\"127.0.0.1:%d\"", admin))
	})
	_, errOut, code := runCode(t, time.Minute, bin("rnbd-server"), append(append([]string{"--server", fmt.Sprintf("https://127.0.0.1:%d", admin),
		"--socket", "/nonexistent/not-used.sock"}, flags("ops", "--")...), "export", "list")...)
	if code != 7 || !strings.Contains(errOut, "has no clientAuth extended key usage (it has serverAuth)") {
		t.Fatalf("an admin certificate without clientAuth: exit %d: %q", code, errOut)
	}
}
