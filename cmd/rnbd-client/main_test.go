package main

import (
	"github.com/rnbd/rnbd/test/kit/cmdkit"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/clientd"
)

// TestDaemonFlagsDocumented: every flag of daemon but --config is in
// ConfigKeys (docs/client.md's table, rnbd-client.toml(5)), and every flag
// ConfigKeys names is one of daemon's.
func TestDaemonFlagsDocumented(t *testing.T) {
	cmdkit.DaemonFlagsDocumented(t, newRoot(), clientd.ConfigKeys)
}

// TestManPages: the pages are made (section 8 per command, the
// configuration's in section 5 with every key), and none says a default
// of this machine's: those that depend on the host say the rule.
func TestManPages(t *testing.T) {
	hostDefaults(t, cmdkit.ManPages(t, newRoot(), "rnbd-client", "/etc/rnbd/client.toml", clientd.ConfigKeys))
}

// hostDefaults: conns_per_path's default is this machine's CPUs: the
// page says so, not the number.
func hostDefaults(t *testing.T, page string) {
	t.Helper()
	if !strings.Contains(page, `\fB--conns-per-path\fP=the number of CPUs`) {
		t.Errorf("rnbd-client-daemon.8 does not say conns-per-path's default is the number of CPUs")
	}
}

// TestDaemonFlagsOverFile: the flags given are set over the
// configuration file; the others leave the file's values.
func TestDaemonFlagsOverFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "client.toml")
	if err := os.WriteFile(file, []byte("mpath_policy = \"min-latency\"\nnbd_buffers = 7\nhb_interval = \"2s\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	daemon, _, err := newRoot().Find([]string{"daemon"})
	if err != nil {
		t.Fatal(err)
	}
	if err := daemon.ParseFlags([]string{"--config", file, "--hb-interval", "3s", "--mpath-policy", "round-robin", "--tls-server-name", "srv"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := cli.DaemonConfig(daemon, clientd.LoadConfig, bindDaemonFlags)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.NBDBuffers != 7 || cfg.HBInterval.Duration != 3*time.Second || cfg.MPPolicy.Name() != "round-robin" || cfg.TLS.ServerName != "srv" {
		t.Errorf("nbd_buffers %d (the file's 7), hb_interval %v (the flag's 3s), mpath_policy %s (the flag's round-robin), tls server_name %q",
			cfg.NBDBuffers, cfg.HBInterval, cfg.MPPolicy.Name(), cfg.TLS.ServerName)
	}
	if d := clientd.DefaultConfig(); cfg.ConnsPerPath != d.ConnsPerPath {
		t.Errorf("conns_per_path %d, want the default %d", cfg.ConnsPerPath, d.ConnsPerPath)
	}
}

// TestUsageErrors: every group of the command tree refuses an unknown
// command, a near miss (suggesting the command meant) and no command at
// all, and every command a wrong number of arguments, each with exit 2
// (docs/control-api.md, "Errors").
func TestUsageErrors(t *testing.T) { cmdkit.UsageErrors(t, "rnbd-client", newRoot) }
