package e2e

import (
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestPathNamesAsTyped: path show and the path commands of both daemons
// take a path's name as listed (ip:SRC@ip:DST), as typed without the
// ip: prefixes, or as one of its addresses when that names one path; a
// name several paths match is refused naming them (exit 2), one that
// matches none lists the paths there are (exit 3).
func TestPathNamesAsTyped(t *testing.T) {
	dir := t.TempDir()
	kit.SparseFile(t, filepath.Join(dir, "vol.img"), 16<<20)
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "vol", filepath.Join(dir, "vol.img"))
	cl := startClient(t, dir)
	cl.ok("map", "--sessname", "pn", "--path", "ip:127.0.0.2@ip:127.0.0.1", "--device-path", "vol", "--dest-port", fmt.Sprint(port))
	const full = "ip:127.0.0.2@ip:127.0.0.1" // client@server on both sides
	type daemon struct {
		name    string
		ctl     func(...string) (string, string, int)
		records func(...string) []map[string]any
	}
	daemons := []daemon{{"rnbd-server", srv.ctl, srv.records}, {"rnbd-client", cl.ctl, cl.records}}
	for _, d := range daemons {
		for _, typed := range []string{full, "127.0.0.2@127.0.0.1", "127.0.0.1", "ip:127.0.0.2", "127.0.0.2"} {
			recs := d.records("path", "show", typed)
			if len(recs) != 1 || recs[0]["pathname"] != full {
				t.Errorf("%s path show %s: %v, want the path %s", d.name, typed, recs, full)
			}
		}
		_, errOut, code := d.ctl("path", "show", "127.0.0.9")
		if code != 3 || !strings.Contains(errOut, "no path 127.0.0.9 (paths: "+full+")") {
			t.Errorf("%s path show 127.0.0.9: exit %d %q, want 3 listing the paths", d.name, code, errOut)
		}
	}
	// The client's commands on one path take the same names.
	if out, errOut, code := cl.ctl("path", "reconnect", "127.0.0.2@127.0.0.1"); code != 0 || !strings.Contains(out, "reconnected") {
		t.Fatalf("rnbd-client path reconnect 127.0.0.2@127.0.0.1: exit %d %s%s", code, out, errOut)
	}
	// A second path to the same server: its address alone names both.
	cl.ok("path", "add", "pn", "ip:127.0.0.3@ip:127.0.0.1")
	kit.WaitFor(t, 10*time.Second, "the server to have both paths", func() bool { return len(srv.records("path", "list")) == 2 })
	for _, d := range daemons {
		if recs := d.records("path", "show", "127.0.0.1"); len(recs) != 2 {
			t.Errorf("%s path show 127.0.0.1 of two paths to it: %v, want both", d.name, recs)
		}
		if recs := d.records("path", "show", "127.0.0.3"); len(recs) != 1 || recs[0]["pathname"] != "ip:127.0.0.3@ip:127.0.0.1" {
			t.Errorf("%s path show 127.0.0.3: %v", d.name, recs)
		}
		_, errOut, code := d.ctl("path", "disconnect", "127.0.0.1")
		if code != 2 || !strings.Contains(errOut, "127.0.0.1 names 2 paths ("+full+", ip:127.0.0.3@ip:127.0.0.1)") {
			t.Errorf("%s path disconnect 127.0.0.1 of two paths: exit %d %q, want 2 naming both", d.name, code, errOut)
		}
	}
}

// TestPathWithoutSourceNamed: a path given without a source is named by
// its destination until it connects, in the log and in the command
// line's answers, never "<invalid address family>@ip:...": here the
// client restarts while its server is down, and its mapping's restore
// fails, and is tried again, naming the path.
func TestPathWithoutSourceNamed(t *testing.T) {
	dir := t.TempDir()
	kit.SparseFile(t, filepath.Join(dir, "vol.img"), 16<<20)
	port := freePort(t)
	srv := startServer(t, dir, port)
	srv.ok("map", "vol", filepath.Join(dir, "vol.img"))
	cl := startClient(t, dir)
	cl.ok("map", "--sessname", "ns", "--path", "ip:127.0.0.1", "--device-path", "vol", "--dest-port", fmt.Sprint(port))
	srv.stop()
	cl.stop()
	cl = startClient(t, dir)
	kit.WaitFor(t, 20*time.Second, "the restore to fail and be tried again", func() bool {
		return strings.Contains(cl.out.String(), "restoring mapping failed again")
	})
	logs := cl.out.String()
	if !strings.Contains(logs, `path="ip:127.0.0.1"`) || !strings.Contains(logs, "path ip:127.0.0.1: ") {
		t.Errorf("the client's log does not name the path ip:127.0.0.1:\n%s", logs)
	}
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, "invalid address family") {
			t.Errorf("a path without a source named with an invalid address family: %s", l)
		}
	}
	// Nothing listens on 127.0.0.4: path add fails, naming the path.
	cl2 := startClient(t, t.TempDir())
	srv = startServer(t, dir, port)
	cl2.ok("map", "--sessname", "ns2", "--path", "ip:127.0.0.1", "--device-path", "vol", "--dest-port", fmt.Sprint(port))
	if _, errOut, code := cl2.ctl("path", "add", "ns2", "ip:127.0.0.4"); code == 0 || !strings.Contains(errOut, "add path ip:127.0.0.4: ") {
		t.Errorf("path add of a path that cannot connect: exit %d %q, want an error naming ip:127.0.0.4", code, errOut)
	}
}
