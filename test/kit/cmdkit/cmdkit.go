// Package cmdkit holds the checks the commands' tests share: their
// daemon flags against ConfigKeys, and their man pages. Apart from kit,
// which the libraries' tests import: this one imports internal/conf.
package cmdkit

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rnbd/rnbd/internal/conf"
)

// DaemonFlagsDocumented checks that every flag of root's daemon command
// but --config is in keys (the daemon's ConfigKeys: its docs table and
// its toml(5) page), and that every flag keys names is one of daemon's.
func DaemonFlagsDocumented(t *testing.T, root *cobra.Command, keys []conf.KeyDoc) {
	t.Helper()
	daemon, _, err := root.Find([]string{"daemon"})
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	flag := regexp.MustCompile("`--([a-z-]+)`")
	for _, k := range keys {
		for _, m := range flag.FindAllStringSubmatch(k.Flag, -1) {
			documented[m[1]] = true
			if daemon.Flags().Lookup(m[1]) == nil {
				t.Errorf("ConfigKeys names --%s, which daemon does not have", m[1])
			}
		}
	}
	daemon.NonInheritedFlags().VisitAll(func(f *pflag.Flag) {
		if f.Name != "help" && f.Name != "config" && !documented[f.Name] {
			t.Errorf("daemon --%s is not in ConfigKeys", f.Name)
		}
	})
}

// ManPages makes prog's man pages with root's man command and checks
// them: section 8 per command with EXIT STATUS and the version, FILES and
// SIGNALS on the program's and the daemon's, EXAMPLES, and the
// configuration's page in section 5 (configFile) describing every key.
// It returns the daemon's page, for the program's own checks.
func ManPages(t *testing.T, root *cobra.Command, prog, configFile string, keys []conf.KeyDoc) string {
	t.Helper()
	dir := t.TempDir()
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
	for _, p := range []string{prog + ".8", prog + "-daemon.8", prog + "-config-check.8", prog + "-version.8", prog + "-map.8"} {
		page := read(p)
		for _, s := range []string{".SH EXIT STATUS", "rnbd devel"} {
			if !strings.Contains(page, s) {
				t.Errorf("%s lacks %q", p, s)
			}
		}
	}
	for _, p := range []string{prog + ".8", prog + "-daemon.8"} {
		page := read(p)
		for _, s := range []string{".SH FILES", ".SH SIGNALS", "SIGTERM", configFile, prog + ".toml(5)"} {
			if !strings.Contains(page, s) {
				t.Errorf("%s lacks %q", p, s)
			}
		}
	}
	for _, p := range []string{prog + ".8", prog + "-daemon.8", prog + "-map.8"} {
		if !strings.Contains(read(p), ".SH EXAMPLES") {
			t.Errorf("%s has no EXAMPLES", p)
		}
	}
	ConfigPageKeys(t, prog+".toml.5", read(prog+".toml.5"), keys)
	return read(prog + "-daemon.8")
}

// ConfigPageKeys checks that the configuration's man page (name, its
// roff) describes every key of keys.
func ConfigPageKeys(t *testing.T, name, page string, keys []conf.KeyDoc) {
	t.Helper()
	for _, k := range keys {
		for _, key := range k.Keys {
			if !strings.Contains(page, "\\fB"+key+"\\fR") {
				t.Errorf("%s does not describe %s", name, key)
			}
		}
	}
}
