// Tests of what the package checks before a pool is touched: names.
package pool

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"syscall"
	"testing"
)

// nameClasses are names of each class CheckName tells apart, and whether
// it takes them.
var nameClasses = []struct {
	class string
	ok    bool
	names []string
}{
	{"plain", true, []string{"a", "v1", "pvc-0a1b", "A_Z", "0", strings.Repeat("x", 128)}},
	{"with dots, not only dots", true, []string{"a.b", ".a", "a.", "..a", "a..", "a...b", ".rnbd-tmp", "_.", "._"}},
	{"with - or _ after the first", true, []string{"a-", "a-b", "_", "_-", "a--b", "0-"}},
	{"empty", false, []string{""}},
	{"too long", false, []string{strings.Repeat("x", 129)}},
	{"dots only", false, []string{".", "..", "...", "....", strings.Repeat(".", 128)}},
	{"beginning with -", false, []string{"-", "-a", "--force", "-h", "-.", "-0"}},
	{"a URL path's own", false, []string{"/", "a/b", "../x", "%", "a%2Fb", "%2e%2e", "a?b", "a#b", "a;b", "a&b", "a=b"}},
	{"blanks and controls", false, []string{" ", "a b", "a\tb", "a\nb", "\x00", "a\x00", "\x7f", "a\rb"}},
	{"outside the alphabet", false, []string{"é", "a+b", "a:b", "a\\b", "a,b", "a@b", "a~b", "a*b", "'a'", `"a"`}},
}

// CheckName takes exactly its classes of names, and refuses the rest
// with EINVAL saying the rule.
func TestCheckName(t *testing.T) {
	for _, c := range nameClasses {
		for _, n := range c.names {
			err := CheckName(n)
			switch {
			case c.ok && err != nil:
				t.Errorf("%s %q: %v", c.class, n, err)
			case !c.ok && !errors.Is(err, syscall.EINVAL):
				t.Errorf("%s %q: %v, want EINVAL", c.class, n, err)
			case !c.ok && !strings.Contains(err.Error(), nameRule):
				t.Errorf("%s %q: %v does not say the rule", c.class, n, err)
			}
		}
	}
}

// Every name CheckName takes, of the classes and of all the names of one
// and two characters of its alphabet and of what a URL or a command line
// makes much of, reaches a handler of /v1/volumes/{name} unchanged when
// the path is made as the clients make it (url.PathEscape), and is no
// option; each one the alphabet takes and CheckName does not is one of
// dots only (which the router rewrites) or beginning with '-'.
func TestCheckNameAddressable(t *testing.T) {
	var got string
	mux := http.NewServeMux()
	mux.HandleFunc("DELETE /v1/volumes/{name}", func(w http.ResponseWriter, r *http.Request) { got = r.PathValue("name") })
	reaches := func(n string) bool {
		got = ""
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest("DELETE", "/v1/volumes/"+url.PathEscape(n), nil))
		return rec.Code == http.StatusOK && got == n
	}
	alphabet := "ABCXYZabcxyz0189._-"
	extra := "/%?#;&= +:\\\x00\n\x7fé"
	var names []string
	for _, c := range nameClasses {
		names = append(names, c.names...)
	}
	for _, a := range alphabet + extra {
		names = append(names, string(a))
		for _, b := range alphabet + extra {
			names = append(names, string(a)+string(b))
		}
	}
	for _, n := range names {
		err := CheckName(n)
		if err == nil {
			if !reaches(n) {
				t.Errorf("%q: taken, but DELETE /v1/volumes/%s does not reach its handler with it (got %q)", n, url.PathEscape(n), got)
			}
			if strings.HasPrefix(n, "-") {
				t.Errorf("%q: taken, and a command line takes it for an option", n)
			}
			continue
		}
		if nameRE.MatchString(n) && strings.Trim(n, ".") != "" && n[0] != '-' {
			t.Errorf("%q: in the alphabet, addressable, refused: %v", n, err)
		}
	}
	// Why: the router rewrites the dot-segments.
	for _, n := range []string{".", ".."} {
		if reaches(n) {
			t.Errorf("%q reaches the handler: CheckName need not refuse it", n)
		}
	}
}

// A volume whose name CheckName refuses now and took before (of dots
// only, beginning with '-') is still listed, by a directory pool and
// by an LVM thin pool (its tags are not taken for damaged), so that it
// is seen; changes by its name are refused.
func TestNamesRefusedSinceStillListed(t *testing.T) {
	p := openTest(t, t.TempDir())
	for _, n := range []string{"-old", ".."} {
		v := Volume{Name: n, Pool: p.name, Size: 1 << 20}
		if err := p.make(kindVolume, p.path(n), v.Size, xattr, v, "", 0o600); err != nil {
			t.Fatal(err)
		}
	}
	vs, err := p.List()
	if err != nil || len(vs) != 2 || vs[0].Name != "-old" || vs[1].Name != ".." {
		t.Fatalf("list: %+v, %v", vs, err)
	}
	if err := p.Delete("-old"); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("delete of -old: %v, want EINVAL", err)
	}
	if _, err := p.Resize("..", 2<<20); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("resize of ..: %v, want EINVAL", err)
	}
	m := metaForTest(nil)
	m.Name = "-old"
	tags, err := encodeTags(m)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok, err := decodeTags(tags); err != nil || !ok || got.Name != "-old" {
		t.Fatalf("the tags of LV %s: %+v, %v, %v", lvName("vg", kindVolume, "-old"), got, ok, err)
	}
}
