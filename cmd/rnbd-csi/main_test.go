package main

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/rnbd/rnbd/internal/csi"
	"github.com/rnbd/rnbd/test/kit/cmdkit"
)

// TestManPages: `rnbd-csi man DIR` makes the program's page (section 8:
// the daemon's exit status, files, signals, examples, the version) and
// the configuration's (section 5, every key of csi.ConfigKeys), and no
// other: the program has no subcommand a page would be for.
func TestManPages(t *testing.T) {
	dir := t.TempDir()
	root := newRoot()
	root.SetArgs([]string{"man", dir})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	if strings.Join(names, " ") != "rnbd-csi.8 rnbd-csi.toml.5" {
		t.Errorf("pages %v, want rnbd-csi.8 and rnbd-csi.toml.5", names)
	}
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	page := read("rnbd-csi.8")
	for _, s := range []string{".SH EXIT STATUS", "stopped by SIGTERM", ".SH FILES", ".SH SIGNALS", ".SH EXAMPLES",
		defaultConfig, "rnbd-csi.toml(5)", "rnbd devel", `\fB--node-id\fP`} {
		if !strings.Contains(page, s) {
			t.Errorf("rnbd-csi.8 lacks %q", s)
		}
	}
	if strings.Contains(page, "later") {
		t.Errorf("rnbd-csi.8 says a service comes later:\n%s", page)
	}
	cfg := read("rnbd-csi.toml.5")
	cmdkit.ConfigPageKeys(t, "rnbd-csi.toml.5", cfg, csi.ConfigKeys)
	for _, s := range []string{".SH EXAMPLES", defaultConfig, "[[storage_node]]"} {
		if !strings.Contains(cfg, s) {
			t.Errorf("rnbd-csi.toml.5 lacks %q", s)
		}
	}
}

// TestManConfigExampleLoads: the configuration page's example is a file
// the driver reads, fit for the controller and, given a node id, for the
// node plugin.
func TestManConfigExampleLoads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "csi.toml")
	if err := os.WriteFile(path, []byte(man.Config.Example), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := csi.LoadConfig(path)
	if err != nil {
		t.Fatalf("rnbd-csi.toml(5)'s example: %v", err)
	}
	if err := cfg.ValidateController(); err != nil {
		t.Errorf("rnbd-csi.toml(5)'s example, for the controller: %v", err)
	}
	cfg.Node.NodeID = "worker-1"
	if err := cfg.ValidateNode(); err != nil {
		t.Errorf("rnbd-csi.toml(5)'s example, for the node plugin: %v", err)
	}
}

// TestUsageErrors: every group of the command tree refuses an unknown
// command, a near miss (suggesting the command meant) and no command at
// all, and every command a wrong number of arguments, each with exit 2
// (docs/control-api.md, "Errors").
func TestUsageErrors(t *testing.T) { cmdkit.UsageErrors(t, "rnbd-csi", newRoot) }
