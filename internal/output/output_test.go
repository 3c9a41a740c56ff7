package output

import (
	"bytes"
	"encoding/json"
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
