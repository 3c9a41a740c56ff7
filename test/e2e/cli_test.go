package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestFlagErrors: a port out of range, on the command line or in the
// kernel-style map string, is refused in plain words (before: strconv's
// "strconv.ParseUint: parsing "99999": value out of range") with exit 2,
// usage; so is a bad number of any flag.
func TestFlagErrors(t *testing.T) {
	for _, c := range []struct {
		bin  string
		args []string
		want string
	}{
		{"rnbd-client", []string{"map", "--sessname", "s", "--path", "ip:127.0.0.1", "--device-path", "v", "--dest-port", "99999"},
			`rnbd-client: invalid argument "99999" for "--dest-port" flag: want a port number from 1 to 65535` + "\n"},
		{"rnbd-client", []string{"map", "--dest-port", "0"},
			`rnbd-client: invalid argument "0" for "--dest-port" flag: want a port number from 1 to 65535` + "\n"},
		{"rnbd-client", []string{"map", "sessname=s path=ip:127.0.0.1 device_path=v dest_port=99999", "--socket", "/nonexistent/client.sock"},
			"rnbd-client: map: dest_port 99999: want a port number from 1 to 65535\n"},
		{"rnbd-server", []string{"daemon", "--queue-depth", "x"},
			`rnbd-server: invalid argument "x" for "--queue-depth" flag: not a number` + "\n"},
		{"rnbd-client", []string{"daemon", "--hb-missed-max", "99999999999999999999"},
			`rnbd-client: invalid argument "99999999999999999999" for "--hb-missed-max" flag: out of range` + "\n"},
	} {
		_, stderr, code := runCode(t, 10*time.Second, bin(c.bin), c.args...)
		if code != 2 || stderr != c.want || strings.Contains(stderr, "strconv") {
			t.Errorf("%s %s: exit %d, %q; want 2, %q", c.bin, strings.Join(c.args, " "), code, stderr, c.want)
		}
	}
}

// TestVersion: both binaries say their version as the build stamped it
// from git (scripts/version.sh, as the Makefile and the packages do),
// the commit, the Go version and the build's flags, by --version and
// by version (-f json for scripts); both daemons' metrics carry the
// same as rnbd_build_info.
func TestVersion(t *testing.T) {
	wantVersion := strings.TrimSpace(run(t, time.Minute, "../../scripts/version.sh", "-v"))
	rev := "unknown"
	if out, err := exec.Command("git", "rev-parse", "HEAD").Output(); err == nil {
		rev = strings.TrimSpace(string(out))
		if st, _ := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); len(st) > 0 {
			rev += "-dirty"
		}
	}
	for _, name := range []string{"rnbd-server", "rnbd-client"} {
		flag := run(t, 10*time.Second, bin(name), "--version")
		cmd := run(t, 10*time.Second, bin(name), "version")
		want := fmt.Sprintf("%s %s\nrevision: %s\ngo: %s\nbuild: ", name, wantVersion, rev, runtime.Version())
		if !strings.HasPrefix(flag, want) || flag != cmd {
			t.Errorf("%s --version:\n%s\nversion:\n%s\nwant them equal, starting\n%s", name, flag, cmd, want)
		}
		if !strings.Contains(flag, "GOOS=linux") {
			t.Errorf("%s --version has no build flags:\n%s", name, flag)
		}
		var v struct {
			Name, Version, Revision, Goversion string
			Modified                           bool
			Build                              []string
		}
		if err := json.Unmarshal([]byte(run(t, 10*time.Second, bin(name), "version", "-f", "json")), &v); err != nil ||
			v.Name != name || v.Version != wantVersion || v.Revision+map[bool]string{true: "-dirty"}[v.Modified] != rev ||
			v.Goversion != runtime.Version() || len(v.Build) == 0 {
			t.Errorf("%s version -f json: %+v %v", name, v, err)
		}
	}
	// rnbd_build_info, scraped from both daemons.
	dir := t.TempDir()
	srvMetrics, cltMetrics := fmt.Sprintf("127.0.0.1:%d", freePort(t)), fmt.Sprintf("127.0.0.1:%d", freePort(t))
	startServer(t, dir, freePort(t), "--metrics-listen", srvMetrics)
	startClient(t, dir, "--metrics-listen", cltMetrics)
	want := fmt.Sprintf(`rnbd_build_info{goversion=%q,revision=%q,version=%q}`, runtime.Version(), rev, wantVersion)
	for who, addr := range map[string]string{"rnbd-server": srvMetrics, "rnbd-client": cltMetrics} {
		s := fetchMetrics(t, addr)
		if v, ok := s.samples[want]; !ok || v != 1 {
			t.Errorf("%s: no %s 1 in\n%s", who, want, s.text)
		}
		if !strings.Contains(string(s.text), "# TYPE rnbd_build_info gauge") {
			t.Errorf("%s: rnbd_build_info is not a gauge", who)
		}
	}
}

// complete runs a binary's shell completion (what the completion
// scripts run) for args, the last being the word completed: the words
// offered and the directive line.
func complete(t *testing.T, name, socket string, args ...string) ([]string, string) {
	t.Helper()
	start := time.Now()
	stdout, stderr, code := runCode(t, 10*time.Second, bin(name), append([]string{"__complete", "--socket", socket}, args...)...)
	if code != 0 || strings.Contains(stderr, "rror") {
		t.Fatalf("%s __complete %v: exit %d\n%s%s", name, args, code, stdout, stderr)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("%s __complete %v took %v", name, args, d)
	}
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	return lines[:len(lines)-1], lines[len(lines)-1]
}

// TestCompletion: completion offers what the running daemons have —
// export, device, session and path names — asked over the control
// socket, and the words a setting or flag takes; with no daemon, or one
// that does not answer, it offers nothing within a second or so, and
// says nothing.
func TestCompletion(t *testing.T) {
	m := mapVol(t, 64<<20, "s-complete", nil, nil)
	srv, cl := m.srv.sock, m.cl.sock
	pathname := strings.TrimSpace(m.cl.ok("path", "list", "--fields", "pathname", "--format", "csv"))
	pathname = strings.TrimSpace(strings.TrimPrefix(pathname, "pathname"))
	srvPath := strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(m.srv.ok("path", "list", "--fields", "pathname", "--format", "csv")), "pathname"))
	for _, c := range []struct {
		bin, sock string
		args      []string
		want      []string
	}{
		{"rnbd-server", srv, []string{"unmap", ""}, []string{"vol"}},
		{"rnbd-server", srv, []string{"resize", "v"}, []string{"vol"}},
		{"rnbd-server", srv, []string{"device", "show", ""}, []string{"vol"}},
		{"rnbd-server", srv, []string{"session", "disconnect", ""}, []string{"s-complete"}},
		{"rnbd-server", srv, []string{"path", "show", ""}, []string{srvPath}},
		{"rnbd-server", srv, []string{"path", "show", "--session", "s-"}, []string{"s-complete"}},
		// A flag's value after an argument, as volume create NAME
		// --pool <TAB>: completed as the flag's, not as a second
		// argument (which is nothing).
		{"rnbd-server", srv, []string{"device", "close", "vol", "--session", ""}, []string{"s-complete"}},
		{"rnbd-client", cl, []string{"unmap", ""}, []string{"rnbd0"}},
		{"rnbd-client", cl, []string{"device", "show", "r"}, []string{"rnbd0"}},
		{"rnbd-client", cl, []string{"session", "set", ""}, []string{"s-complete"}},
		{"rnbd-client", cl, []string{"session", "set", "s-complete", "no_"}, []string{"no_path_timeout="}},
		{"rnbd-client", cl, []string{"session", "set", "s-complete", "mpath_policy=min"}, []string{"mpath_policy=min-inflight", "mpath_policy=min-latency"}},
		{"rnbd-client", cl, []string{"path", "reconnect", ""}, []string{pathname}},
		{"rnbd-client", cl, []string{"map", "--sessname", ""}, []string{"s-complete"}},
		{"rnbd-client", cl, []string{"map", "--as", ""}, []string{"nbd", "ublk", "socket:"}},
		{"rnbd-client", cl, []string{"device", "list", "--format", ""}, []string{"table", "json", "csv", "xml"}},
		{"rnbd-client", cl, []string{"device", "list", "--fields", "devname,si"}, []string{"devname,size"}},
	} {
		got, dir := complete(t, c.bin, c.sock, c.args...)
		if strings.Join(got, " ") != strings.Join(c.want, " ") || !strings.HasPrefix(dir, ":") {
			t.Errorf("%s %s: %q %s, want %q", c.bin, strings.Join(c.args, " "), got, dir, c.want)
		}
	}
	// No daemon; a daemon that accepts and never answers.
	dir := t.TempDir()
	mute, err := net.Listen("unix", filepath.Join(dir, "mute.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer mute.Close()
	go func() {
		for {
			c, err := mute.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	for _, sock := range []string{filepath.Join(dir, "none.sock"), filepath.Join(dir, "mute.sock")} {
		for _, args := range [][]string{{"unmap", ""}, {"session", "set", ""}, {"path", "show", ""}} {
			if got, d := complete(t, "rnbd-client", sock, args...); len(got) != 0 || d != ":4" {
				t.Errorf("rnbd-client %s with %s: %q %s, want nothing (:4)", strings.Join(args, " "), sock, got, d)
			}
		}
	}
}
