package main

import (
	"github.com/rnbd/rnbd/test/kit/cmdkit"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/cli"
	"github.com/rnbd/rnbd/internal/serverd"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// TestDaemonFlagsDocumented: every flag of daemon but --config is in
// ConfigKeys (docs/server.md's table, rnbd-server.toml(5)), and every flag
// ConfigKeys names is one of daemon's.
func TestDaemonFlagsDocumented(t *testing.T) {
	cmdkit.DaemonFlagsDocumented(t, newRoot(), serverd.ConfigKeys)
}

// TestManPages: the pages are made (section 8 per command, the
// configuration's in section 5 with every key), and none says a default
// of this machine's: those that depend on the host say the rule.
func TestManPages(t *testing.T) {
	hostDefaults(t, cmdkit.ManPages(t, newRoot(), "rnbd-server", "/etc/rnbd/server.toml", serverd.ConfigKeys))
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

// TestUsageErrors: every group of the command tree refuses an unknown
// command, a near miss (suggesting the command meant) and no command at
// all, and every command a wrong number of arguments, each with exit 2
// (docs/control-api.md, "Errors").
func TestUsageErrors(t *testing.T) { cmdkit.UsageErrors(t, "rnbd-server", newRoot) }
