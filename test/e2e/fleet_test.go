package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/kit"
)

// TestFleetRemote is a storage node driven from afar, as an orchestrator
// drives it, over two network namespaces: the node (rnbd-server with a
// directory pool, TLS on its fabric and its admin listener) and a host
// (rnbd-client with its own certificate, and the orchestrator's
// rnbd-server --server). The orchestrator (a provisioner) creates a
// volume open to its grants only and grants it to the host; the host
// discovers it (another identity does not), maps it with its own
// identity and fio writes and verifies through it; the orchestrator
// revokes the grant and the host's next open is refused. Each change is
// an audit line naming the orchestrator.
func TestFleetRemote(t *testing.T) {
	needTools(t, "fio", "openssl")
	r := newNamespaces(t, "flt", 211)
	dir := t.TempDir()
	pki, pool := filepath.Join(dir, "pki"), filepath.Join(dir, "pool")
	if err := os.Mkdir(pool, 0o700); err != nil {
		t.Fatal(err)
	}
	node := r.addr(1, 1)
	for _, args := range [][]string{{"ca"}, {"server", "node", node}, {"admin", "orch"}, {"client", "host-b"}, {"client", "host-c"}} {
		run(t, time.Minute, "bash", append([]string{"../../scripts/test-ca.sh", pki}, args...)...)
	}
	files := func(name, prefix string) []string {
		return []string{prefix + "cert", filepath.Join(pki, name+".crt"), prefix + "key", filepath.Join(pki, name+".key"),
			prefix + "ca", filepath.Join(pki, "ca.crt")}
	}
	conf := filepath.Join(dir, "server.toml")
	ssock, csock := filepath.Join(dir, "s.sock"), filepath.Join(dir, "c.sock")
	err := os.WriteFile(conf, []byte(fmt.Sprintf(`listen = ["tcp://%s:1234"]
control_socket = %q
state_file = %q
[tls]
cert = %q
key = %q
ca = %q
[admin]
listen = ["%s"]
provisioners = ["orch"]
[[pool]]
name = "files"
type = "dir"
path = %q
`, node, ssock, filepath.Join(dir, "s.json"), filepath.Join(pki, "node.crt"), filepath.Join(pki, "node.key"),
		filepath.Join(pki, "ca.crt"), node, pool)), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	srv := start(t, "ip", "netns", "exec", r.srvNS, bin("rnbd-server"), "daemon", "--config", conf)
	cl := start(t, append([]string{"ip", "netns", "exec", r.cliNS, bin("rnbd-client"), "daemon", "--config", "/dev/null",
		"--control-socket", csock, "--state-file", filepath.Join(dir, "c.json"), "--socket-dir", dir}, files("host-b", "--tls-")...)...)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("rnbd-server:\n%s\nrnbd-client:\n%s", srv.out.String(), cl.out.String())
		}
	})
	kit.WaitFor(t, 20*time.Second, "the node's admin listener", func() bool {
		return strings.Contains(srv.out.String(), `admin_listen="`+node+`:1235"`)
	})
	kit.WaitFor(t, 20*time.Second, "the host's control socket", func() bool { _, err := os.Stat(csock); return err == nil })

	// The orchestrator, on the host's side of the network.
	orch := func(args ...string) (string, string, int) {
		t.Helper()
		return runCode(t, time.Minute, "ip", append(append([]string{"netns", "exec", r.cliNS, bin("rnbd-server"),
			"--server", "https://" + node + ":1235"}, files("orch", "--")...), args...)...)
	}
	mustOrch := func(args ...string) {
		t.Helper()
		if out, errOut, code := orch(args...); code != 0 {
			t.Fatalf("rnbd-server --server … %s: exit %d: %s%s", strings.Join(args, " "), code, out, errOut)
		}
	}
	mustOrch("volume", "create", "pvc-1", "--pool", "files", "--size", "64MiB", "--grants-only")
	mustOrch("volume", "grant", "pvc-1", "host-b")
	if _, errOut, code := orch("session", "disconnect", "x"); code != 7 || !strings.Contains(errOut, "role provisioner") {
		t.Fatalf("a provisioner disconnecting a session: exit %d %q", code, errOut)
	}

	// Discovery: host-b is granted pvc-1; host-c nothing.
	discover := func(id string) []map[string]any {
		t.Helper()
		out, errOut, code := runCode(t, time.Minute, "ip", append([]string{"netns", "exec", r.cliNS, bin("rnbd-client"),
			"--socket", csock, "discover", "--path", "ip:" + node, "--format", "json"}, files(id, "--tls-")...)...)
		var recs []map[string]any
		if code != 0 || json.Unmarshal([]byte(out), &recs) != nil {
			t.Fatalf("discover as %s: exit %d: %s%s", id, code, out, errOut)
		}
		return recs
	}
	if d := discover("host-b"); len(d) != 1 || d[0]["name"] != "pvc-1" || d[0]["size"] != float64(64<<20) || d[0]["access"] != "rw" {
		t.Fatalf("host-b discovers %v, want pvc-1 rw of 64 MiB", d)
	}
	if d := discover("host-c"); len(d) != 0 {
		t.Fatalf("host-c discovers %v, want nothing", d)
	}

	// The host maps it with its own identity; fio writes and verifies.
	mapArgs := []string{"netns", "exec", r.cliNS, bin("rnbd-client"), "--socket", csock, "map", "--sessname", "host-b",
		"--device-path", "pvc-1", "--path", "ip:" + r.addr(1, 2) + "@ip:" + node}
	if out, errOut, code := runCode(t, time.Minute, "ip", mapArgs...); code != 0 {
		t.Fatalf("map: exit %d: %s%s", code, out, errOut)
	}
	fioVerify(t, "nbd+unix:///pvc-1?socket="+filepath.Join(dir, "rnbd0.sock"), "64k", "32m", 2*time.Minute)

	// Revoked: the device it has open stays until closed; its next open
	// is refused.
	mustOrch("volume", "revoke", "pvc-1", "host-b")
	run(t, time.Minute, "ip", "netns", "exec", r.cliNS, bin("rnbd-client"), "--socket", csock, "unmap", "rnbd0")
	if out, errOut, code := runCode(t, time.Minute, "ip", mapArgs...); code != 7 {
		t.Fatalf("map after the revoke: exit %d, want 7 (permission_denied): %s%s", code, out, errOut)
	}
	if d := discover("host-b"); len(d) != 0 {
		t.Fatalf("host-b discovers %v after the revoke", d)
	}
	for _, want := range [][]string{{"method=POST", "object=/v1/volumes "}, {"method=POST", "object=/v1/volumes/pvc-1/grants "},
		{"method=DELETE", "object=/v1/volumes/pvc-1/grants/host-b "}} {
		found := false
		for _, l := range strings.Split(srv.out.String(), "\n") {
			if strings.Contains(l, "msg=audit") && strings.Contains(l, "identity=orch") && strings.Contains(l, "result=ok") &&
				strings.Contains(l, want[0]) && strings.Contains(l, want[1]) {
				found = true
			}
		}
		if !found {
			t.Errorf("no audit line of orch with %v and result=ok", want)
		}
	}
}
