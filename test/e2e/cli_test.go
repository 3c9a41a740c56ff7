package e2e

import (
	"encoding/json"
	"fmt"
	"os/exec"
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
