package ctl

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// decodeBody is a request body of the shape the daemons take: names,
// a nested object, a list, a map, a pointer.
type decodeBody struct {
	Name   string            `json:"name"`
	Size   string            `json:"size,omitempty"`
	Force  bool              `json:"force,omitempty"`
	Paths  []string          `json:"paths"`
	Labels map[string]string `json:"labels,omitempty"`
	Inner  struct {
		ReadOnly bool `json:"read_only"`
		Max      int  `json:"max_sessions,omitempty"`
	} `json:"export"`
	Policy *string `json:"mpath_policy,omitempty"`
}

// postRaw posts body as it is to route on the socket sock and gives the
// error the client makes of the answer.
func postRaw(t *testing.T, sock, route string, body []byte) error {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	defer hc.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", "http://daemon"+route, bytes.NewReader(body))
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		return nil
	}
	var e Error
	if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
		t.Fatalf("%s: %v", resp.Status, err)
	}
	return &e
}

// TestDecodeStrict: a body is one JSON object, each key exactly a
// field's name and given once, nothing after it; each refusal is
// invalid_argument saying what was wrong. Through the socket of a
// daemon without bounds (rnbd-client's) and of one with them
// (rnbd-server's).
func TestDecodeStrict(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "d.sock")
	s, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	s.Handle("POST /v1/body", func(r *http.Request) (any, error) {
		var b decodeBody
		return nil, Decode(r, &b)
	})
	served := make(chan error, 1)
	go func() { served <- s.Serve() }()
	defer func() {
		s.Close()
		<-served
	}()
	rig := newAccessRig(t, Access{})

	for _, c := range []struct{ body, says string }{
		{`{"name":"v1","paths":["a"],"export":{"read_only":true}}`, ""},
		{` {"name":"v1"} ` + "\n", ""},
		{`{"name":"v1","name":"v2"}`, `duplicate field "name"`},
		{`{"export":{"read_only":true,"read_only":false}}`, `duplicate field "export.read_only"`},
		{`{"labels":{"a":"1","a":"2"}}`, `duplicate field "labels.a"`},
		{`{"Name":"v1"}`, `unknown field "Name"`},
		{`{"NAME":"v1"}`, `unknown field "NAME"`},
		{`{"export":{"Read_Only":true}}`, `unknown field "export.Read_Only"`},
		{`{"name":"v1"}{"name":"v2"}`, `invalid character '{' after top-level value`},
		{`{"name":"v1"} x`, `invalid character 'x' after top-level value`},
		{`{"name":"v1","other":1}`, `unknown field "other"`},
		{`{"name":1}`, `cannot unmarshal number into Go struct field`},
		{`["v1"]`, `want a JSON object`},
		{`null`, `want a JSON object`},
		{``, `want a JSON object`},
		{`{"name":"v1"`, `unexpected end of JSON input`},
	} {
		err := postRaw(t, sock, "/v1/body", []byte(c.body))
		switch {
		case c.says == "" && err != nil:
			t.Errorf("%q: %v", c.body, err)
		case c.says != "" && (Classify(err) != CodeInvalid || !strings.Contains(err.Error(), c.says)):
			t.Errorf("%q: %v (%s), want invalid_argument saying %q", c.body, err, Classify(err), c.says)
		}
	}
	// The same decoder on a daemon with bounds (a map: any key).
	if err := postRaw(t, rig.sock, "/v1/things", []byte(`{"k":"1","k":"2"}`)); Classify(err) != CodeInvalid ||
		!strings.Contains(fmt.Sprint(err), `duplicate field "k"`) {
		t.Errorf("a key given twice to a daemon with bounds: %v", err)
	}

	// A body past the bound says so, whatever it holds: a whole object,
	// one cut short, or one whose syntax goes wrong past the bound.
	big := strings.Repeat("x", 2<<20)
	for _, body := range []string{`{"name":"` + big + `"}`, `{"name":"` + big, `{"name":"` + big + `",,}`} {
		for where, route := range map[string]string{"without bounds": sock, "with bounds": rig.sock} {
			path := map[string]string{sock: "/v1/body", rig.sock: "/v1/things"}[route]
			err := postRaw(t, route, path, []byte(body))
			if Classify(err) != CodeInvalid || !strings.Contains(err.Error(), "request body larger than 1048576 bytes") {
				t.Errorf("%s: a body of 2 MiB: %.200v, want invalid_argument saying it is too large", where, err)
			}
		}
	}
	// Exactly the bound is taken.
	exact := `{"name":"` + strings.Repeat("x", DefaultMaxBodySize-len(`{"name":""}`)) + `"}`
	if err := postRaw(t, sock, "/v1/body", []byte(exact)); err != nil {
		t.Errorf("a body of exactly %d bytes: %.200v", DefaultMaxBodySize, err)
	}
}

// FuzzDecode: whatever a peer sends, the decoder does not panic, and
// what it takes is what encoding/json makes of it too (strictness only
// refuses, never reads otherwise), and it takes that encoded again.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		`{"name":"v1","paths":["a","b"],"export":{"read_only":true,"max_sessions":2},"labels":{"k":"v"},"mpath_policy":"rr"}`,
		`{"name":"v1","name":"v2"}`, `{"Name":"v1"}`, `{"name":"v1"} {}`, `{"labels":{"a":"1","A":"2"}}`,
		`{"name":"\u00e9\ud800"}`, `{"size":"1e309"}`, `{"export":{"max_sessions":1e3}}`, `{"paths":null}`, `{}`, ` `, `[`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var got decodeBody
		if err := decodeStrict(b, &got); err != nil {
			if Classify(err) != CodeInvalid {
				t.Fatalf("%q: %v is not invalid_argument", b, err)
			}
			return
		}
		var std decodeBody
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&std); err != nil {
			t.Fatalf("%q taken strictly, refused by encoding/json: %v", b, err)
		}
		if !reflect.DeepEqual(got, std) {
			t.Fatalf("%q: strictly %+v, encoding/json %+v", b, got, std)
		}
		again, err := json.Marshal(&got)
		if err != nil {
			t.Fatal(err)
		}
		var back decodeBody
		if err := decodeStrict(again, &back); err != nil {
			t.Fatalf("%q encoded as %s: %v", b, again, err)
		}
	})
}
