package output

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

var list = List{
	Kind:   "device",
	Fields: []string{"devname", "state", "rx_sect"},
	Records: []Record{
		{"devname": "d0", "state": "open", "rx_sect": 8, "extra": "hidden"},
		{"devname": "d,1", "state": "", "rx_sect": 0},
	},
}

func render(t *testing.T, format string) string {
	t.Helper()
	var b bytes.Buffer
	if err := Print(&b, format, list); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func TestFormats(t *testing.T) {
	want := "devname  state  rx_sect\nd0       open   8\nd,1      -      0\n"
	if got := render(t, "table"); got != want {
		t.Errorf("table:\n%q\nwant\n%q", got, want)
	}
	if got := render(t, "csv"); got != "devname,state,rx_sect\nd0,open,8\n\"d,1\",,0\n" {
		t.Errorf("csv: %q", got)
	}
	var recs []map[string]any
	if err := json.Unmarshal([]byte(render(t, "json")), &recs); err != nil {
		t.Fatal(err)
	}
	if len(recs) != 2 || recs[0]["devname"] != "d0" || recs[0]["rx_sect"] != float64(8) || len(recs[0]) != 3 {
		t.Errorf("json: %v", recs)
	}
	x := render(t, "xml")
	if !strings.Contains(x, "<devices>") || strings.Count(x, "<device>") != 2 || !strings.Contains(x, "<rx_sect>8</rx_sect>") {
		t.Errorf("xml: %s", x)
	}
	if err := Print(&bytes.Buffer{}, "yaml", list); err == nil {
		t.Error("unknown format accepted")
	}
}

func TestFields(t *testing.T) {
	all := []string{"a", "b", "c", "d"}
	def := []string{"a", "b"}
	for sel, want := range map[string]string{
		"":      "a,b",
		"all":   "a,b,c,d",
		"c,a":   "c,a",
		"+c":    "a,b,c",
		"-a,+d": "b,d",
	} {
		got, err := Fields(sel, def, all)
		if err != nil || strings.Join(got, ",") != want {
			t.Errorf("Fields(%q) = %v %v, want %s", sel, got, err, want)
		}
	}
	if _, err := Fields("nope", def, all); err == nil {
		t.Error("unknown field accepted")
	}
	if def[0] != "a" || def[1] != "b" {
		t.Errorf("Fields changed the defaults: %v", def)
	}
}

// typed is a record of every kind of value the daemons send.
var typed = List{
	Kind:   "path",
	Fields: []string{"pathname", "state", "reconnects", "allow_from", "delay_sec", "since"},
	Records: []Record{{
		"pathname":   "ip:10.0.0.1@ip:10.0.0.2",
		"state":      "closed by server",
		"reconnects": Object{{"successful", 3}, {"failed", 12}},
		"allow_from": []any{"10.0.0.0/24", "10.1.0.0/24"},
		"delay_sec":  0.25,
		"since":      nil,
	}},
}

func renderList(t *testing.T, format string, l List) string {
	t.Helper()
	var b bytes.Buffer
	if err := Print(&b, format, l); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// TestTypedCells: an object or a list is one cell, in the table one word
// (its lines split on blanks into exactly the columns), and the same
// text in csv and xml; JSON keeps the types and the members' order.
func TestTypedCells(t *testing.T) {
	table := renderList(t, "table", typed)
	lines := strings.Split(strings.TrimRight(table, "\n"), "\n")
	if len(lines) != 2 {
		t.Fatalf("table: %q", table)
	}
	for _, line := range lines {
		if n := len(strings.Fields(line)); n != len(typed.Fields) {
			t.Errorf("table line %q splits into %d words, want %d", line, n, len(typed.Fields))
		}
	}
	want := []string{"ip:10.0.0.1@ip:10.0.0.2", "closed_by_server", "successful=3,failed=12", "10.0.0.0/24,10.1.0.0/24", "0.25", "-"}
	if got := strings.Fields(lines[1]); strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("table cells %q, want %q", got, want)
	}
	if got := renderList(t, "csv", typed); got != "pathname,state,reconnects,allow_from,delay_sec,since\n"+
		`ip:10.0.0.1@ip:10.0.0.2,closed by server,"successful=3,failed=12","10.0.0.0/24,10.1.0.0/24",0.25,`+"\n" {
		t.Errorf("csv: %q", got)
	}
	if x := renderList(t, "xml", typed); !strings.Contains(x, "<reconnects>successful=3,failed=12</reconnects>") || !strings.Contains(x, "<since></since>") {
		t.Errorf("xml: %s", x)
	}
	js := renderList(t, "json", typed)
	if !strings.Contains(js, `"reconnects": {
      "successful": 3,
      "failed": 12
    }`) {
		t.Errorf("json does not keep the members' order: %s", js)
	}
	var recs []map[string]any
	if err := json.Unmarshal([]byte(js), &recs); err != nil {
		t.Fatal(err)
	}
	if r := recs[0]; r["delay_sec"] != 0.25 || r["since"] != nil || len(r["allow_from"].([]any)) != 2 {
		t.Errorf("json: %v", r)
	}
}

// TestDecodeKeepsOrderAndNumbers: what the command line decodes from a
// daemon prints as the daemon wrote it: members in order, numbers whole
// (a 64-bit counter is not rounded through a float).
func TestDecodeKeepsOrderAndNumbers(t *testing.T) {
	var recs []Record
	in := `[{"rdma":{"rd_cnt":18446744073709551615,"rd_bytes":2,"wr_cnt":3},"lat_us":12.5,"ok":true,"n":null,"l":["a","b"]}]`
	if err := json.Unmarshal([]byte(in), &recs); err != nil {
		t.Fatal(err)
	}
	l := List{Kind: "stats", Fields: []string{"rdma", "lat_us", "ok", "n", "l"}, Records: recs}
	if got := renderList(t, "csv", l); got != "rdma,lat_us,ok,n,l\n\"rd_cnt=18446744073709551615,rd_bytes=2,wr_cnt=3\",12.5,true,,\"a,b\"\n" {
		t.Errorf("csv: %q", got)
	}
	var back bytes.Buffer
	if err := json.Compact(&back, []byte(renderList(t, "json", l))); err != nil || back.String() != in {
		t.Errorf("json round trip: %s %v, want %s", back.String(), err, in)
	}
}

// TestMemberFields: "a.b" selects a member of an object field: a column
// of its own in the table, a partial object in JSON; an unknown member
// is refused by CheckMembers, an unknown field by Fields.
func TestMemberFields(t *testing.T) {
	fields, err := Fields("pathname,reconnects.failed", typed.Fields, typed.Fields)
	if err != nil {
		t.Fatal(err)
	}
	l := List{Kind: "path", Fields: fields, Records: typed.Records}
	if err := CheckMembers(fields, l.Records); err != nil {
		t.Fatal(err)
	}
	if got := renderList(t, "table", l); got != "pathname                 reconnects.failed\nip:10.0.0.1@ip:10.0.0.2  12\n" {
		t.Errorf("table: %q", got)
	}
	var b bytes.Buffer
	json.Compact(&b, []byte(renderList(t, "json", l)))
	if b.String() != `[{"pathname":"ip:10.0.0.1@ip:10.0.0.2","reconnects":{"failed":12}}]` {
		t.Errorf("json: %s", b.String())
	}
	l.Fields = []string{"reconnects.failed", "reconnects"}
	b.Reset()
	json.Compact(&b, []byte(renderList(t, "json", l)))
	if b.String() != `[{"reconnects":{"successful":3,"failed":12}}]` {
		t.Errorf("json of an object and one of its members: %s", b.String())
	}
	if err := CheckMembers([]string{"reconnects.nope"}, l.Records); err == nil || !strings.Contains(err.Error(), "reconnects.successful,reconnects.failed") {
		t.Errorf("unknown member: %v", err)
	}
	if err := CheckMembers([]string{"state.x"}, l.Records); err == nil {
		t.Error("a member of a string accepted")
	}
	if _, err := Fields("nope.x", typed.Fields, typed.Fields); err == nil {
		t.Error("a member of an unknown field accepted")
	}
}

func TestCheckFormat(t *testing.T) {
	for _, f := range []string{"", "table", "json", "csv", "xml"} {
		if err := CheckFormat(f); err != nil {
			t.Errorf("%q: %v", f, err)
		}
	}
	if err := CheckFormat("yaml"); !errors.Is(err, ErrUnknownFormat) {
		t.Errorf("yaml: %v", err)
	}
}
