package cli

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/conf"
)

// TestManCmd writes a page per command in section 8 and the
// configuration file's in section 5, each with the version in its
// footer: every page has EXIT STATUS (the daemon's its own), the root's
// and the daemon's FILES and SIGNALS, a command's examples are
// EXAMPLES, and the configuration's page has every key of its rows.
func TestManCmd(t *testing.T) {
	root := &cobra.Command{Use: "tool", Short: "A tool"}
	sub := &cobra.Command{Use: "sub", Short: "Does a thing", Run: func(*cobra.Command, []string) {},
		Example: "  tool sub --depth 2"}
	sub.Flags().Int("depth", 4, "how deep")
	daemon := &cobra.Command{Use: "daemon", Short: "Serves", Run: func(*cobra.Command, []string) {}}
	m := Man{
		Files:      "*/etc/tool.toml*\n: the configuration",
		Signals:    "**SIGTERM**\n: stop",
		DaemonExit: "**0**\n: stopped by a signal",
		Config: ConfigPage{Name: "tool.toml", Short: "the configuration of tool", Path: "/etc/tool.toml",
			Description: "Keys, see [the docs](docs/x.md#y).",
			Keys: []conf.KeyDoc{{Keys: []string{"listen"}, Flag: "`--listen`", Default: "`tcp://0.0.0.0:1`", Doc: "where"},
				{Table: "[tls]", Keys: []string{"cert", "key"}, Default: "unset", Doc: "the files"}},
			Example: "listen = [\"tcp://10.0.0.1\"]", SeeAlso: []string{"tool(8)"}},
	}
	root.AddCommand(sub, daemon, ManCmd(root, m))
	dir := t.TempDir()
	t.Setenv("SOURCE_DATE_EPOCH", "1795737600") // 2026-11-27
	root.SetArgs([]string{"man", dir})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	read := func(name string) string {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	has := func(name, page string, want ...string) {
		t.Helper()
		for _, w := range want {
			if !strings.Contains(page, w) {
				t.Errorf("%s lacks %q:\n%s", name, w, page)
			}
		}
	}
	hasNot := func(name, page string, not ...string) {
		t.Helper()
		for _, w := range not {
			if strings.Contains(page, w) {
				t.Errorf("%s has %q:\n%s", name, w, page)
			}
		}
	}
	subPage := read("tool-sub.8")
	has("tool-sub.8", subPage, `.TH "TOOL-SUB" "8" "Nov 2026" "rnbd devel" "System Administration"`, "Does a thing", "depth",
		".SH EXIT STATUS", `\fB2\fP`, "invalid_argument", `\fB8\fP`, "not_supported", ".SH EXAMPLES\n", "tool sub --depth 2")
	hasNot("tool-sub.8", subPage, ".SH FILES", ".SH SIGNALS", "tool.toml(5)")
	if i, j := strings.Index(subPage, ".SH EXIT STATUS"), strings.Index(subPage, ".SH EXAMPLES"); i < 0 || j < i {
		t.Errorf("EXIT STATUS is not before EXAMPLES")
	}
	for _, name := range []string{"tool.8", "tool-daemon.8"} {
		p := read(name)
		has(name, p, ".SH FILES", "/etc/tool.toml", ".SH SIGNALS", "SIGTERM", `\fBtool.toml(5)\fR`, ".SH EXIT STATUS")
	}
	has("tool-daemon.8", read("tool-daemon.8"), "stopped by a signal")
	hasNot("tool-daemon.8", read("tool-daemon.8"), "invalid_argument")
	cfg := read("tool.toml.5")
	has("tool.toml.5", cfg, `.TH "TOOL.TOML" "5" "Nov 2026" "rnbd devel" "File Formats"`, ".SH KEYS", `\fBlisten\fR`,
		`\fB[tls]\fR \fBcert\fR, \fBkey\fR`, "the files", "tcp://0.0.0.0:1", ".SH EXAMPLES", `listen = [`, "Keys, see the docs.")
	hasNot("tool.toml.5", cfg, "](", "docs/x.md")
	if _, err := os.Stat(filepath.Join(dir, "tool-man.8")); err == nil {
		t.Error("the hidden man command has a page")
	}
	// Every page renders: no Markdown left.
	pages, _ := filepath.Glob(filepath.Join(dir, "*"))
	for _, p := range pages {
		b, _ := os.ReadFile(p)
		if regexp.MustCompile("(?m)^#|\\*\\*|`").Match(b) {
			t.Errorf("%s has Markdown left:\n%s", p, b)
		}
	}
}
