package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/clientd"
)

// TestDaemonFlagsDocumented: every flag of daemon but --config is in
// ConfigKeys (docs/client.md's table, rnbd-client.toml(5)), and every flag
// ConfigKeys names is one of daemon's.
func TestDaemonFlagsDocumented(t *testing.T) {
	root := newRoot()
	daemon, _, err := root.Find([]string{"daemon"})
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	flag := regexp.MustCompile("`--([a-z-]+)`")
	for _, k := range clientd.ConfigKeys {
		for _, m := range flag.FindAllStringSubmatch(k.Flag, -1) {
			documented[m[1]] = true
			if daemon.Flags().Lookup(m[1]) == nil {
				t.Errorf("ConfigKeys names --%s, which daemon does not have", m[1])
			}
		}
	}
	for _, name := range daemonFlags(daemon) {
		if name != "config" && !documented[name] {
			t.Errorf("daemon --%s is not in ConfigKeys", name)
		}
	}
}

// TestManPages: the pages are made (section 8 per command, the
// configuration's in section 5 with every key), and none says a default
// of this machine's: those that depend on the host say the rule.
func TestManPages(t *testing.T) {
	dir := t.TempDir()
	root := newRoot()
	root.SetArgs([]string{"man", dir})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	for _, p := range []string{"rnbd-client.8", "rnbd-client-daemon.8", "rnbd-client-config-check.8", "rnbd-client-version.8", "rnbd-client-map.8"} {
		page := read(p)
		for _, s := range []string{".SH EXIT STATUS", "rnbd devel"} {
			if !strings.Contains(page, s) {
				t.Errorf("%s lacks %q", p, s)
			}
		}
	}
	for _, p := range []string{"rnbd-client.8", "rnbd-client-daemon.8"} {
		page := read(p)
		for _, s := range []string{".SH FILES", ".SH SIGNALS", "SIGTERM", "/etc/rnbd/client.toml", "rnbd-client.toml(5)"} {
			if !strings.Contains(page, s) {
				t.Errorf("%s lacks %q", p, s)
			}
		}
	}
	for _, p := range []string{"rnbd-client.8", "rnbd-client-daemon.8", "rnbd-client-map.8"} {
		if !strings.Contains(read(p), ".SH EXAMPLES") {
			t.Errorf("%s has no EXAMPLES", p)
		}
	}
	cfg := read("rnbd-client.toml.5")
	for _, k := range clientd.ConfigKeys {
		for _, name := range k.Keys {
			if !strings.Contains(cfg, "\\fB"+name+"\\fR") {
				t.Errorf("rnbd-client.toml.5 does not describe %s", name)
			}
		}
	}
	hostDefaults(t, read("rnbd-client-daemon.8"))
}

// hostDefaults: conns_per_path's default is this machine's CPUs: the
// page says so, not the number.
func hostDefaults(t *testing.T, page string) {
	t.Helper()
	if !strings.Contains(page, `\fB--conns-per-path\fP=the number of CPUs`) {
		t.Errorf("rnbd-client-daemon.8 does not say conns-per-path's default is the number of CPUs")
	}
}

// daemonFlags are the daemon command's own flags but --help.
func daemonFlags(c *cobra.Command) []string {
	var out []string
	c.NonInheritedFlags().VisitAll(func(f *pflag.Flag) {
		if f.Name != "help" {
			out = append(out, f.Name)
		}
	})
	return out
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
