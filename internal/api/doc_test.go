package api

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// docRow is a route row of a table of docs/control-api.md: | `METHOD
// /v1/path[?query]` | ...
var docRow = regexp.MustCompile("^\\| `([A-Z]+) (/v1/[^`\\[]*)(?:\\[[^`]*\\])?` \\|([^|]*)\\|")

// docRoutes are the routes of the table under heading, with the second
// column of each (the right, in the server's table); a path written
// a\|b\|c is three routes.
func docRoutes(t *testing.T, heading string) map[string]string {
	b, err := os.ReadFile("../../docs/control-api.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, heading)
	if i < 0 {
		t.Fatalf("docs/control-api.md has no %q", heading)
	}
	s = s[i+len(heading):]
	if j := strings.Index(s, "\n## "); j >= 0 {
		s = s[:j]
	}
	out := map[string]string{}
	for _, l := range strings.Split(s, "\n") {
		m := docRow.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		path := m[2]
		k := strings.LastIndexByte(path, '/')
		for _, last := range strings.Split(path[k+1:], `\|`) {
			out[m[1]+" "+path[:k+1]+last] = strings.TrimSpace(m[3])
		}
	}
	return out
}

// TestDocRights: docs/control-api.md's rnbd-server table has every route
// of the route table, none else, each with the right the table gives
// it; its rnbd-client table every route of the client's.
func TestDocRights(t *testing.T) {
	doc := docRoutes(t, "## rnbd-server (`/v1`)")
	for _, r := range ServerRoutes {
		right, ok := doc[r.Pattern()]
		switch {
		case !ok:
			t.Errorf("docs: the rnbd-server table has no row for %s", r.Pattern())
		case right != string(r.Right):
			t.Errorf("docs: %s needs %q, the route table says %s", r.Pattern(), right, r.Right)
		}
		delete(doc, r.Pattern())
	}
	for p := range doc {
		t.Errorf("docs: the rnbd-server table has %s, which is no route", p)
	}
	doc = docRoutes(t, "## rnbd-client (`/v1`)")
	var want []string
	for _, r := range ClientRoutes {
		want = append(want, r.Pattern())
	}
	var got []string
	for p := range doc {
		got = append(got, p)
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("docs: the rnbd-client table has %q, the route table %q", got, want)
	}
}
