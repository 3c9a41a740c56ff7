package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/serverd"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// TestDaemonFlagsDocumented: every flag of daemon but --config is in
// ConfigKeys (docs/server.md's table, rnbd-server.toml(5)), and every flag
// ConfigKeys names is one of daemon's.
func TestDaemonFlagsDocumented(t *testing.T) {
	root := newRoot()
	daemon, _, err := root.Find([]string{"daemon"})
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	flag := regexp.MustCompile("`--([a-z-]+)`")
	for _, k := range serverd.ConfigKeys {
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
	for _, p := range []string{"rnbd-server.8", "rnbd-server-daemon.8", "rnbd-server-config-check.8", "rnbd-server-version.8", "rnbd-server-map.8"} {
		page := read(p)
		for _, s := range []string{".SH EXIT STATUS", "rnbd devel"} {
			if !strings.Contains(page, s) {
				t.Errorf("%s lacks %q", p, s)
			}
		}
	}
	for _, p := range []string{"rnbd-server.8", "rnbd-server-daemon.8"} {
		page := read(p)
		for _, s := range []string{".SH FILES", ".SH SIGNALS", "SIGTERM", "/etc/rnbd/server.toml", "rnbd-server.toml(5)"} {
			if !strings.Contains(page, s) {
				t.Errorf("%s lacks %q", p, s)
			}
		}
	}
	for _, p := range []string{"rnbd-server.8", "rnbd-server-daemon.8", "rnbd-server-map.8"} {
		if !strings.Contains(read(p), ".SH EXAMPLES") {
			t.Errorf("%s has no EXAMPLES", p)
		}
	}
	cfg := read("rnbd-server.toml.5")
	for _, k := range serverd.ConfigKeys {
		for _, name := range k.Keys {
			if !strings.Contains(cfg, "\\fB"+name+"\\fR") {
				t.Errorf("rnbd-server.toml.5 does not describe %s", name)
			}
		}
	}
	hostDefaults(t, read("rnbd-server-daemon.8"))
}

// hostDefaults: max_chunk_memory's default is a quarter of this
// machine's memory: the page says so, not the number.
func hostDefaults(t *testing.T, page string) {
	t.Helper()
	n := rtrs.DefaultMaxChunkMemory()
	for _, s := range []string{func() string { s := units.Size(n); return s.String() }(), strconv.FormatInt(n, 10), strconv.FormatInt(n>>10, 10) + "KiB"} {
		if strings.Contains(page, s) {
			t.Errorf("rnbd-server-daemon.8 has this machine's max_chunk_memory, %s", s)
		}
	}
	for _, s := range []string{`\fB--max-chunk-memory\fP=a quarter of RAM, at most 8GiB`, `\fB--max-chunk-memory-per-client\fP=a quarter of max-chunk-memory`} {
		if !strings.Contains(page, s) {
			t.Errorf("rnbd-server-daemon.8 lacks %q", s)
		}
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
	file := filepath.Join(t.TempDir(), "server.toml")
	if err := os.WriteFile(file, []byte("listen = [\"tcp://127.0.0.1:7\"]\nmax_chunk_memory = \"1GiB\"\nhb_interval = \"2s\"\nnew_path_rate = 5.5\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	daemon, _, err := newRoot().Find([]string{"daemon"})
	if err != nil {
		t.Fatal(err)
	}
	if err := daemon.ParseFlags([]string{"--config", file, "--hb-interval", "3s", "--max-chunk-memory-per-client", "1MiB",
		"--dev-search-path-allow-from", "10.0.0.0/8", "--dev-search-path-allow-from", "10.1.0.0/16", "--tls-allow-anonymous-clients"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := cli.DaemonConfig(daemon, serverd.LoadConfig, bindDaemonFlags)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(cfg.Listen, ",") != "tcp://127.0.0.1:7" || cfg.MaxChunkMemory != 1<<30 || cfg.NewPathRate != 5.5 {
		t.Errorf("the file's values: listen %v, max_chunk_memory %d, new_path_rate %g", cfg.Listen, cfg.MaxChunkMemory, cfg.NewPathRate)
	}
	if cfg.HBInterval.Duration != 3*time.Second || cfg.MaxChunkMemoryPerClient == nil || *cfg.MaxChunkMemoryPerClient != 1<<20 ||
		strings.Join(cfg.SearchAllowFrom, ",") != "10.0.0.0/8,10.1.0.0/16" || !cfg.TLS.AllowAnonymousClients {
		t.Errorf("the flags' values: hb_interval %v, max_chunk_memory_per_client %v, dev_search_path_allow_from %v, allow_anonymous_clients %v",
			cfg.HBInterval, cfg.MaxChunkMemoryPerClient, cfg.SearchAllowFrom, cfg.TLS.AllowAnonymousClients)
	}
	if d := serverd.DefaultConfig(); cfg.QueueDepth != d.QueueDepth {
		t.Errorf("queue_depth %d, want the default %d", cfg.QueueDepth, d.QueueDepth)
	}
}
