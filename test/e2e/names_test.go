package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/url"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/testfs"
)

// badNames are volume and snapshot names of every class the API could
// not address or a command line would misread; goodNames are names at
// the edges of the rule that are names.
var (
	badNames = []string{
		".", "..", "...", // dot-segments, and dots only
		"-", "-x", "--force", "-h", // options
		"a/b", "..%2F", "%2e%2e", "a%b", "a?b", "a#b", // a URL path's own
		"a b", "a\tb", "a\x01b", // blanks and controls
		"é", "a+b", strings.Repeat("x", 129), // outside the alphabet, too long
	}
	goodNames = []string{"a.b", ".a", "a.", "..a", "a..b", "a-", "_", "A_1-z.9", strings.Repeat("y", 128)}
)

// ctlArgs runs rnbd-server with args after the control socket, so that
// a name may follow a "--" (which ends the flags) and begin with '-'.
func (d *serverDaemon) ctlArgs(args ...string) (string, string, int) {
	d.t.Helper()
	cmd := exec.Command(bin("rnbd-server"), append([]string{"--socket", d.sock}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		return stdout.String(), stderr.String(), ee.ExitCode()
	case err != nil:
		d.t.Fatalf("rnbd-server %q: %v", args, err)
	}
	return stdout.String(), stderr.String(), 0
}

// api is the daemon's control API over its socket: the status and the
// decoded body of one request.
func (d *serverDaemon) api(method, path string, body any) (int, any) {
	d.t.Helper()
	c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", d.sock)
		}}}
	defer c.CloseIdleConnections()
	var rd bytes.Buffer
	if body != nil {
		if err := json.NewEncoder(&rd).Encode(body); err != nil {
			d.t.Fatal(err)
		}
	}
	req, err := http.NewRequest(method, "http://daemon"+path, &rd)
	if err != nil {
		d.t.Fatal(err)
	}
	rsp, err := c.Do(req)
	if err != nil {
		d.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer rsp.Body.Close()
	var v any
	json.NewDecoder(rsp.Body).Decode(&v)
	return rsp.StatusCode, v
}

// TestVolumeNames: each class of volume and snapshot name, through the
// command line and the control API of a real rnbd-server with a
// directory pool. A name the API could not address, or a command line
// would take for an option, is refused at create — invalid_argument,
// exit 2 and HTTP 400, saying the rule — and nothing is made; a name at
// the rule's edges is created, shown and deleted through both, as a
// volume and as a snapshot.
func TestVolumeNames(t *testing.T) {
	pool := testfs.ReflinkDir(t) // snapshots are reflinks
	dir := t.TempDir()
	srv := startServerConf(t, dir, freePort(t), poolConf("files", pool))
	const rule = "want 1 to 128 of A-Z a-z 0-9 . _ -, not all dots, not beginning with -"
	srv.ok("volume", "create", "base", "--pool", "files", "--size", "1MiB")

	for _, n := range badNames {
		for _, args := range [][]string{
			{"volume", "create", "--pool", "files", "--size", "1MiB", "--", n},
			{"volume", "snapshot", "create", "base", "--", n},
		} {
			if _, errOut, code := srv.ctlArgs(args...); code != 2 || !strings.Contains(errOut, rule) {
				t.Errorf("rnbd-server %q: exit %d %q, want 2 saying the rule", args, code, errOut)
			}
		}
		for _, c := range []struct {
			path string
			body any
		}{
			{"/v1/volumes", map[string]any{"name": n, "pool": "files", "size": "1MiB"}},
			{"/v1/snapshots", map[string]any{"name": n, "volume": "base"}},
		} {
			status, rsp := srv.api("POST", c.path, c.body)
			m, _ := rsp.(map[string]any)
			if msg, _ := m["error"].(string); status != 400 || m["code"] != "invalid_argument" || !strings.Contains(msg, rule) {
				t.Errorf("POST %s %q: %d %v, want 400 invalid_argument saying the rule", c.path, n, status, rsp)
			}
		}
	}
	if vs := srv.records("volume", "list"); len(vs) != 1 || vs[0]["name"] != "base" {
		t.Fatalf("refused creates made %v", vs)
	}
	if ss := srv.records("volume", "snapshot", "list"); len(ss) != 0 {
		t.Fatalf("refused creates made snapshots %v", ss)
	}
	if fs := poolFiles(t, pool); !slices.Equal(fs, []string{".rnbd-tmp/", "base.img"}) {
		t.Fatalf("refused creates left %v in the pool", fs)
	}

	// Each good name: made by the command line, seen and deleted by the
	// API; made by the API, seen and deleted by the command line.
	for _, n := range goodNames {
		esc := url.PathEscape(n)
		srv.ok("volume", "create", n, "--pool", "files", "--size", "1MiB")
		srv.ok("volume", "snapshot", "create", n, n)
		if status, rsp := srv.api("GET", "/v1/volumes/"+esc, nil); status != 200 || !hasName(rsp, n) {
			t.Errorf("GET /v1/volumes/%s: %d %v", esc, status, rsp)
		}
		if status, rsp := srv.api("GET", "/v1/snapshots/"+esc, nil); status != 200 || !hasName(rsp, n) {
			t.Errorf("GET /v1/snapshots/%s: %d %v", esc, status, rsp)
		}
		for _, p := range []string{"/v1/snapshots/", "/v1/volumes/"} {
			if status, rsp := srv.api("DELETE", p+esc, nil); status != 200 {
				t.Errorf("DELETE %s%s: %d %v", p, esc, status, rsp)
			}
		}

		if status, rsp := srv.api("POST", "/v1/volumes", map[string]any{"name": n, "pool": "files", "size": "1MiB"}); status != 200 {
			t.Fatalf("POST /v1/volumes %q: %d %v", n, status, rsp)
		}
		if status, rsp := srv.api("POST", "/v1/snapshots", map[string]any{"name": n, "volume": n}); status != 200 {
			t.Fatalf("POST /v1/snapshots %q: %d %v", n, status, rsp)
		}
		if v := srv.records("volume", "show", n); len(v) != 1 || v[0]["name"] != n {
			t.Errorf("volume show %q: %v", n, v)
		}
		if s := srv.records("volume", "snapshot", "show", n); len(s) != 1 || s[0]["name"] != n || s[0]["volume"] != n {
			t.Errorf("volume snapshot show %q: %v", n, s)
		}
		srv.ok("volume", "snapshot", "delete", n)
		srv.ok("volume", "delete", n)
	}
	if vs := srv.records("volume", "list"); len(vs) != 1 {
		t.Fatalf("left %v", vs)
	}
	if fs := poolFiles(t, pool); !slices.Equal(fs, []string{".rnbd-snap/", ".rnbd-tmp/", "base.img"}) {
		t.Fatalf("left %v in the pool", fs)
	}
}

// hasName says whether an answer is one record, or a list of one, named
// n.
func hasName(v any, n string) bool {
	if l, ok := v.([]any); ok && len(l) == 1 {
		v = l[0]
	}
	m, ok := v.(map[string]any)
	return ok && m["name"] == n
}
