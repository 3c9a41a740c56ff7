package api

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/rnbd/rnbd/internal/ctl"
)

// TestPathSum: a session's paths summed as its record gives them.
func TestPathSum(t *testing.T) {
	s := NewPathSum()
	if s.State != "disconnected" || s.PathUU != "" || s.PathCnt != 0 {
		t.Fatalf("no paths: %+v", s)
	}
	s.Add(true, 1, 2, 3)
	s.Add(false, 10, 20, 30)
	want := PathSum{PathCnt: 2, ActPathCnt: 1, State: "connected", PathUU: "U_", RxBytes: 11, TxBytes: 22, Inflights: 33}
	if s != want {
		t.Fatalf("got %+v, want %+v", s, want)
	}
}

// TestRouteURL: a route's names are filled in order, each escaped as one
// path segment; a wrong number of arguments is a bug.
func TestRouteURL(t *testing.T) {
	if got := SrvVolumeRevoke.URL("v 1", "a/b"); got != "/v1/volumes/v%201/grants/a%2Fb" {
		t.Errorf("URL: %q", got)
	}
	if got := SrvVolumes.URL(); got != "/v1/volumes" {
		t.Errorf("URL: %q", got)
	}
	for _, args := range [][]string{{}, {"a", "b"}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("URL(%q) of %s did not panic", args, SrvVolume.Pattern())
				}
			}()
			SrvVolume.URL(args...)
		}()
	}
}

// TestTables: each pattern once in each table, each with a right.
func TestTables(t *testing.T) {
	for name, tab := range map[string]Table{"server": ServerRoutes, "client": ClientRoutes} {
		seen := map[string]bool{}
		for _, r := range tab {
			if seen[r.Pattern()] {
				t.Errorf("%s: %s twice", name, r.Pattern())
			}
			seen[r.Pattern()] = true
			if r.Right == "" || tab.Right(r.Pattern()) != r.Right {
				t.Errorf("%s: %s has no right", name, r.Pattern())
			}
			if !strings.HasPrefix(r.Path, "/v1/") {
				t.Errorf("%s: %s not under /v1", name, r.Pattern())
			}
		}
	}
	if ServerRoutes.Right("POST /v1/something-new") != "" {
		t.Errorf("a pattern not in the table has a right")
	}
}

// TestFields: a record's fields are its JSON names in order, those of
// an embedded struct in its place, and what it encodes: every field in
// every record.
func TestFields(t *testing.T) {
	want := []string{"name", "path", "read_only", "allow", "allow_from", "allow_identities", "max_sessions", "migration",
		"write_through", "grants_only", "source", "not_served"}
	if got := Fields[ExportRecord](); !slices.Equal(got, want) {
		t.Errorf("export fields %q, want %q", got, want)
	}
	encodesFields[ExportRecord](t)
	encodesFields[VolumeRecord](t)
	encodesFields[SrvDeviceRecord](t)
	encodesFields[SrvSessionRecord](t)
	encodesFields[CltSessionRecord](t)
	encodesFields[CltPathRecord](t)
	// Lists are [], objects {}, never null.
	b, _ := json.Marshal(ExportRecord{})
	for _, s := range []string{`"allow":[]`, `"allow_from":[]`, `"allow_identities":{}`, `"max_sessions":null`} {
		if !strings.Contains(string(b), s) {
			t.Errorf("an empty export record %s has not %s", b, s)
		}
	}
	if b, _ := json.Marshal(VolumeRecord{}); !strings.Contains(string(b), `"labels":{}`) {
		t.Errorf("an empty volume record %s: labels not {}", b)
	}
}

// encodesFields: a zero T encodes exactly the fields Fields names.
func encodesFields[T any](t *testing.T) {
	t.Helper()
	var rec T
	b, _ := json.Marshal(rec)
	var m map[string]json.RawMessage
	json.Unmarshal(b, &m)
	fields := Fields[T]()
	if len(m) != len(fields) {
		t.Errorf("%T: encodes %d fields, Fields has %d", rec, len(m), len(fields))
	}
	for _, f := range fields {
		if _, ok := m[f]; !ok {
			t.Errorf("%T: field %s not encoded", rec, f)
		}
	}
}

// TestGrants: grants are an object in their order, read back the same.
func TestGrants(t *testing.T) {
	g := Grants{{Identity: "zed", Access: "ro"}, {Identity: "alice", Access: "rw"}}
	b, err := json.Marshal(g)
	if err != nil || string(b) != `{"zed":"ro","alice":"rw"}` {
		t.Fatalf("%s %v", b, err)
	}
	var back Grants
	if err := json.Unmarshal(b, &back); err != nil || !slices.Equal(back, g) {
		t.Fatalf("read back %v %v", back, err)
	}
	if a, ok := back.Access("alice"); !ok || a != "rw" {
		t.Errorf("Access(alice) = %q %v", a, ok)
	}
	if got := back.Identities(); !slices.Equal(got, []string{"alice", "zed"}) {
		t.Errorf("Identities %q", got)
	}
	for _, bad := range []string{`[]`, `{"a":1}`, `{"a":"rw"`, `"x"`} {
		if err := json.Unmarshal([]byte(bad), &back); err == nil {
			t.Errorf("%s read as grants", bad)
		}
	}
}

// TestCallRefusesUnaddressable: a name a URL path cannot carry ("",
// ".", "..") is refused invalid_argument before any request: it would
// reach another route, or none.
func TestCallRefusesUnaddressable(t *testing.T) {
	for _, name := range []string{"", ".", ".."} {
		err := Call(context.Background(), nil, SrvVolumeDelete, []string{name}, nil, nil, nil)
		if ctl.Classify(err) != ctl.CodeInvalid {
			t.Errorf("volume delete %q: %v, want invalid_argument", name, err)
		}
	}
}
