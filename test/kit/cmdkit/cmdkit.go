// Package cmdkit holds the checks the commands' tests share: their
// daemon flags against ConfigKeys, and their man pages. Apart from kit,
// which the libraries' tests import: this one imports internal/conf.
package cmdkit

import (
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rnbd/rnbd/internal/cli"
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
	var stderr strings.Builder
	if code := cli.Run(prog, root, []string{"man", dir}, io.Discard, &stderr); code != 0 {
		t.Fatalf("%s man: exit %d: %s", prog, code, stderr.String())
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

// UsageErrors walks the whole command tree of the program newRoot makes
// and runs it (cli.Run, as main does) with what is wrong for each
// command, expecting a usage error (exit 2) and nothing done: every
// group given a word that is none of its commands, a near miss of one
// (which must be suggested) and no command at all; every command given
// one argument fewer than its use line asks for and one more than it
// allows. The tree is cobra's, so a new command is covered without a
// line here; its use line must say its arguments (NAME, [FILE],
// KEY=VALUE...), as the help and the man page show them.
func UsageErrors(t *testing.T, prog string, newRoot func() *cobra.Command) {
	t.Helper()
	// Were a command to run after all, it finds no daemon.
	t.Setenv("RNBD_SERVER", "")
	var sock []string
	if newRoot().PersistentFlags().Lookup("socket") != nil {
		sock = []string{"--socket", filepath.Join(t.TempDir(), "none.sock")}
	}
	run := func(args ...string) (int, string) {
		root := newRoot()
		var out, errb strings.Builder
		code := cli.Run(prog, root, append(args, sock...), &out, &errb)
		return code, errb.String()
	}
	root := newRoot()
	cli.Strict(root)
	var walk func(c *cobra.Command, path []string)
	n := 0
	walk = func(c *cobra.Command, path []string) {
		if c.Name() == cobra.ShellCompRequestCmd || c.Name() == cobra.ShellCompNoDescRequestCmd {
			return
		}
		n++
		where := strings.Join(append([]string{prog}, path...), " ")
		expect := func(what string, want string, args ...string) {
			t.Helper()
			code, stderr := run(append(append([]string{}, path...), args...)...)
			if code != 2 || !strings.Contains(stderr, want) {
				t.Errorf("%s %s (%s): exit %d, stderr %q; want exit 2 saying %q", where, strings.Join(args, " "), what, code, stderr, want)
			}
		}
		if c.HasSubCommands() {
			expect("an unknown command", `unknown command "frob"`, "frob")
			for _, sub := range c.Commands() {
				if sub.IsAvailableCommand() && len(sub.Name()) > 3 {
					near := sub.Name()[:len(sub.Name())-1] + "x"
					expect("a near miss", `did you mean `, near)
					break
				}
			}
			if !c.Runnable() {
				t.Errorf("%s: a group that does nothing when run (cli.Strict not applied)", where)
			}
		}
		if c.Annotations[cli.GroupAnnotation] != "" {
			expect("no command", "needs a command")
		} else {
			if c.Args == nil {
				t.Errorf("%s: no Args: it takes any number of arguments", where)
			} else {
				min, max := useArgs(c.Use)
				if min > 0 {
					expect("too few arguments", "", words(min-1)...)
				}
				if max >= 0 {
					expect("too many arguments", "", words(max+1)...)
				}
			}
		}
		for _, sub := range c.Commands() {
			walk(sub, append(append([]string{}, path...), sub.Name()))
		}
	}
	walk(root, nil)
	t.Logf("%s: %d commands walked", prog, n)
}

// words are n arguments.
func words(n int) []string {
	var out []string
	for i := range n {
		out = append(out, "arg"+strconv.Itoa(i+1))
	}
	return out
}

// useArgs are the fewest and the most arguments (-1: no bound) a
// command's use line shows: NAME is one, [NAME] or a bracketed group
// that is not only flags is an optional one, NAME... one or more;
// --flag VALUE is no argument.
func useArgs(use string) (min, max int) {
	fields := strings.Fields(use)
	if len(fields) == 0 {
		return 0, 0
	}
	rest := strings.Join(fields[1:], " ")
	var toks []string
	for rest != "" {
		rest = strings.TrimLeft(rest, " ")
		if strings.HasPrefix(rest, "[") {
			depth, i := 0, 0
			for ; i < len(rest); i++ {
				if rest[i] == '[' {
					depth++
				} else if rest[i] == ']' {
					if depth--; depth == 0 {
						break
					}
				}
			}
			toks = append(toks, rest[:min2(i+1, len(rest))])
			rest = rest[min2(i+1, len(rest)):]
			continue
		}
		w, after, _ := strings.Cut(rest, " ")
		toks = append(toks, w)
		rest = after
	}
	for i := 0; i < len(toks); i++ {
		tok := toks[i]
		switch {
		case strings.HasPrefix(tok, "["):
			inner := strings.TrimSpace(strings.Trim(tok, "[]"))
			if strings.HasPrefix(inner, "-") && !strings.Contains(inner, `"`) {
				continue // optional flags
			}
			if max >= 0 {
				max++
			}
			if strings.HasSuffix(tok, "...") {
				max = -1
			}
		case strings.HasPrefix(tok, "-"):
			// A flag, and its value if one follows.
			if i+1 < len(toks) && !strings.HasPrefix(toks[i+1], "-") && !strings.HasPrefix(toks[i+1], "[") {
				i++
			}
		default:
			min++
			if max >= 0 {
				max++
			}
			if strings.HasSuffix(tok, "...") {
				max = -1
			}
		}
	}
	return min, max
}

func min2(a, b int) int {
	if a < b {
		return a
	}
	return b
}
