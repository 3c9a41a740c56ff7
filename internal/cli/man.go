package cli

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/cpuguy83/go-md2man/v2/md2man"
	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/version"
)

// Man is what the man pages say beyond the commands' own help (their
// Short, Long, flags and Example, which cobra/doc makes the page of).
type Man struct {
	// Files is FILES, Markdown: on the pages of the root, the daemon
	// and config commands.
	Files string
	// Signals is SIGNALS, Markdown: on the root's and the daemon's.
	Signals string
	// DaemonExit is the daemon command's EXIT STATUS, Markdown; every
	// other page has the control commands' exit codes (ctl).
	DaemonExit string
	// RootIsDaemon: the program itself is the daemon (rnbd-csi, which
	// has no daemon command): its page is the daemon's.
	RootIsDaemon bool
	// Config is the configuration file's page, section 5.
	Config ConfigPage
}

// ConfigPage is a configuration file's man page (section 5): its keys
// are ConfigKeys, the same rows as the table in docs/.
type ConfigPage struct {
	Name        string // "rnbd-server.toml"
	Short       string // the NAME line's description
	Path        string // "/etc/rnbd/server.toml"
	Description string // Markdown
	Keys        []conf.KeyDoc
	Example     string // a file
	SeeAlso     []string
}

// ManCmd is a hidden command that writes root's man pages into a
// directory: one per command in section 8 (NAME.8, NAME-SUBCOMMAND.8,
// ...) and the configuration file's in section 5 (NAME.toml.5), each
// with the version in its footer. The packages and `make man` install
// them.
func ManCmd(root *cobra.Command, m Man) *cobra.Command {
	return &cobra.Command{
		Use:    "man DIR",
		Short:  "Write the man pages into DIR",
		Hidden: true,
		Args:   cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := os.MkdirAll(args[0], 0o755); err != nil {
				return err
			}
			root.DisableAutoGenTag = true
			date := time.Now()
			// Reproducible pages: dated SOURCE_DATE_EPOCH (the
			// packages set the commit's date), not when they were made.
			if v := os.Getenv("SOURCE_DATE_EPOCH"); v != "" {
				sec, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", v, err)
				}
				date = time.Unix(sec, 0).UTC()
			}
			source := "rnbd " + version.Get().Version
			if err := m.tree(root, args[0], date, source); err != nil {
				return fmt.Errorf("man pages: %w", err)
			}
			if m.Config.Name != "" {
				b := m.Config.render(date, source)
				if err := os.WriteFile(filepath.Join(args[0], m.Config.Name+".5"), b, 0o644); err != nil {
					return fmt.Errorf("man pages: %w", err)
				}
			}
			return nil
		},
	}
}

// tree writes the page of c and of each command under it.
func (m Man) tree(c *cobra.Command, dir string, date time.Time, source string) error {
	for _, sub := range c.Commands() {
		if !sub.IsAvailableCommand() || sub.IsAdditionalHelpTopicCommand() {
			continue
		}
		if err := m.tree(sub, dir, date, source); err != nil {
			return err
		}
	}
	hdr := &doc.GenManHeader{Section: "8", Source: source, Manual: "System Administration", Date: &date}
	var b bytes.Buffer
	if err := doc.GenMan(c, hdr, &b); err != nil {
		return err
	}
	page := m.extend(c, b.String())
	return os.WriteFile(filepath.Join(dir, strings.ReplaceAll(c.CommandPath(), " ", "-")+".8"), []byte(page), 0o644)
}

// extend adds EXIT STATUS, FILES and SIGNALS to a command's page
// before its EXAMPLES (cobra's EXAMPLE, renamed as man-pages(7) has it)
// and SEE ALSO, and the configuration file's page to SEE ALSO.
func (m Man) extend(c *cobra.Command, page string) string {
	isRoot, isDaemon := !c.HasParent(), c.Name() == "daemon" && c.Parent() != nil && !c.Parent().HasParent()
	isDaemon = isDaemon || isRoot && m.RootIsDaemon
	isConfig := strings.HasPrefix(c.CommandPath(), c.Root().Name()+" config")
	var md strings.Builder
	md.WriteString("# EXIT STATUS\n")
	if isDaemon && m.DaemonExit != "" {
		md.WriteString(m.DaemonExit + "\n\n")
	} else {
		md.WriteString("One line on standard error says what failed; the exit code says its class, as the control API's (docs/control-api.md):\n\n**0**\n: success\n\n")
		for _, s := range ctl.ExitStatuses() {
			fmt.Fprintf(&md, "**%d**\n: `%s`: %s\n\n", s.Exit, s.Class, s.Meaning)
		}
	}
	if (isRoot || isDaemon || isConfig) && m.Files != "" {
		md.WriteString("# FILES\n" + m.Files + "\n\n")
	}
	if (isRoot || isDaemon) && m.Signals != "" {
		md.WriteString("# SIGNALS\n" + m.Signals + "\n\n")
	}
	extra := roff(md.String())
	page = strings.Replace(page, ".SH EXAMPLE\n", ".SH EXAMPLES\n", 1)
	at := len(page)
	for _, s := range []string{".SH EXAMPLES\n", ".SH SEE ALSO\n"} {
		if i := strings.Index(page, s); i >= 0 && i < at {
			at = i
		}
	}
	page = page[:at] + extra + page[at:]
	if (isRoot || isDaemon || isConfig) && m.Config.Name != "" {
		see := `\fB` + m.Config.Name + `(5)\fR`
		if i := strings.Index(page, ".SH SEE ALSO\n"); i >= 0 {
			j := i + len(".SH SEE ALSO\n")
			end := strings.Index(page[j:], "\n.")
			if end < 0 {
				end = len(page) - j
			}
			line := strings.TrimRight(page[j:j+end], "\n")
			page = page[:j] + line + ", " + see + "\n" + page[j+len(line):]
		} else {
			page += ".SH SEE ALSO\n" + see + "\n"
		}
	}
	return page
}

// link is a Markdown link: a man page says its text.
var link = regexp.MustCompile(`\[([^\]]+)\]\([^)]*\)`)

// roff renders Markdown sections (from "# SECTION") as roff, without
// md2man's preamble.
func roff(md string) string {
	// A title block first: md2man makes the first heading of a
	// document without one its title.
	out := string(md2man.Render([]byte("% X\n" + link.ReplaceAllString(md, "$1"))))
	if i := strings.Index(out, ".SH "); i >= 0 {
		out = out[i:]
	}
	return out
}

// render is the configuration file's page.
func (p ConfigPage) render(date time.Time, source string) []byte {
	var md strings.Builder
	fmt.Fprintf(&md, "%% %q %q %q %q %q\n", strings.ToUpper(p.Name), "5", date.Format("Jan 2006"), source, "File Formats")
	fmt.Fprintf(&md, "# NAME\n%s \\- %s\n\n# SYNOPSIS\n**%s**\n\n# DESCRIPTION\n%s\n\n# KEYS\n", p.Name, p.Short, p.Path, p.Description)
	for _, k := range p.Keys {
		def := k.Doc
		if k.Default != "" {
			def += ". Default: " + k.Default
		}
		if k.Flag != "" {
			def += ". Command line: " + k.Flag
		}
		fmt.Fprintf(&md, "%s\n: %s.\n\n", k.Name(), def)
	}
	if p.Example != "" {
		fmt.Fprintf(&md, "# EXAMPLES\n```\n%s\n```\n\n", strings.TrimRight(p.Example, "\n"))
	}
	if len(p.SeeAlso) > 0 {
		var see []string
		for _, s := range p.SeeAlso {
			see = append(see, "**"+s+"**")
		}
		fmt.Fprintf(&md, "# SEE ALSO\n%s\n", strings.Join(see, ", "))
	}
	return md2man.Render([]byte(link.ReplaceAllString(md.String(), "$1")))
}
