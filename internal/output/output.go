// Package output prints lists of records the way the rnbd admin tool does:
// a table by default, or csv, json or xml, with the tool's field names.
//
// A record's values are typed (docs/control-api.md, "Records"): strings,
// numbers, booleans, null, lists, and objects whose members keep their
// order (Object). JSON prints them as they are. Table, csv and xml print
// each value as one cell of text, by one rule (Cell): a list is its items
// joined by ",", an object its members as "key=value" joined by ","; the
// table, which scripts split on blanks, prints an empty cell as "-" and
// blanks inside a value as "_".
package output

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"unicode"
)

// Formats are the output formats.
var Formats = []string{"table", "json", "csv", "xml"}

// ErrUnknownFormat is the error of a format not in Formats.
var ErrUnknownFormat = errors.New("unknown format")

// CheckFormat says whether format is one of Formats ("" is table).
func CheckFormat(format string) error {
	if format == "" || slices.Contains(Formats, format) {
		return nil
	}
	return fmt.Errorf("%w %q: want %s", ErrUnknownFormat, format, strings.Join(Formats, ", "))
}

// Record is one row: values by field name.
type Record map[string]any

// Object is a JSON object whose members keep their order: a record's
// value made of named parts (a path's reconnects: successful, failed).
type Object []Member

// Member is one named value of an Object.
type Member struct {
	Key   string
	Value any
}

// Get returns the value of member key.
func (o Object) Get(key string) (any, bool) {
	for _, m := range o {
		if m.Key == key {
			return m.Value, true
		}
	}
	return nil, false
}

// MarshalJSON writes the members in their order.
func (o Object) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, m := range o {
		if i > 0 {
			b.WriteByte(',')
		}
		k, err := json.Marshal(m.Key)
		if err != nil {
			return nil, err
		}
		v, err := json.Marshal(m.Value)
		if err != nil {
			return nil, err
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// UnmarshalJSON reads an object, its members in order (nested objects
// are Objects too, numbers json.Numbers).
func (o *Object) UnmarshalJSON(b []byte) error {
	v, err := decode(b)
	if err != nil {
		return err
	}
	obj, ok := v.(Object)
	if !ok {
		return fmt.Errorf("output: want a JSON object, got %s", b)
	}
	*o = obj
	return nil
}

// UnmarshalJSON reads a record as the daemons send it: numbers stay as
// they were written (json.Number), objects keep their members' order.
func (r *Record) UnmarshalJSON(b []byte) error {
	var o Object
	if err := o.UnmarshalJSON(b); err != nil {
		return err
	}
	*r = make(Record, len(o))
	for _, m := range o {
		(*r)[m.Key] = m.Value
	}
	return nil
}

func decode(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	v, err := decodeValue(dec)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("output: trailing data after a JSON value")
	}
	return v, nil
}

func decodeValue(dec *json.Decoder) (any, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return tok, nil // string, json.Number, bool or nil
	}
	switch d {
	case '{':
		o := Object{}
		for dec.More() {
			k, err := dec.Token()
			if err != nil {
				return nil, err
			}
			v, err := decodeValue(dec)
			if err != nil {
				return nil, err
			}
			o = append(o, Member{Key: k.(string), Value: v})
		}
		_, err = dec.Token() // '}'
		return o, err
	case '[':
		l := []any{}
		for dec.More() {
			v, err := decodeValue(dec)
			if err != nil {
				return nil, err
			}
			l = append(l, v)
		}
		_, err = dec.Token() // ']'
		return l, err
	}
	return nil, fmt.Errorf("output: unexpected %v", d)
}

// List is what a list or show command prints: records of one kind with
// the fields to show, in order. A field "a.b" is member b of object a.
type List struct {
	Kind    string // singular, e.g. "device"; the xml element name
	Fields  []string
	Records []Record
}

// Print writes l in format.
func Print(w io.Writer, format string, l List) error {
	switch format {
	case "", "table":
		return printTable(w, l)
	case "json":
		return printJSON(w, l)
	case "csv":
		return printCSV(w, l)
	case "xml":
		return printXML(w, l)
	}
	return CheckFormat(format)
}

// value is field f of r: a field of its own, or "a.b", member b of
// object a.
func value(r Record, f string) any {
	if v, ok := r[f]; ok {
		return v
	}
	a, b, ok := strings.Cut(f, ".")
	if !ok {
		return nil
	}
	v, _ := member(r[a], b)
	return v
}

// member is member b of v, if v is an object (an Object, or a map as
// a caller may build one).
func member(v any, b string) (any, bool) {
	switch o := v.(type) {
	case Object:
		return o.Get(b)
	case map[string]any:
		x, ok := o[b]
		return x, ok
	}
	return nil, false
}

// Cell is a value as one cell of text: the rule table, csv and xml
// print by. Null is empty; a list is its items joined by ","; an object
// is its members as "key=value" joined by ","; numbers are written in
// full, never with an exponent.
func Cell(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case json.Number:
		return v.String()
	case bool:
		return strconv.FormatBool(v)
	case float64:
		return formatFloat(v)
	case float32:
		return formatFloat(float64(v))
	case Object:
		parts := make([]string, len(v))
		for i, m := range v {
			parts[i] = m.Key + "=" + Cell(m.Value)
		}
		return strings.Join(parts, ",")
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		parts := make([]string, len(keys))
		for i, k := range keys {
			parts[i] = k + "=" + Cell(v[k])
		}
		return strings.Join(parts, ",")
	case []any:
		parts := make([]string, len(v))
		for i, x := range v {
			parts[i] = Cell(x)
		}
		return strings.Join(parts, ",")
	case []string:
		return strings.Join(v, ",")
	case fmt.Stringer:
		return v.String()
	}
	return fmt.Sprint(v)
}

func formatFloat(v float64) string {
	if v == math.Trunc(v) && math.Abs(v) < 1<<63 {
		return strconv.FormatInt(int64(v), 10)
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}

// tableCell is a cell of the table: one word, as scripts split lines on
// blanks; "-" for an empty value, "_" for each run of blanks in one.
func tableCell(v any) string {
	s := Cell(v)
	if s == "" {
		return "-"
	}
	if strings.IndexFunc(s, unicode.IsSpace) < 0 {
		return s
	}
	return strings.Join(strings.FieldsFunc(s, unicode.IsSpace), "_")
}

func printTable(w io.Writer, l List) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(l.Fields, "\t"))
	for _, r := range l.Records {
		vals := make([]string, len(l.Fields))
		for i, f := range l.Fields {
			vals[i] = tableCell(value(r, f))
		}
		fmt.Fprintln(tw, strings.Join(vals, "\t"))
	}
	return tw.Flush()
}

func printCSV(w io.Writer, l List) error {
	cw := csv.NewWriter(w)
	cw.Write(l.Fields)
	for _, r := range l.Records {
		vals := make([]string, len(l.Fields))
		for i, f := range l.Fields {
			vals[i] = Cell(value(r, f))
		}
		cw.Write(vals)
	}
	cw.Flush()
	return cw.Error()
}

// printJSON writes an array of objects; each has exactly the fields, in
// their order. A member field "a.b" is b within an object a holding
// only the members selected (all of them if a is selected too).
func printJSON(w io.Writer, l List) error {
	out := make([]Object, 0, len(l.Records))
	for _, r := range l.Records {
		var o Object
		at := map[string]int{}     // a field's index in o
		whole := map[string]bool{} // fields printed whole
		for _, f := range l.Fields {
			a, b, isMember := strings.Cut(f, ".")
			if _, ok := r[f]; ok || !isMember {
				if i, ok := at[f]; ok {
					o[i].Value, whole[f] = r[f], true // all of it, after some members
					continue
				}
				at[f], whole[f] = len(o), true
				o = append(o, Member{Key: f, Value: r[f]})
				continue
			}
			v, _ := member(r[a], b)
			switch i, ok := at[a]; {
			case whole[a]:
			case ok:
				o[i].Value = append(o[i].Value.(Object), Member{Key: b, Value: v})
			default:
				at[a] = len(o)
				o = append(o, Member{Key: a, Value: Object{{Key: b, Value: v}}})
			}
		}
		if o == nil {
			o = Object{}
		}
		out = append(out, o)
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func printXML(w io.Writer, l List) error {
	enc := xml.NewEncoder(w)
	enc.Indent("", "  ")
	root := xml.StartElement{Name: xml.Name{Local: l.Kind + "s"}}
	if err := enc.EncodeToken(root); err != nil {
		return err
	}
	for _, r := range l.Records {
		item := xml.StartElement{Name: xml.Name{Local: l.Kind}}
		enc.EncodeToken(item)
		for _, f := range l.Fields {
			enc.EncodeElement(Cell(value(r, f)), xml.StartElement{Name: xml.Name{Local: f}})
		}
		enc.EncodeToken(item.End())
	}
	enc.EncodeToken(root.End())
	if err := enc.Flush(); err != nil {
		return err
	}
	_, err := io.WriteString(w, "\n")
	return err
}

// Fields applies a field selection to defaults, as the rnbd tool's
// "f1,f2", "+f" (add), "-f" (remove) and "all". A field "a.b" selects
// member b of the object field a (CheckMembers looks at b).
func Fields(sel string, defaults, all []string) ([]string, error) {
	if sel == "" {
		return defaults, nil
	}
	if sel == "all" {
		return all, nil
	}
	known := func(f string) bool {
		a, _, _ := strings.Cut(f, ".")
		return slices.Contains(all, f) || (a != f && slices.Contains(all, a))
	}
	unknown := func(f string) error {
		return fmt.Errorf("unknown field %q (known: %s; a member of an object field as field.member)", f, strings.Join(all, ","))
	}
	out := append([]string(nil), defaults...)
	replace := true
	for _, f := range strings.Split(sel, ",") {
		f = strings.TrimSpace(f)
		switch {
		case strings.HasPrefix(f, "+"):
			if !known(f[1:]) {
				return nil, unknown(f[1:])
			}
			out = append(out, f[1:])
		case strings.HasPrefix(f, "-"):
			keep := out[:0]
			for _, x := range out {
				if x != f[1:] {
					keep = append(keep, x)
				}
			}
			out = keep
		default:
			if !known(f) {
				return nil, unknown(f)
			}
			if replace {
				out, replace = nil, false
			}
			out = append(out, f)
		}
	}
	return out, nil
}

// CheckMembers says which member field "a.b" of fields no record has,
// where a is an object in the records; a list of no records has every
// member.
func CheckMembers(fields []string, recs []Record) error {
	for _, f := range fields {
		a, b, ok := strings.Cut(f, ".")
		if !ok || len(recs) == 0 {
			continue
		}
		if _, whole := recs[0][f]; whole {
			continue
		}
		found := false
		var of any
		for _, r := range recs {
			if _, ok := member(r[a], b); ok {
				found = true
				break
			}
			if r[a] != nil {
				of = r[a]
			}
		}
		if found {
			continue
		}
		if o, isObj := of.(Object); isObj {
			names := make([]string, len(o))
			for i, m := range o {
				names[i] = a + "." + m.Key
			}
			return fmt.Errorf("unknown field %q (%s has %s)", f, a, strings.Join(names, ","))
		}
		return fmt.Errorf("unknown field %q: %s has no members", f, a)
	}
	return nil
}
