package lint

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestUnits: the systemd units in deploy/ pass systemd-analyze verify
// (with their ExecStart pointing at stand-in binaries: the real ones are
// installed by the packages) and their sandbox keeps systemd-analyze
// security's exposure at or below what docs/operations.md states.
func TestUnits(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("no systemd-analyze (Debian's systemd package)")
	}
	dir := t.TempDir()
	stub := filepath.Join(dir, "stub")
	if err := os.WriteFile(stub, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	exposure := regexp.MustCompile(`Overall exposure level for \S+: ([0-9.]+)`)
	units := map[string]float64{"rnbd-server.service": 2.6, "rnbd-client.service": 3.0, "rnbd-client-wait.service": 3.0}
	// All in place before any is verified: the wait unit requires the
	// client's, which verify looks for beside it.
	for unit := range units {
		b, err := os.ReadFile(filepath.Join("../../deploy", unit))
		if err != nil {
			t.Fatal(err)
		}
		text := strings.NewReplacer("/usr/sbin/rnbd-server", stub, "/usr/sbin/rnbd-client", stub).Replace(string(b))
		if err := os.WriteFile(filepath.Join(dir, unit), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for unit, max := range units {
		path := filepath.Join(dir, unit)
		if out, err := exec.Command(sa, "verify", "--man=no", path).CombinedOutput(); err != nil || len(out) > 0 {
			t.Errorf("systemd-analyze verify %s: %v\n%s", unit, err, out)
		}
		out, _ := exec.Command(sa, "security", "--offline=yes", path).CombinedOutput()
		m := exposure.FindSubmatch(out)
		if m == nil {
			t.Errorf("systemd-analyze security %s:\n%s", unit, out)
			continue
		}
		if v, _ := strconv.ParseFloat(string(m[1]), 64); v > max {
			t.Errorf("%s: exposure %v, more than the %v docs/operations.md states", unit, v, max)
		}
	}
}

// TestUnitsCheckConfig: each daemon's unit checks the configuration
// file its daemon reads before starting it (rnbd-server config check).
func TestUnitsCheckConfig(t *testing.T) {
	for _, d := range []string{"server", "client"} {
		b, err := os.ReadFile("../../deploy/rnbd-" + d + ".service")
		if err != nil {
			t.Fatal(err)
		}
		conf := "/etc/rnbd/" + d + ".toml"
		pre := "\nExecStartPre=/usr/sbin/rnbd-" + d + " config check " + conf + "\n"
		start := "\nExecStart=/usr/sbin/rnbd-" + d + " daemon --config " + conf + "\n"
		if i, j := strings.Index(string(b), pre), strings.Index(string(b), start); i < 0 || j < 0 {
			t.Errorf("rnbd-%s.service: want %q and %q", d, strings.TrimSpace(pre), strings.TrimSpace(start))
		}
	}
}
