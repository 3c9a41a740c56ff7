package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	"github.com/rnbd/rnbd/pkg/rnbd"
)

// Fields are the field names of record type T, in its order: the JSON
// names of its fields, those of an embedded struct in its place. What
// --fields takes and show prints, made from the type so that it cannot
// differ from what the daemon sends.
func Fields[T any]() []string {
	return fieldsOf(reflect.TypeFor[T]())
}

func fieldsOf(t reflect.Type) []string {
	var out []string
	for f := range t.Fields() {
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if f.Anonymous && name == "" {
			out = append(out, fieldsOf(f.Type)...)
			continue
		}
		if name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		out = append(out, name)
	}
	return out
}

// Grants are an export's identities, each with the most it may open the
// export for, in their order: a JSON object {"alice": "rw", "backup":
// "ro"} ({} for none).
type Grants []rnbd.Grant

// Access is the access identity is granted, and whether it has one.
func (g Grants) Access(identity string) (string, bool) {
	for _, x := range g {
		if x.Identity == identity {
			return x.Access, true
		}
	}
	return "", false
}

// Identities are the identities granted, sorted.
func (g Grants) Identities() []string {
	var out []string
	for _, x := range g {
		out = append(out, x.Identity)
	}
	slices.Sort(out)
	return out
}

// MarshalJSON writes the grants as an object, in their order.
func (g Grants) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, x := range g {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(x.Identity)
		v, _ := json.Marshal(x.Access)
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// UnmarshalJSON reads an object of strings, keeping its order.
func (g *Grants) UnmarshalJSON(b []byte) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return fmt.Errorf("grants: want a JSON object of identities and access modes, got %.40s", b)
	}
	out := Grants{}
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			return err
		}
		var v string
		if err := dec.Decode(&v); err != nil {
			return fmt.Errorf("grants: %v", err)
		}
		out = append(out, rnbd.Grant{Identity: k.(string), Access: v})
	}
	if _, err := dec.Token(); err != nil {
		return err
	}
	*g = out
	return nil
}

// Labels are a volume's labels: a JSON object of strings, its keys
// sorted ({} for none).
type Labels map[string]string

// MarshalJSON writes {} for none.
func (l Labels) MarshalJSON() ([]byte, error) {
	if l == nil {
		return []byte("{}"), nil
	}
	return json.Marshal(map[string]string(l))
}

// Keys are the label's keys, sorted.
func (l Labels) Keys() []string { return slices.Sorted(maps.Keys(l)) }

// Strings is a list of names or networks: a JSON array, [] for none
// (never null).
type Strings []string

// MarshalJSON writes [] for none.
func (s Strings) MarshalJSON() ([]byte, error) {
	if s == nil {
		return []byte("[]"), nil
	}
	return json.Marshal([]string(s))
}
