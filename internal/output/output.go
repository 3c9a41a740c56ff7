// Package output prints lists of records the way the rnbd admin tool does:
// a table by default, or csv, json or xml, with the tool's field names.
package output

import (
	"encoding/csv"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// Formats are the output formats.
var Formats = []string{"table", "json", "csv", "xml"}

// Record is one row: values by field name.
type Record map[string]any

// List is what a list or show command prints: records of one kind with
// the fields to show, in order.
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
	return fmt.Errorf("unknown format %q: want %s", format, strings.Join(Formats, ", "))
}

func str(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case float64:
		// JSON numbers arrive as float64: counters print as integers.
		if v == float64(int64(v)) {
			return fmt.Sprintf("%d", int64(v))
		}
		return fmt.Sprintf("%g", v)
	}
	return fmt.Sprint(v)
}

func printTable(w io.Writer, l List) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(l.Fields, "\t"))
	for _, r := range l.Records {
		vals := make([]string, len(l.Fields))
		for i, f := range l.Fields {
			vals[i] = str(r[f])
			if vals[i] == "" {
				vals[i] = "-"
			}
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
			vals[i] = str(r[f])
		}
		cw.Write(vals)
	}
	cw.Flush()
	return cw.Error()
}

// printJSON writes an array of objects; each has exactly the fields.
func printJSON(w io.Writer, l List) error {
	out := make([]map[string]any, 0, len(l.Records))
	for _, r := range l.Records {
		m := make(map[string]any, len(l.Fields))
		for _, f := range l.Fields {
			m[f] = r[f]
		}
		out = append(out, m)
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
			enc.EncodeElement(str(r[f]), xml.StartElement{Name: xml.Name{Local: f}})
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
// "f1,f2", "+f" (add), "-f" (remove) and "all".
func Fields(sel string, defaults, all []string) ([]string, error) {
	if sel == "" {
		return defaults, nil
	}
	if sel == "all" {
		return all, nil
	}
	known := map[string]bool{}
	for _, f := range all {
		known[f] = true
	}
	out := append([]string(nil), defaults...)
	replace := true
	for _, f := range strings.Split(sel, ",") {
		f = strings.TrimSpace(f)
		switch {
		case strings.HasPrefix(f, "+"):
			if !known[f[1:]] {
				return nil, fmt.Errorf("unknown field %q (known: %s)", f[1:], strings.Join(all, ","))
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
			if !known[f] {
				return nil, fmt.Errorf("unknown field %q (known: %s)", f, strings.Join(all, ","))
			}
			if replace {
				out, replace = nil, false
			}
			out = append(out, f)
		}
	}
	return out, nil
}
