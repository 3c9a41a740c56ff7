package version

import (
	"runtime"
	"strings"
	"testing"
)

// TestGet: without stamps a test binary is "devel" of an unknown
// revision, built by this Go; the stamps win, and -ldflags shows the
// build's own flags without them.
func TestGet(t *testing.T) {
	i := Get()
	if i.Version != "devel" || i.Revision != "unknown" || i.GoVersion != runtime.Version() {
		t.Fatalf("unstamped: %+v", i)
	}
	Version, Revision, Modified = "1.2+git20261127.abcdef0", "abcdef0123", "true"
	defer func() { Version, Revision, Modified = "", "", "" }()
	i = Get()
	if i.Version != "1.2+git20261127.abcdef0" || i.RevisionLabel() != "abcdef0123-dirty" {
		t.Fatalf("stamped: %+v", i)
	}
	if !strings.HasPrefix(i.String(), "1.2+git20261127.abcdef0\nrevision: abcdef0123-dirty\ngo: "+runtime.Version()+"\n") {
		t.Fatalf("String:\n%s", i)
	}
	if got := unstamped("-s -w -X " + pkgPath + ".Version=1 -X other.V=2 -X " + pkgPath + ".Revision=abc"); got != "-s -w -X other.V=2" {
		t.Fatalf("unstamped: %q", got)
	}
}
