package conf

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strings"

	"github.com/BurntSushi/toml"
)

// KeyDoc is one row of a configuration file's reference: the daemon's
// table in docs/ and its toml(5) man page are both made from these, and
// a test holds them to the configuration's struct and the daemon's
// flags, so the three cannot drift apart.
type KeyDoc struct {
	// Table is where the keys are: "" the top level, "[tls]", or
	// "[[export]]" (a row of that table itself has no Keys).
	Table string
	Keys  []string
	// Flag is the daemon's flag for it, Markdown ("`--listen`
	// (repeat)"), or what else sets it; "" none.
	Flag string
	// Default as the docs say it. Where it depends on the host (its
	// memory, its CPUs) it is the rule, never a number.
	Default string
	Doc     string // Markdown
}

// Name is the row's key column: "`listen`", "`[tls]` `cert`, `key`".
func (k KeyDoc) Name() string {
	var keys []string
	for _, n := range k.Keys {
		keys = append(keys, "`"+n+"`")
	}
	switch {
	case k.Table == "":
		return strings.Join(keys, ", ")
	case len(keys) == 0:
		return "`" + k.Table + "`"
	}
	return "`" + k.Table + "` " + strings.Join(keys, ", ")
}

// Paths are the row's keys as dotted paths: "tls.cert", "export".
func (k KeyDoc) Paths() []string {
	t := strings.Trim(k.Table, "[]")
	if len(k.Keys) == 0 {
		return []string{t}
	}
	var out []string
	for _, n := range k.Keys {
		if t != "" {
			n = t + "." + n
		}
		out = append(out, n)
	}
	return out
}

// MarkdownTable is the reference as docs/*.md has it: key, flag,
// default, meaning.
func MarkdownTable(rows []KeyDoc) string {
	cell := func(s string) string { return strings.ReplaceAll(s, "|", `\|`) }
	var b strings.Builder
	b.WriteString("| key | flag | default | meaning |\n|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", cell(r.Name()), cell(r.Flag), cell(r.Default), cell(r.Doc))
	}
	return b.String()
}

// KeyPaths are every key and table a TOML decoding of v takes, as
// dotted paths ("listen", "tls", "tls.cert", "export.name"), sorted:
// what a configuration's reference must cover.
func KeyPaths(v any) []string {
	var out []string
	var walk func(prefix string, t reflect.Type)
	walk = func(prefix string, t reflect.Type) {
		for _, n := range knownKeys(t) {
			out = append(out, prefix+n.name)
			if n.kind != keyName {
				walk(prefix+n.name+".", n.typ)
			}
		}
	}
	walk("", reflect.TypeOf(v))
	sort.Strings(out)
	return out
}

// CheckKeys holds a reference to the configuration v: every key and
// table of v is documented by one row (a table by a row of its own or
// of its keys), no row documents a key v does not have, and where a
// row's default is a plain value (a number, a word, a duration, a
// quoted string) it is what v, the defaults, has.
func CheckKeys(rows []KeyDoc, v any) error {
	have := map[string]bool{}
	for _, p := range KeyPaths(v) {
		have[p] = true
	}
	documented := map[string]int{}
	var errs []string
	for _, r := range rows {
		for _, p := range r.Paths() {
			documented[p]++
			if !have[p] {
				errs = append(errs, fmt.Sprintf("%s is documented but not a key of the configuration", p))
			}
			if i := strings.LastIndexByte(p, '.'); i > 0 {
				documented[p[:i]+" (table)"]++
			}
		}
	}
	for _, p := range KeyPaths(v) {
		switch n := documented[p]; {
		case n == 0 && documented[p+" (table)"] == 0:
			errs = append(errs, fmt.Sprintf("%s is not documented", p))
		case n > 1:
			errs = append(errs, fmt.Sprintf("%s is documented %d times", p, n))
		}
	}
	values, err := defaults(v)
	if err != nil {
		return err
	}
	for _, r := range rows {
		ds := strings.Split(r.Default, ", ")
		if len(ds) != len(r.Keys) || strings.HasPrefix(r.Table, "[[") { // no table of an array in the defaults
			continue
		}
		for i, p := range r.Paths() {
			d := strings.Trim(ds[i], "`")
			if strings.ContainsAny(d, " ()") || d == "unset" || d == "none" || d == "any" || d == "required" {
				continue // a rule, not a value
			}
			if got, ok := values[p]; !ok || got != d {
				errs = append(errs, fmt.Sprintf("%s: documented default %q, the configuration's is %q", p, d, got))
			}
		}
	}
	sort.Strings(errs)
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "\n"))
	}
	return nil
}

// defaults are v's values as a TOML file writes them, by dotted path.
func defaults(v any) (map[string]string, error) {
	var b bytes.Buffer
	if err := toml.NewEncoder(&b).Encode(v); err != nil {
		return nil, err
	}
	var m map[string]any
	if _, err := toml.Decode(b.String(), &m); err != nil {
		return nil, err
	}
	out := map[string]string{}
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, x := range m {
			switch x := x.(type) {
			case map[string]any:
				walk(prefix+k+".", x)
			case []any:
				var s []string
				for _, e := range x {
					s = append(s, fmt.Sprint(e))
				}
				out[prefix+k] = strings.Join(s, "`, `")
			default:
				out[prefix+k] = fmt.Sprint(x)
			}
		}
	}
	walk("", m)
	return out, nil
}

// The generated table in a Markdown file is between these lines.
const (
	tableBegin = "<!-- The table below is made from ConfigKeys (internal/%s/keys.go): change it there, then go test ./internal/%s -run TestConfigKeysDoc -update -->"
	tableEnd   = "<!-- end of the table made from ConfigKeys -->"
)

// SyncDoc checks that the Markdown file at path has rows' table between
// its markers (pkg is the package that has them), or with update
// writes it there.
func SyncDoc(path, pkg string, rows []KeyDoc, update bool) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	begin := fmt.Sprintf(tableBegin, pkg, pkg)
	s := string(b)
	i, j := strings.Index(s, begin+"\n"), strings.Index(s, tableEnd)
	if i < 0 || j < i {
		return fmt.Errorf("%s: no %q ... %q", path, begin, tableEnd)
	}
	i += len(begin) + 1
	want := MarkdownTable(rows)
	if s[i:j] == want {
		return nil
	}
	if !update {
		return fmt.Errorf("%s: the configuration's table is not what ConfigKeys makes: go test ./internal/%s -run TestConfigKeysDoc -update", path, pkg)
	}
	return os.WriteFile(path, []byte(s[:i]+want+s[j:]), 0o644)
}
