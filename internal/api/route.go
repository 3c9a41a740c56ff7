package api

import (
	"fmt"
	"net/url"
	"strings"

	"github.com/rnbd/rnbd/internal/ctl"
)

// Route is one endpoint of a control API: its method, its path pattern
// (names in braces: "/v1/volumes/{name}"), and the right a caller's role
// must have (ctl.Right).
type Route struct {
	Method string
	Path   string
	Right  ctl.Right
}

// Pattern is the route as http.ServeMux and the rights table write it:
// "DELETE /v1/volumes/{name}".
func (r Route) Pattern() string { return r.Method + " " + r.Path }

// Names is how many names the route's path has: the arguments URL
// takes.
func (r Route) Names() int { return strings.Count(r.Path, "{") }

// URL is the route's path with its names filled by args, in order, each
// escaped as one path segment. Fewer or more args than names is a bug:
// it panics.
func (r Route) URL(args ...string) string {
	var b strings.Builder
	rest, n := r.Path, 0
	for {
		i := strings.IndexByte(rest, '{')
		if i < 0 {
			b.WriteString(rest)
			break
		}
		j := strings.IndexByte(rest[i:], '}')
		if n >= len(args) {
			panic(fmt.Sprintf("api: %s: %d arguments for more names", r.Pattern(), len(args)))
		}
		b.WriteString(rest[:i])
		b.WriteString(url.PathEscape(args[n]))
		rest, n = rest[i+j+1:], n+1
	}
	if n != len(args) {
		panic(fmt.Sprintf("api: %s: %d arguments for %d names", r.Pattern(), len(args), n))
	}
	return b.String()
}

// Table is a daemon's routes, each pattern once.
type Table []Route

// Right is the right pattern needs by the table: "" for a pattern that
// is not one of its routes (ctl then asks admin: a route no one thought
// of is safe).
func (t Table) Right(pattern string) ctl.Right {
	for _, r := range t {
		if r.Pattern() == pattern {
			return r.Right
		}
	}
	return ""
}
