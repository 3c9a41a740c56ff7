// Package version says which build a binary is: the release, the commit
// and whether its tree had changes, the Go toolchain, and the build's
// flags. `rnbd-server version`, `--version`, the man pages and the
// rnbd_build_info metric all read it here.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// Stamped by the build with -ldflags "-X
// github.com/rnbd/rnbd/internal/version.Version=...": the Makefile and
// scripts/mkdeb.sh do, from git (scripts/version.sh; the package's
// version for the binaries of a .deb). Revision and Modified are Go's
// own VCS stamp where the build made one (vcs.revision, vcs.modified);
// the stamps stand in where it did not (-buildvcs=false, a build
// outside a checkout).
var (
	Version  string
	Revision string
	Modified string // "true" or "false"
)

// Info is a binary's build.
type Info struct {
	Version   string `json:"version"`   // "devel" where not stamped
	Revision  string `json:"revision"`  // the commit, "unknown" where not known
	Modified  bool   `json:"modified"`  // built from a tree with uncommitted changes
	GoVersion string `json:"goversion"` // runtime.Version()
	// Build is the build's settings as `go version -m` lists them
	// (-buildmode, -compiler, -ldflags, -tags, -trimpath, CGO_ENABLED,
	// GOARCH, GOOS, GOAMD64, ...), the VCS stamp left out.
	Build []string `json:"build"`
}

// Get is this binary's build.
func Get() Info {
	i := Info{Version: Version, Revision: Revision, Modified: Modified == "true", GoVersion: runtime.Version()}
	bi, ok := debug.ReadBuildInfo()
	if ok {
		if i.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			i.Version = bi.Main.Version // go install module@version
		}
		for _, s := range bi.Settings {
			switch {
			case s.Key == "vcs.revision":
				i.Revision = s.Value
			case s.Key == "vcs.modified":
				i.Modified = s.Value == "true"
			case strings.HasPrefix(s.Key, "vcs"), s.Value == "":
			case s.Key == "-ldflags":
				if v := unstamped(s.Value); v != "" {
					i.Build = append(i.Build, s.Key+"="+v)
				}
			default:
				i.Build = append(i.Build, s.Key+"="+s.Value)
			}
		}
	}
	if i.Version == "" {
		i.Version = "devel"
	}
	if i.Revision == "" {
		i.Revision = "unknown"
	}
	return i
}

// unstamped is an -ldflags value without this package's stamps, which
// Info shows as they are.
func unstamped(ldflags string) string {
	f := strings.Fields(ldflags)
	var out []string
	for i := 0; i < len(f); i++ {
		if f[i] == "-X" && i+1 < len(f) && strings.HasPrefix(f[i+1], pkgPath+".") {
			i++
			continue
		}
		out = append(out, f[i])
	}
	return strings.Join(out, " ")
}

const pkgPath = "github.com/rnbd/rnbd/internal/version"

// RevisionLabel is the revision with "-dirty" where the tree had
// changes, as git describe --dirty says it.
func (i Info) RevisionLabel() string {
	if i.Modified {
		return i.Revision + "-dirty"
	}
	return i.Revision
}

// String is `NAME --version`'s text, after the name.
func (i Info) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\nrevision: %s\ngo: %s\n", i.Version, i.RevisionLabel(), i.GoVersion)
	if len(i.Build) > 0 {
		fmt.Fprintf(&b, "build: %s\n", strings.Join(i.Build, " "))
	}
	return b.String()
}
