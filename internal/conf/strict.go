package conf

import (
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"

	"github.com/BurntSushi/toml"
)

// unknownKeys is an error for every key and table of the file that v
// has no field for: one line each, "config FILE:LINE: unknown key …"
// with the nearest known name at that place. Only the outermost unknown
// one is named: an unknown table's keys are not listed again.
func unknownKeys(path string, data []byte, md toml.MetaData, v any) error {
	undecoded := md.Undecoded()
	if len(undecoded) == 0 {
		return nil
	}
	unknown := map[string]bool{}
	for _, k := range undecoded {
		unknown[join(k)] = true
	}
	lines := keyLines(string(data))
	seen := map[string]bool{}
	var errs []error
	for _, k := range undecoded {
		if seen[join(k)] || parentUnknown(k, unknown) {
			continue
		}
		seen[join(k)] = true
		what := describe(k, md.Type(k...))
		if s := suggest(reflect.TypeOf(v), k); s != "" {
			what += " (did you mean " + s + "?)"
		}
		at := lines[join(k)]
		for i := len(k) - 1; len(at) == 0 && i > 0; i-- {
			at = lines[join(k[:i])] // in an inline table: its line
		}
		if len(at) == 0 {
			errs = append(errs, fmt.Errorf("config %s: %s", path, what))
			continue
		}
		for _, l := range at {
			errs = append(errs, fmt.Errorf("config %s:%d: %s", path, l, what))
		}
	}
	return errors.Join(errs...)
}

func join(k toml.Key) string { return strings.Join(k, "\x00") }

// parentUnknown reports whether a table k is in is unknown itself.
func parentUnknown(k toml.Key, unknown map[string]bool) bool {
	for i := 1; i < len(k); i++ {
		if unknown[join(k[:i])] {
			return true
		}
	}
	return false
}

// describe names an unknown key as the file has it: `key "x" in [t]`,
// `table [t]`.
func describe(k toml.Key, typ string) string {
	name := k[len(k)-1]
	in := ""
	if len(k) > 1 {
		in = " in [" + k[:len(k)-1].String() + "]"
	}
	switch typ {
	case "Hash":
		return "unknown table [" + k.String() + "]"
	case "ArrayHash":
		return "unknown table [[" + k.String() + "]]"
	}
	return fmt.Sprintf("unknown key %q%s", name, in)
}

// known is a name the configuration type has at one place: a key, a
// [table] or an [[array of tables]].
type known struct {
	name string
	kind int // keyName, tableName, arrayName
	typ  reflect.Type
}

const (
	keyName = iota
	tableName
	arrayName
)

func (n known) String() string {
	switch n.kind {
	case tableName:
		return "[" + n.name + "]"
	case arrayName:
		return "[[" + n.name + "]]"
	}
	return n.name
}

// KnownKeys are the names a TOML decoding of t takes at its top level,
// as BurntSushi/toml matches them: tags, else field names; embedded
// structs without a tag add their fields.
func knownKeys(t reflect.Type) []known {
	t = deref(t)
	if t.Kind() != reflect.Struct {
		return nil
	}
	var out []known
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
		if tag == "-" || (!f.IsExported() && !f.Anonymous) {
			continue
		}
		ft := deref(f.Type)
		if f.Anonymous && tag == "" && ft.Kind() == reflect.Struct {
			out = append(out, knownKeys(ft)...)
			continue
		}
		name := tag
		if name == "" {
			name = f.Name
		}
		kind := keyName
		switch {
		case ft.Kind() == reflect.Struct && !isValue(ft):
			kind = tableName
		case ft.Kind() == reflect.Slice && deref(ft.Elem()).Kind() == reflect.Struct && !isValue(deref(ft.Elem())):
			kind, ft = arrayName, deref(ft.Elem())
		}
		out = append(out, known{name: name, kind: kind, typ: ft})
	}
	return out
}

// isValue: a struct the file writes as one value (a duration).
func isValue(t reflect.Type) bool {
	p := reflect.PointerTo(t)
	return p.Implements(reflect.TypeFor[toml.Unmarshaler]()) || p.Implements(reflect.TypeFor[interface{ UnmarshalText([]byte) error }]())
}

func deref(t reflect.Type) reflect.Type {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

// suggest is the known name nearest to k's last part at k's place in
// t, or one of the same name elsewhere ("[tls] cert"); "" if none is
// near.
func suggest(t reflect.Type, k toml.Key) string {
	level := knownKeys(t)
	for _, p := range k[:len(k)-1] {
		var next []known
		for _, n := range level {
			if n.name == p && n.kind != keyName {
				next = knownKeys(n.typ)
			}
		}
		level = next
	}
	want := normalize(k[len(k)-1])
	// Near: 1 edit under 5 letters, 2 from 5, 3 from 10.
	best, bestD := "", 2+min(2, len(want)/5)
	for _, n := range level {
		if d := distance(want, normalize(n.name)); d < bestD {
			best, bestD = n.String(), d
		}
	}
	if best != "" {
		return best
	}
	// The right name in the wrong table: a key of [tls] at the top.
	var elsewhere []string
	var walk func(prefix string, ns []known)
	walk = func(prefix string, ns []known) {
		for _, n := range ns {
			if n.kind != keyName {
				walk(prefix+n.String()+" ", knownKeys(n.typ))
			} else if normalize(n.name) == want && prefix != "" {
				elsewhere = append(elsewhere, prefix+n.name)
			}
		}
	}
	walk("", knownKeys(t))
	if len(k) > 1 {
		for _, n := range knownKeys(t) {
			if n.kind == keyName && normalize(n.name) == want {
				elsewhere = append(elsewhere, n.name+" at the top, before any table")
			}
		}
	}
	sort.Strings(elsewhere)
	return strings.Join(elsewhere, " or ")
}

// normalize makes "Max-Chunk-Memory" (a flag's spelling) max_chunk_memory.
func normalize(s string) string { return strings.ReplaceAll(strings.ToLower(s), "-", "_") }

// distance is the optimal string alignment distance: insertions,
// deletions, substitutions and transpositions of neighbours ("tsl").
func distance(a, b string) int {
	ra, rb := []rune(a), []rune(b)
	d := make([][]int, len(ra)+1)
	for i := range d {
		d[i] = make([]int, len(rb)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(ra); i++ {
		for j := 1; j <= len(rb); j++ {
			cost := 1
			if ra[i-1] == rb[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && ra[i-1] == rb[j-2] && ra[i-2] == rb[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(ra)][len(rb)]
}

// keyLines finds where a TOML file defines each key and table: the
// lines (from 1) by join(key), in order. It reads table headers and
// "key =" lines, skipping multi-line strings and the continuation lines
// of multi-line values; a dotted key also defines its prefixes there.
func keyLines(data string) map[string][]int {
	out := map[string][]int{}
	add := func(k []string, line int) {
		j := join(k)
		if l := out[j]; len(l) == 0 || l[len(l)-1] != line {
			out[j] = append(out[j], line)
		}
	}
	var table []string
	inString := "" // the delimiter of a multi-line string we are in
	depth := 0     // open brackets of a multi-line value
	for i, line := range strings.Split(data, "\n") {
		n := i + 1
		if inString != "" {
			if strings.Count(line, inString)%2 == 1 {
				inString = ""
			}
			continue
		}
		if depth > 0 {
			depth += brackets(line, &inString)
			continue
		}
		s := strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(s, "[["):
			if k, rest, ok := parseKey(s[2:]); ok && strings.HasPrefix(rest, "]]") {
				table = k
				add(k, n)
			}
		case strings.HasPrefix(s, "["):
			if k, rest, ok := parseKey(s[1:]); ok && strings.HasPrefix(rest, "]") {
				table = k
				add(k, n)
			}
		default:
			k, rest, ok := parseKey(s)
			if !ok || !strings.HasPrefix(rest, "=") {
				continue
			}
			full := append(append([]string{}, table...), k...)
			for j := len(table) + 1; j <= len(full); j++ {
				add(full[:j], n)
			}
			depth = brackets(rest[1:], &inString)
		}
	}
	return out
}

// parseKey reads a TOML key, bare or quoted pieces joined by dots, from
// the start of s: its pieces and the rest after the spaces that follow.
func parseKey(s string) (k []string, rest string, ok bool) {
	for {
		s = strings.TrimLeft(s, " \t")
		if s == "" {
			return nil, "", false
		}
		var piece string
		switch s[0] {
		case '"', '\'':
			end := 1
			for end < len(s) && s[end] != s[0] {
				if s[0] == '"' && s[end] == '\\' {
					end++
				}
				end++
			}
			if end >= len(s) {
				return nil, "", false
			}
			quote := s[0]
			piece, s = s[1:end], s[end+1:]
			if quote == '"' && strings.Contains(piece, "\\") {
				if u, err := unquote(piece); err == nil {
					piece = u
				}
			}
		default:
			end := 0
			for end < len(s) && (s[end] == '_' || s[end] == '-' || s[end] >= '0' && s[end] <= '9' ||
				s[end] >= 'a' && s[end] <= 'z' || s[end] >= 'A' && s[end] <= 'Z') {
				end++
			}
			if end == 0 {
				return nil, "", false
			}
			piece, s = s[:end], s[end:]
		}
		k = append(k, piece)
		s = strings.TrimLeft(s, " \t")
		if !strings.HasPrefix(s, ".") {
			return k, s, true
		}
		s = s[1:]
	}
}

func unquote(s string) (string, error) {
	var v struct{ K string }
	_, err := toml.Decode(`K = "`+s+`"`, &v)
	return v.K, err
}

// brackets is how many more brackets a value's text opens than it
// closes, outside strings and comments; a multi-line string it opens
// and does not close is left in *inString.
func brackets(s string, inString *string) int {
	n := 0
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '#':
			return n
		case '[', '{':
			n++
		case ']', '}':
			n--
		case '"', '\'':
			if delim := strings.Repeat(string(c), 3); strings.HasPrefix(s[i:], delim) {
				end := strings.Index(s[i+3:], delim)
				if end < 0 {
					*inString = delim
					return n
				}
				i += 3 + end + 2
				continue
			}
			j := i + 1
			for j < len(s) && s[j] != c {
				if c == '"' && s[j] == '\\' {
					j++
				}
				j++
			}
			i = j
		}
	}
	return n
}
