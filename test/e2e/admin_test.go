package e2e

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/kit"
)

// adminRig is a server with TLS on its fabric and an admin listener,
// certificates of scripts/test-ca.sh for an admin (ops), a provisioner
// (orch), a reader (mon) and two clients (host-a, host-b) with no role,
// and another authority's "ops". more is added to the configuration.
type adminRig struct {
	dir, pki, other string
	port, admin     int
	srv             *serverDaemon
	vol             string
}

func newAdminRig(t *testing.T, more ...string) *adminRig {
	t.Helper()
	needTools(t, "openssl")
	r := &adminRig{dir: t.TempDir()}
	r.pki, r.other = filepath.Join(r.dir, "pki"), filepath.Join(r.dir, "other")
	ca := func(args ...string) {
		t.Helper()
		run(t, time.Minute, "bash", append([]string{"../../scripts/test-ca.sh"}, args...)...)
	}
	ca(r.pki, "ca")
	ca(r.pki, "server", "srv", "127.0.0.1")
	for _, n := range []string{"ops", "orch", "mon"} {
		ca(r.pki, "admin", n)
	}
	ca(r.pki, "client", "host-a")
	ca(r.pki, "client", "host-b")
	ca(r.other, "ca")
	ca(r.other, "admin", "ops")
	r.vol = filepath.Join(r.dir, "vol.img")
	kit.SparseFile(t, r.vol, 64<<20)
	r.port, r.admin = freePort(t), freePort(t)
	r.srv = startServerConf(t, r.dir, r.port, fmt.Sprintf(`
[admin]
listen = ["127.0.0.1:%d"]
admins = ["ops"]
provisioners = ["orch"]
readers = ["mon"]
export_roots = [%q]
`, r.admin, r.dir)+strings.Join(more, ""), r.tlsArgs(r.pki, "srv", "--tls-")...)
	kit.WaitFor(t, 10*time.Second, "the admin listener's start-up line", func() bool {
		return strings.Contains(r.srv.out.String(), fmt.Sprintf("admin_listen=\"127.0.0.1:%d\"", r.admin))
	})
	return r
}

// tlsArgs are the flags naming dir's certificate of name, with the
// flags' prefix ("--tls-" for the daemons, "--" for rnbd-server's
// --server).
func (r *adminRig) tlsArgs(dir, name, prefix string) []string {
	return []string{prefix + "cert", filepath.Join(dir, name+".crt"), prefix + "key", filepath.Join(dir, name+".key"),
		prefix + "ca", filepath.Join(r.pki, "ca.crt")}
}

// remote runs rnbd-server against the admin listener as name of dir.
func (r *adminRig) remote(t *testing.T, dir, name string, args ...string) (string, string, int) {
	t.Helper()
	return runCode(t, time.Minute, bin("rnbd-server"), append(append([]string{"--server", fmt.Sprintf("https://127.0.0.1:%d", r.admin),
		"--socket", "/nonexistent/not-used.sock"}, r.tlsArgs(dir, name, "--")...), args...)...)
}

// audited reports whether the daemon logged an audit line with every
// key=value of kv (values quoted or not, as the text log writes them).
func (r *adminRig) audited(kv ...string) bool {
	sc := bufio.NewScanner(strings.NewReader(r.srv.out.String()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.Contains(l, "msg=audit") {
			continue
		}
		ok := true
		for i := 0; i+1 < len(kv); i += 2 {
			k, v := kv[i], kv[i+1]
			if !strings.Contains(l, " "+k+"="+v) && !strings.Contains(l, " "+k+"=\""+v) {
				ok = false
			}
		}
		if ok {
			return true
		}
	}
	return false
}

func (r *adminRig) waitAudit(t *testing.T, kv ...string) {
	t.Helper()
	kit.WaitFor(t, 10*time.Second, "the audit line "+strings.Join(kv, " "), func() bool { return r.audited(kv...) })
}

// TestAdminRemote: rnbd-server --server manages the node over the admin
// listener by its certificate's role; an admin maps beneath
// export_roots, grants-only unless it says otherwise; a reader and a
// provisioner cannot map a path, a provisioner cannot bind a session
// name (server settings), a client without a certificate or with
// another authority's is refused in the handshake: each says so, and
// the daemon's log has an audit line.
func TestAdminRemote(t *testing.T) {
	r := newAdminRig(t)

	// An admin maps and lists, from afar.
	if _, errOut, code := r.remote(t, r.pki, "ops", "map", "vol", r.vol, "--allow-identity", "host-a"); code != 0 {
		t.Fatalf("a remote map by an admin: exit %d: %s", code, errOut)
	}
	r.waitAudit(t, "identity", "ops", "method", "POST", "object", "/v1/exports", "result", "ok")
	out, errOut, code := r.remote(t, r.pki, "mon", "export", "list", "--format", "json")
	var recs []map[string]any
	if code != 0 || json.Unmarshal([]byte(out), &recs) != nil || len(recs) != 1 || recs[0]["name"] != "vol" {
		t.Fatalf("a remote export list by a reader: exit %d: %s%s", code, out, errOut)
	}
	// The environment does what the flags do.
	cmd := []string{"export", "list"}
	env := append(os.Environ(), fmt.Sprintf("RNBD_SERVER=https://127.0.0.1:%d", r.admin), "RNBD_CERT="+filepath.Join(r.pki, "mon.crt"),
		"RNBD_KEY="+filepath.Join(r.pki, "mon.key"), "RNBD_CA="+filepath.Join(r.pki, "ca.crt"))
	if out, err := cmdWithEnv(env, bin("rnbd-server"), cmd...); err != nil || !strings.Contains(out, "vol") {
		t.Fatalf("export list with RNBD_SERVER: %v\n%s", err, out)
	}

	out, errOut, code = r.remote(t, r.pki, "mon", "export", "show", "vol", "--format", "json")
	if code != 0 || json.Unmarshal([]byte(out), &recs) != nil || len(recs) != 1 || recs[0]["grants_only"] != true {
		t.Fatalf("an export an admin mapped remotely without --grants-only: exit %d: %s%s, want grants-only", code, out, errOut)
	}
	// Outside export_roots, not even an admin maps.
	_, errOut, code = r.remote(t, r.pki, "ops", "map", "shadow", "/etc/shadow")
	if code != 7 || !strings.Contains(errOut, "beneath none of [admin] export_roots") {
		t.Fatalf("a remote map of /etc/shadow by an admin: exit %d: %q", code, errOut)
	}

	// A reader may not map, nor a provisioner.
	for _, who := range []string{"mon", "orch"} {
		_, errOut, code = r.remote(t, r.pki, who, "map", "vol2", r.vol)
		if code != 7 || !strings.Contains(errOut, "may not POST /v1/exports: the route needs the admin right") {
			t.Fatalf("a map by %s: exit %d: %q", who, code, errOut)
		}
	}
	r.waitAudit(t, "identity", "mon", "method", "POST", "object", "/v1/exports", "result", "permission_denied", "role", "reader")
	r.waitAudit(t, "identity", "orch", "method", "POST", "object", "/v1/exports", "result", "permission_denied", "role", "provisioner")
	_, errOut, code = r.remote(t, r.pki, "orch", "session", "bind", "s1", "host-a")
	if code != 7 || !strings.Contains(errOut, "identity orch (role provisioner) may not PUT /v1/session-names/s1: the route needs the admin right") {
		t.Fatalf("a session bind by a provisioner: exit %d: %q", code, errOut)
	}
	r.waitAudit(t, "identity", "orch", "method", "PUT", "object", "/v1/session-names/s1", "result", "permission_denied")

	// Another authority's certificate: the server refuses it, and the
	// CLI says so.
	_, errOut, code = r.remote(t, r.other, "ops", "export", "list")
	if code != 7 || !strings.Contains(errOut, "the server refused our certificate") {
		t.Fatalf("a certificate of another CA: exit %d: %q", code, errOut)
	}
	r.waitAudit(t, "identity", "ops", "object", "tls", "result", "permission_denied", "error", "the client certificate is not trusted")
	// A server certificate the CLI does not trust (--ca of another
	// authority).
	_, errOut, code = runCode(t, time.Minute, bin("rnbd-server"), "--server", fmt.Sprintf("https://127.0.0.1:%d", r.admin),
		"--cert", filepath.Join(r.pki, "ops.crt"), "--key", filepath.Join(r.pki, "ops.key"), "--ca", filepath.Join(r.other, "ca.crt"), "export", "list")
	if code != 7 || !strings.Contains(errOut, "the server's certificate is not trusted") {
		t.Fatalf("an untrusted server certificate: exit %d: %q", code, errOut)
	}
	// No certificate at all: a TLS client without one.
	c, err := tls.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", r.admin), &tls.Config{ServerName: "127.0.0.1", RootCAs: pool(t, filepath.Join(r.pki, "ca.crt"))})
	if err == nil {
		fmt.Fprintf(c, "GET /v1/exports HTTP/1.1\r\nHost: x\r\n\r\n")
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
		c.Close()
	}
	if err == nil || !strings.Contains(err.Error(), "bad certificate") {
		t.Fatalf("a client without a certificate: %v, want a bad certificate alert", err)
	}
	r.waitAudit(t, "object", "tls", "result", "permission_denied", "error", "the client presented no certificate")
	// Nor plaintext HTTP.
	if pc, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", r.admin)); err == nil {
		fmt.Fprintf(pc, "GET /v1/exports HTTP/1.1\r\nHost: x\r\n\r\n")
		pc.SetReadDeadline(time.Now().Add(10 * time.Second))
		b := make([]byte, 64)
		n, _ := pc.Read(b)
		pc.Close()
		if strings.Contains(string(b[:n]), "200 OK") {
			t.Fatalf("plaintext HTTP answered: %q", b[:n])
		}
	}
	// The local socket is the admin "local", audited too.
	r.srv.ok("unmap", "vol")
	r.waitAudit(t, "identity", "local", "remote", "unix", "method", "DELETE", "object", "/v1/exports/vol", "result", "ok")
}

// TestAdminConfigRefused: [admin] listen without TLS, or on the fabric's
// port, keeps the daemon from starting.
func TestAdminConfigRefused(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t)
	for _, c := range []struct{ conf, says string }{
		{fmt.Sprintf("listen = [\"tcp://127.0.0.1:%d\"]\n[admin]\nlisten = [\"127.0.0.1:%d\"]\n", port, freePort(t)), "not cert, key and ca"},
		{fmt.Sprintf("listen = [\"tcp://127.0.0.1:%d\"]\n[tls]\n%s[admin]\nlisten = [\"127.0.0.1:%d\"]\n", port, tlsFiles(t, dir, "srv"), port),
			"never served on the data port"},
	} {
		p := filepath.Join(dir, "c.toml")
		if err := os.WriteFile(p, []byte("version = 1\n"+c.conf), 0o644); err != nil {
			t.Fatal(err)
		}
		_, errOut, code := runCode(t, 30*time.Second, bin("rnbd-server"), "daemon", "--config", p, "--control-socket", filepath.Join(dir, "s.sock"),
			"--state-file", filepath.Join(dir, "s.json"))
		if code != 2 || !strings.Contains(errOut, c.says) {
			t.Errorf("%s: exit %d %q, want 2 saying %q", c.conf, code, errOut, c.says)
		}
	}
}

// TestDiscover: rnbd-client discover lists what each identity may open,
// with the client's own certificate, in every format.
func TestDiscover(t *testing.T) {
	r := newAdminRig(t)
	r.srv.ok("map", "shared", r.vol)
	r.srv.ok("map", "a-only", r.vol, "--allow-identity", "host-a")
	r.srv.ok("map", "both", r.vol, "--allow-identity", "host-a", "--allow-identity", "host-b=ro")
	r.srv.ok("map", "ro", r.vol, "--ro")
	r.srv.ok("map", "elsewhere", r.vol, "--allow-from", "10.99.0.0/16")
	discover := func(who string, args ...string) (string, string, int) {
		t.Helper()
		return runCode(t, time.Minute, bin("rnbd-client"), append(append([]string{"discover", "--config", "/dev/null",
			"--path", "ip:127.0.0.1", "--port", fmt.Sprint(r.admin)}, r.tlsArgs(r.pki, who, "--tls-")...), args...)...)
	}
	list := func(who string) []string {
		t.Helper()
		out, errOut, code := discover(who, "--format", "json")
		var recs []map[string]any
		if code != 0 || json.Unmarshal([]byte(out), &recs) != nil {
			t.Fatalf("discover as %s: exit %d: %s%s", who, code, out, errOut)
		}
		var got []string
		for _, x := range recs {
			if x["size"] != float64(64<<20) {
				t.Errorf("discover as %s: %v: size, want %d", who, x, 64<<20)
			}
			got = append(got, fmt.Sprintf("%v=%v/%v", x["name"], x["access"], x["read_only"]))
		}
		return got
	}
	if got, want := list("host-a"), []string{"a-only=rw/false", "both=rw/false", "ro=ro/true", "shared=rw/false"}; !slices.Equal(got, want) {
		t.Errorf("host-a discovers %v, want %v", got, want)
	}
	if got, want := list("host-b"), []string{"both=ro/false", "ro=ro/true", "shared=rw/false"}; !slices.Equal(got, want) {
		t.Errorf("host-b discovers %v, want %v", got, want)
	}
	for format, says := range map[string]string{"table": "a-only", "csv": "name,size,access,read_only", "xml": "<name>a-only</name>"} {
		out, errOut, code := discover("host-a", "--format", format)
		if code != 0 || !strings.Contains(out, says) {
			t.Errorf("discover --format %s: exit %d: %s%s, want %q", format, code, out, errOut, says)
		}
	}
	// Another authority's certificate learns nothing.
	_, errOut, code := runCode(t, time.Minute, bin("rnbd-client"), append([]string{"discover", "--config", "/dev/null",
		"--path", "ip:127.0.0.1", "--port", fmt.Sprint(r.admin)}, r.tlsArgs(r.other, "ops", "--tls-")...)...)
	if code != 7 || !strings.Contains(errOut, "the server refused our certificate") {
		t.Errorf("discover with another CA's certificate: exit %d %q", code, errOut)
	}
	// Without TLS: said, before anything is sent.
	_, errOut, code = runCode(t, time.Minute, bin("rnbd-client"), "discover", "--config", "/dev/null", "--path", "ip:127.0.0.1",
		"--port", fmt.Sprint(r.admin))
	if code != 2 || !strings.Contains(errOut, "the admin listener takes TLS only") {
		t.Errorf("discover without TLS: exit %d %q", code, errOut)
	}
}

// cmdWithEnv runs a command with env and returns its output.
func cmdWithEnv(env []string, name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// pool is the authority of a PEM file.
func pool(t *testing.T, file string) *x509.CertPool {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(b) {
		t.Fatalf("%s: no certificate", file)
	}
	return p
}
